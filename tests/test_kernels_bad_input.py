"""Bad arguments: a clear exception naming the argument (TypeError for a type or
dtype, ValueError for a size, shape, layout, writability, overlap or value,
IndexError for an index), raised before anything is written."""
import re

import numpy as np
import pytest

from ggmlopt import kernels

F32 = np.float32
N = 33
HP = {"alpha": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.0, "beta1h": 10.0, "beta2h": 1000.0}


def f32(n=N, value=1.5):
    return np.full(n, value, F32)


def read_only(a):
    a.flags.writeable = False
    return a


def two_views_of_one_buffer(n=N):
    """Two writable float32 arrays of n elements sharing all but one element."""
    buf = np.full(n + 1, 1.5, F32)
    return buf[:n], buf[1:]


# Each case builds fresh arguments and returns (call, outputs): the call must raise,
# and every array in outputs must be unchanged afterwards.

def adamw(**change):
    args = {"w": f32(), "g": f32(), "m": f32(), "v": f32()}
    args.update(change)
    hp = {k: args.pop(k) for k in list(args) if k in HP}
    hp = {**HP, **hp}
    outs = [a for k, a in args.items() if k in "wmv" and isinstance(a, np.ndarray)]
    return (lambda: kernels.adamw_step(args["w"], args["g"], args["m"], args["v"], **hp)), outs


def adamw_overlap():
    a, b = two_views_of_one_buffer()
    return adamw(w=a, m=b)


def adamw_same_array():
    w = f32()
    return adamw(w=w, v=w)


def sgd(**change):
    args = {"w": f32(), "g": f32(), "alpha": 0.1}
    args.update(change)
    return (lambda: kernels.sgd_step(args["w"], args["g"], alpha=args["alpha"])), [args["w"]]


def axpy(**change):
    args = {"a": 2.0, "x": f32(), "y": f32()}
    args.update(change)
    return (lambda: kernels.axpy(args["a"], args["x"], args["y"])), [args["y"]]


def axpy_overlap():
    x, y = two_views_of_one_buffer()
    return axpy(x=x, y=y)


def ce(**change):
    args = {"logits": np.zeros((4, 9), F32), "labels": np.full((4, 9), 1 / 9, F32),
                "grad": np.full((4, 9), 5.0, F32), "grad_scale": 1.0}
    args.update(change)
    outs = [args["grad"]] if isinstance(args["grad"], np.ndarray) else []
    return (lambda: kernels.cross_entropy(args["logits"], args["labels"], args["grad"],
                                          grad_scale=args["grad_scale"])), outs


def ce_grad_is_logits():
    x = np.zeros((4, 9), F32)
    return ce(logits=x, grad=x)


def sgd_g_is_w():
    w = f32()
    return sgd(w=w, g=w)


def se(**change):
    args = {"out": f32(), "labels": f32(value=0.5), "grad": f32(value=5.0), "grad_scale": 1.0}
    args.update(change)
    outs = [args["grad"]] if isinstance(args["grad"], np.ndarray) else []
    return (lambda: kernels.squared_error(args["out"], args["labels"], args["grad"],
                                          grad_scale=args["grad_scale"])), outs


def se_grad_is_labels():
    lab = f32(value=0.5)
    return se(labels=lab, grad=lab)


def argmax(**change):
    args = {"x": np.zeros((4, 9), F32), "out": np.full(4, -3, np.int32)}
    args.update(change)
    outs = [args["out"]] if isinstance(args["out"], np.ndarray) else []
    return (lambda: kernels.argmax_rows(args["x"], out=args["out"])), outs


def argmax_out_inside_x():
    x = np.zeros((4, 9), F32)
    return argmax(x=x, out=x.reshape(-1).view(np.int32)[:4])


def convert(**change):
    args = {"src": np.arange(N, dtype=np.uint8), "out": f32(value=-1.0), "scale": 1.0}
    args.update(change)
    outs = [args["out"]] if isinstance(args["out"], np.ndarray) else []
    return (lambda: kernels.to_float32(args["src"], args["out"], scale=args["scale"])), outs


def convert_overlap():
    out = f32(n=N)
    return convert(src=out.view(np.uint8)[:N], out=out)


