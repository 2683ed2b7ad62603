#!/usr/bin/env bash
# Cross-compiles the C test harness and the kernels (scalar + neon + dispatch +
# thread pool) for aarch64 with a static link and runs it under qemu-aarch64,
# so the NEON path is checked against float64 references and the scalar path on
# an x86-64 machine.  Exits 77 (skip) with a message when the cross tools are
# missing: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
# Arguments go to the harness; the default large size is smaller than natively,
# since qemu runs the code some ten times slower.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/build_harness.sh"

CROSS_CC="${CROSS_CC:-aarch64-linux-gnu-gcc}"
QEMU="${QEMU:-qemu-aarch64}"
install_hint="apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"

for tool in "$CROSS_CC" "$QEMU"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "SKIP: $tool not found; the NEON path is not tested ($install_hint)"
        exit 77
    fi
done
if ! echo '#include <stdio.h>' | "$CROSS_CC" -E -x c - >/dev/null 2>&1; then
    echo "SKIP: $CROSS_CC has no aarch64 C library headers ($install_hint)"
    exit 77
fi

out="$TESTS_DIR/build/aarch64"
build_harness "$CROSS_CC" "$out" -static
if [ "$#" -eq 0 ]; then
    set -- --big 100001 --timeout 600
fi
exec "$QEMU" "$out/test_kernels" "$@"
