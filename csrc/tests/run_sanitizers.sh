#!/usr/bin/env bash
# Builds the C test harness with AddressSanitizer and UndefinedBehaviorSanitizer
# (into csrc/tests/build/asan) and runs it; any report ends the run with a
# non-zero status.  The harness allocates every array at its exact size, so a
# kernel reading or writing one element past its end is reported here.
#   --valgrind   also run the plain native build under valgrind memcheck, at the
#                same time as the sanitizer run (each prints when it is done)
# Other arguments go to the harness.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/build_harness.sh"

with_valgrind=0
args=()
for a in "$@"; do
    if [ "$a" = "--valgrind" ]; then with_valgrind=1; else args+=("$a"); fi
done
if [ "$with_valgrind" -eq 1 ] && ! command -v valgrind >/dev/null 2>&1; then
    echo "valgrind not found: memcheck run skipped"
    with_valgrind=0
fi

out="$TESTS_DIR/build/asan"
# -fno-sanitize-recover: a UBSan finding aborts instead of printing and going on
build_harness "${CC:-gcc}" "$out" -fsanitize=address,undefined -fno-sanitize-recover=all \
    -fno-omit-frame-pointer -g
if [ "$with_valgrind" -eq 1 ]; then
    plain="$TESTS_DIR/build/valgrind"
    build_harness "${CC:-gcc}" "$plain" -g
fi

# exit code 86 tells a sanitizer report apart from failed checks (exit 1)
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:exitcode=86}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:exitcode=86}"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
vstatus=0
if [ "$with_valgrind" -eq 1 ]; then
    # valgrind runs some 30x slower: a smaller large size; it runs beside the
    # sanitizer run (the two are independent), its output kept for after
    ( valgrind --quiet --error-exitcode=86 --leak-check=full --show-possibly-lost=no \
        --errors-for-leak-kinds=definite "$plain/test_kernels" --big 70001 --timeout 900 \
        "${args[@]}" >"$logs/valgrind" 2>&1 || echo $? >"$logs/valgrind.status" ) &
    vpid=$!
fi

status=0
echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
"$out/test_kernels" "${args[@]}" || status=$?
if [ "$status" -eq 86 ]; then echo "sanitizer report: see above"; fi

if [ "$with_valgrind" -eq 1 ]; then
    wait "$vpid" || true
    echo "== valgrind memcheck"
    cat "$logs/valgrind"
    if [ -f "$logs/valgrind.status" ]; then vstatus="$(cat "$logs/valgrind.status")"; fi
    if [ "$vstatus" -eq 86 ]; then echo "valgrind report: see above"; fi
    if [ "$status" -eq 0 ] || [ "$vstatus" -eq 86 ]; then status=$vstatus; fi
fi
exit "$status"