def gather(**change):
    args = {"src": np.arange(24, dtype=F32).reshape(6, 4), "dst": np.full((3, 4), -1.0, F32),
                "perm": np.array([5, 0, 2], np.int64), "scale": None}
    args.update(change)
    outs = [args["dst"]] if isinstance(args["dst"], np.ndarray) else []
    return (lambda: kernels.gather_shards(args["src"], args["dst"], args["perm"],
                                          scale=args["scale"])), outs


def gather_dst_inside_src():
    src = np.arange(24, dtype=F32).reshape(6, 4)
    return gather(src=src, dst=src[3:])


def gather_dst_is_perm():
    perm = np.array([0, 1], np.int64)
    return gather(src=np.arange(6, dtype=np.int64), dst=perm, perm=perm)


CASES = [
    # AdamW
    ("adamw g float64", TypeError, r"^g:", lambda: adamw(g=np.ones(N))),
    ("adamw w int32", TypeError, r"^w:", lambda: adamw(w=np.ones(N, np.int32))),
    ("adamw m list", TypeError, r"^m:", lambda: adamw(m=[0.0] * N)),
    ("adamw v big-endian", TypeError, r"^v:", lambda: adamw(v=f32().astype(">f4"))),
    ("adamw g short", ValueError, r"^g:", lambda: adamw(g=f32(N - 1))),
    ("adamw v long", ValueError, r"^v:", lambda: adamw(v=f32(N + 1))),
    ("adamw w strided", ValueError, r"^w:.*contiguous", lambda: adamw(w=f32(2 * N)[::2])),
    ("adamw m read-only", ValueError, r"^m:.*read-only", lambda: adamw(m=read_only(f32()))),
    ("adamw w read-only", ValueError, r"^w:.*read-only", lambda: adamw(w=read_only(f32()))),
    ("adamw w/m overlap", ValueError, r"w and m overlap", adamw_overlap),
    ("adamw w is v", ValueError, r"w and v overlap", adamw_same_array),
    ("adamw alpha nan", ValueError, r"^alpha:", lambda: adamw(alpha=float("nan"))),
    ("adamw beta1h inf", ValueError, r"^beta1h:", lambda: adamw(beta1h=float("inf"))),
    ("adamw eps str", TypeError, r"^eps:", lambda: adamw(eps="small")),
    # SGD
    ("sgd g float16", TypeError, r"^g:", lambda: sgd(g=f32().astype(np.float16))),
    ("sgd g short", ValueError, r"^g:", lambda: sgd(g=f32(N - 2))),
    ("sgd w read-only", ValueError, r"^w:", lambda: sgd(w=read_only(f32()))),
    ("sgd g is w", ValueError, r"w and g overlap", sgd_g_is_w),
    ("sgd alpha inf", ValueError, r"^alpha:", lambda: sgd(alpha=float("inf"))),
    # axpy
    ("axpy x float64", TypeError, r"^x:", lambda: axpy(x=np.ones(N))),
    ("axpy y read-only", ValueError, r"^y:", lambda: axpy(y=read_only(f32()))),
    ("axpy sizes", ValueError, r"^x:", lambda: axpy(x=f32(N + 1))),
    ("axpy partial overlap", ValueError, r"overlap", axpy_overlap),
    ("axpy a nan", ValueError, r"^a:", lambda: axpy(a=float("nan"))),
    # cross-entropy
    ("ce logits float64", TypeError, r"^logits:", lambda: ce(logits=np.zeros((4, 9)))),
    ("ce labels int32 one-hot", ValueError, r"^labels:.*class indices.*\(4,\)",
     lambda: ce(labels=np.zeros((4, 9), np.int32))),
    ("ce labels int64", TypeError, r"^labels:.*int32 class indices",
     lambda: ce(labels=np.zeros(4, np.int64))),
    ("ce class too large", IndexError, r"^labels:.*class 9 at row 2.*\[0, 9\)",
     lambda: ce(labels=np.array([0, 1, 9, 2], np.int32))),
    ("ce class negative", IndexError, r"^labels:.*class -1 at row 3",
     lambda: ce(labels=np.array([[0], [1], [8], [-1]], np.int32))),
    ("ce classes rows", ValueError, r"^labels:", lambda: ce(labels=np.zeros(5, np.int32))),
    ("ce labels shape", ValueError, r"^labels:", lambda: ce(labels=np.zeros((9, 4), F32))),
    ("ce labels 1-D", ValueError, r"^labels:", lambda: ce(labels=np.zeros(36, F32))),
    ("ce logits 1-D", ValueError, r"^logits:", lambda: ce(logits=np.zeros(36, F32))),
    ("ce zero rows", ValueError, r"^logits:.*zero rows",
     lambda: ce(logits=np.zeros((0, 9), F32), labels=np.zeros((0, 9), F32))),
    ("ce zero columns", ValueError, r"^logits:.*column",
     lambda: ce(logits=np.zeros((4, 0), F32), labels=np.zeros((4, 0), F32))),
    ("ce grad size", ValueError, r"^grad:", lambda: ce(grad=np.zeros((4, 8), F32))),
    ("ce grad float64", TypeError, r"^grad:", lambda: ce(grad=np.zeros((4, 9)))),
    ("ce grad read-only", ValueError, r"^grad:",
     lambda: ce(grad=read_only(np.zeros((4, 9), F32)))),
    ("ce grad strided", ValueError, r"^grad:",
     lambda: ce(grad=np.zeros((4, 18), F32)[:, ::2])),
    ("ce grad is logits", ValueError, r"grad and logits overlap", ce_grad_is_logits),
    ("ce grad_scale nan", ValueError, r"^grad_scale:", lambda: ce(grad_scale=float("nan"))),
    # squared error
    ("se labels short", ValueError, r"^labels:", lambda: se(labels=f32(N - 1))),
    ("se out int32", TypeError, r"^out:", lambda: se(out=np.ones(N, np.int32))),
    ("se grad short", ValueError, r"^grad:", lambda: se(grad=f32(N - 1))),
    ("se grad is labels", ValueError, r"grad and labels overlap", se_grad_is_labels),
    ("se grad read-only", ValueError, r"^grad:", lambda: se(grad=read_only(f32()))),
    # argmax
    ("argmax x 1-D", ValueError, r"^x:.*2-D", lambda: argmax(x=np.zeros(9, F32))),
    ("argmax zero columns", ValueError, r"^x:.*column", lambda: argmax(x=np.zeros((4, 0), F32))),
    ("argmax out size", ValueError, r"^out:", lambda: argmax(out=np.zeros(5, np.int32))),
    ("argmax out int64", TypeError, r"^out:", lambda: argmax(out=np.zeros(4, np.int64))),
    ("argmax out read-only", ValueError, r"^out:",
     lambda: argmax(out=read_only(np.zeros(4, np.int32)))),
    ("argmax out inside x", ValueError, r"x and out overlap", argmax_out_inside_x),
    ("argmax x float64", TypeError, r"^x:", lambda: argmax(x=np.zeros((4, 9)))),
    # to_float32
    ("convert src float32", TypeError, r"^src:", lambda: convert(src=f32())),
    ("convert src list", TypeError, r"^src:", lambda: convert(src=[1, 2, 3])),
    ("convert out float64", TypeError, r"^out:", lambda: convert(out=np.zeros(N))),
    ("convert out size", ValueError, r"^out:", lambda: convert(out=f32(N + 1))),
    ("convert out read-only", ValueError, r"^out:", lambda: convert(out=read_only(f32()))),
    ("convert src strided", ValueError, r"^src:",
     lambda: convert(src=np.zeros(2 * N, np.uint8)[::2])),
    ("convert overlap", ValueError, r"src and out overlap", convert_overlap),
    ("convert scale nan", ValueError, r"^scale:", lambda: convert(scale=float("nan"))),
    # gather_shards
    ("gather src list", TypeError, r"^src:", lambda: gather(src=[[1.0] * 4] * 6)),
    ("gather src object", TypeError, r"^src:",
     lambda: gather(src=np.array([object()] * 6), dst=np.array([None] * 3, dtype=object))),
    ("gather src 0-d", ValueError, r"^src:", lambda: gather(src=np.array(1.0, F32))),
    ("gather src strided", ValueError, r"^src:",
     lambda: gather(src=np.zeros((6, 8), F32)[:, ::2])),
    ("gather perm int32", TypeError, r"^perm:", lambda: gather(perm=np.array([0, 1, 2], np.int32))),
    ("gather perm list", TypeError, r"^perm:", lambda: gather(perm=[0, 1, 2])),
    ("gather dst float64", TypeError, r"^dst:", lambda: gather(dst=np.zeros((3, 4)))),
    ("gather dst size", ValueError, r"^dst:", lambda: gather(dst=np.zeros((2, 4), F32))),
    ("gather dst read-only", ValueError, r"^dst:",
     lambda: gather(dst=read_only(np.zeros((3, 4), F32)))),
    ("gather dst inside src", ValueError, r"src and dst overlap", gather_dst_inside_src),
    ("gather dst is perm", ValueError, r"perm and dst overlap", gather_dst_is_perm),
    ("gather raw with scale", ValueError, r"^scale:", lambda: gather(scale=2.0)),
    ("gather perm negative", IndexError, r"^perm:", lambda: gather(perm=np.array([0, -1, 2]))),
    ("gather perm too big", IndexError, r"^perm:", lambda: gather(perm=np.array([0, 6, 2]))),
    ("gather u8 perm too big", IndexError, r"^perm:",
     lambda: gather(src=np.zeros((6, 4), np.uint8), perm=np.array([9, 0, 1]))),
]


