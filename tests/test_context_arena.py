"""ParamArena: sections, views, and whole-arena kernels."""
import numpy as np
import pytest

from ggmlopt import kernels
from ggmlopt._arena import ParamArena


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4097])
def test_sections_are_aligned_and_zeroed(n):
    a = ParamArena(n, True)
    assert a.section % 16 == 0 and a.section >= n
    for which in ("weights", "grads", "m", "v"):
        flat = a.flat(which)
        assert flat.shape == (n,) and flat.ctypes.data % 64 == 0 and not flat.any()
    assert not np.shares_memory(a.flat("weights"), a.flat("grads"))


def test_adamw_and_sgd_match_the_kernels():
    rng = np.random.default_rng(0)
    n = 1000
    a = ParamArena(n, True)
    w, g = a.flat("weights"), a.flat("grads")
    w[...] = rng.standard_normal(n)
    g[...] = rng.standard_normal(n)
    w2, m2, v2 = w.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, 1)
    a.adamw_step(1e-3, 0.9, 0.999, 1e-8, 0.01, b1h, b2h)
    kernels.adamw_step(w2, g, m2, v2, alpha=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01,
                       beta1h=b1h, beta2h=b2h)
    np.testing.assert_array_equal(w, w2)
    np.testing.assert_array_equal(a.flat("m"), m2)
    w3 = w.copy()
    a.sgd_step(0.1, 0.0)
    np.testing.assert_allclose(w, w3 - 0.1 * g, rtol=1e-6)
    assert a.grad_sumsq() == pytest.approx(float((g.astype(np.float64) ** 2).sum()))
    a.zero_grads()
    a.zero_momenta()
    assert not g.any() and not a.flat("m").any() and not a.flat("v").any()


def test_views_keep_memory_alive_and_check_bounds():
    a = ParamArena(10)
    v = a.view("weights", 4, (2, 3))
    v[...] = 7
    del a
    assert (v == 7).all()
    b = ParamArena(10)
    with pytest.raises(ValueError):
        b.view("weights", 8, (3,))
    with pytest.raises(ValueError, match="no 'm'"):
        b.flat("m")
    with pytest.raises(ValueError):
        b.flat("nope")
    with pytest.raises(RuntimeError):
        b.adamw_step(1, 0, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError):
        ParamArena(0)


@pytest.mark.parametrize("n,min_section,expect", [(1, 0, 16), (17, 0, 32), (17, 5, 32),
                                                  (17, 33, 48), (100, 112, 112), (1, 1, 16)])
def test_min_section_pads_every_section(n, min_section, expect):
    # ggmlopt.distributed pads the sections so that P equal shards cover them
    a = ParamArena(n, True, min_section)
    assert a.section == expect
    for which in ("weights", "grads", "m", "v"):
        padded = a.padded(which)
        assert padded.shape == (expect,) and padded.ctypes.data % 64 == 0 and not padded.any()
        assert np.shares_memory(padded, a.flat(which))
        assert padded.ctypes.data == a.flat(which).ctypes.data
    a.flat("grads")[...] = 1
    a.sgd_step(0.5, 0.0)  # kernels never touch the padding
    assert a.padded("weights")[n:].tolist() == [0.0] * (expect - n)
    assert a.padded("weights")[:n].tolist() == [-0.5] * n


def test_bad_min_section_and_padded_section():
    with pytest.raises(ValueError, match="min_section"):
        ParamArena(4, False, -1)
    with pytest.raises(ValueError, match="no 'm' section"):
        ParamArena(4, False, 32).padded("m")
    with pytest.raises(ValueError, match="which"):
        ParamArena(4).padded("bias")
