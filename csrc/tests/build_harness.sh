# Sourced by the run_*.sh scripts: compiles the C test harness and the kernels
# the way setup.py does (baseline flags for every file, the ISA flags only for
# kernels_avx2.c, kernels_avx512.c and kernels_avx512bf16.c), so the harness tests the objects the package ships.
#
#   build_harness CC OUTDIR [extra flags for compiling and linking...]
# Leaves the program at OUTDIR/test_kernels.

TESTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$TESTS_DIR/../.." && pwd)"

build_harness() {
    local cc="$1" outdir="$2"
    shift 2
    local extra=("$@")
    local base=(-O2 -std=c11 -fno-math-errno -Wall -Wextra -pthread
                -I"$ROOT_DIR/ggmlopt/include" -I"$ROOT_DIR/csrc" -I"$TESTS_DIR")
    local machine
    machine="$("$cc" -dumpmachine)"
    mkdir -p "$outdir"

    # source:extra ISA flags
    local units=(
        "csrc/dispatch.c:"
        "csrc/threadpool.c:"
        "csrc/kernels_scalar.c:"
        "csrc/quantize_k.c:"
        "csrc/decode_block.c:"
        "csrc/tests/harness.c:"
        "csrc/tests/test_public_api.c:"
        "csrc/tests/test_kernels.c:"
        "csrc/tests/test_kernels_conv.c:"
        "csrc/tests/test_kernels_conv_direct.c:"
        "csrc/tests/test_activation.c:"
        "csrc/tests/test_lm_layers.c:"
        "csrc/tests/test_attention.c:"
        "csrc/tests/test_quant.c:"
        "csrc/tests/test_decode_block.c:"
        "csrc/tests/test_gemm.c:"
        "csrc/tests/test_gemm_bf16.c:"
        "csrc/tests/test_matmul_columns.c:"
    )
    case "$machine" in
        x86_64*) units+=("csrc/kernels_avx2.c:-mavx2 -mfma -mf16c"
                         "csrc/kernels_avx512.c:-mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c"
                         "csrc/kernels_avx512bf16.c:-mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c -mavx512bf16") ;;
        aarch64*) units+=("csrc/kernels_neon.c:") ;;
    esac

    # the units compile in parallel (one job per core at most): the harness is built
    # several times per test run (native, sanitizers, valgrind, aarch64)
    local jobs
    jobs="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
    local objects=() unit src flags obj
    rm -f "$outdir"/*.failed
    for unit in "${units[@]}"; do
        src="${unit%%:*}"
        flags="${unit#*:}"
        obj="$outdir/$(basename "${src%.c}").o"
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
        # each job leaves a .failed file when its compiler fails (a job's status is
        # not kept reliably once another wait has reaped it)
        # shellcheck disable=SC2086  # flags is a word list
        { "$cc" "${base[@]}" $flags "${extra[@]}" -c "$ROOT_DIR/$src" -o "$obj" \
            || touch "$obj.failed"; } &
        objects+=("$obj")
    done
    wait
    if compgen -G "$outdir/*.failed" >/dev/null; then
        echo "build_harness: failed to compile: $(cd "$outdir" && ls ./*.failed)" >&2
        return 1
    fi
    "$cc" "${base[@]}" "${extra[@]}" "${objects[@]}" -o "$outdir/test_kernels" -lm
}