@pytest.mark.parametrize("exc,pattern,build", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_raises_and_writes_nothing(exc, pattern, build):
    call, outputs = build()
    before = [o.copy() for o in outputs]
    with pytest.raises(exc, match=pattern):
        call()
    for out, old in zip(outputs, before):
        np.testing.assert_array_equal(out, old)


@pytest.mark.parametrize("call", [kernels.sum, kernels.sumsq, kernels.mean],
                         ids=["sum", "sumsq", "mean"])
def test_reductions_check_their_input(call):
    with pytest.raises(TypeError, match=r"^x:"):
        call(np.ones(5))
    with pytest.raises(TypeError, match=r"^x:"):
        call([1.0, 2.0])
    with pytest.raises(ValueError, match=r"^x:.*contiguous"):
        call(np.ones(10, F32)[::2])


def test_mean_of_empty_array_is_an_error():
    with pytest.raises(ValueError, match=r"^x:.*empty"):
        kernels.mean(np.zeros(0, F32))


def test_count_equal_checks_dtype_and_size():
    with pytest.raises(TypeError, match=r"^b:"):
        kernels.count_equal(np.zeros(3, np.int32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"^b:"):
        kernels.count_equal(np.zeros(3, np.int32), np.zeros(4, np.int32))


def test_scale_and_fill_check_their_arguments():
    x = f32()
    with pytest.raises(ValueError, match=r"^a:"):
        kernels.scale(x, float("nan"))
    with pytest.raises(ValueError, match=r"^x:.*read-only"):
        kernels.scale(read_only(f32()), 2.0)
    with pytest.raises(TypeError, match=r"^value:"):
        kernels.fill(x, "one")
    with pytest.raises(TypeError, match=r"^x:"):
        kernels.fill(np.zeros(3), 1.0)
    assert np.all(x == 1.5)


def test_adamw_bias_corrections_need_an_integer_iteration():
    with pytest.raises(TypeError, match=r"^iteration:"):
        kernels.adamw_bias_corrections(0.9, 0.999, 1.5)
    with pytest.raises(TypeError, match=r"^iteration:"):
        kernels.adamw_bias_corrections(0.9, 0.999, True)
    assert kernels.adamw_bias_corrections(0.9, 0.999, np.int64(2))[0] == pytest.approx(
        1 / (1 - 0.81), rel=1e-5)
    with pytest.raises(ValueError, match="iteration"):
        kernels.adamw_bias_corrections(0.9, 0.999, -3)


def test_run_time_settings_check_their_arguments(restore_threads):
    with pytest.raises(ValueError, match=r"^n:"):
        kernels.set_num_threads(0)
    with pytest.raises(TypeError, match=r"^n:"):
        kernels.set_num_threads("2")
    with pytest.raises(TypeError, match=r"^n:"):
        kernels.set_num_threads(True)
    assert kernels.get_num_threads() == restore_threads
    active = kernels.simd_info()["active"]
    with pytest.raises(TypeError, match=r"^name:"):
        kernels.use_simd(2)
    with pytest.raises(ValueError, match=re.escape("'sse9'")):
        kernels.use_simd("sse9")
    assert kernels.simd_info()["active"] == active


def test_a_path_the_build_or_cpu_lacks_is_refused():
    missing = [p for p in ("avx512", "avx2", "neon") if p not in kernels.simd_paths()]
    active = kernels.simd_info()["active"]
    for name in missing:
        with pytest.raises(ValueError, match=re.escape(repr(name))):
            kernels.use_simd(name)
    assert kernels.simd_info()["active"] == active
