#!/usr/bin/env bash
# Builds the C test harness with the host compiler (setup.py's kind of flags)
# into csrc/tests/build/native and runs it.  Arguments go to the harness
# (e.g. --big 70001).  CC overrides the compiler.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/build_harness.sh"

out="$TESTS_DIR/build/native"
build_harness "${CC:-gcc}" "$out"
exec "$out/test_kernels" "$@"
