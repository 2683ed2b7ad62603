"""The precision is a setting of a checkpoint, like the loss type and the
optimizer: saved, restored by OptContext.load, and checked by load_state_dict
and by fit's resume, so a run goes on in the precision it started in (another
precision would take neither run's trajectory).

The precision saved is the one asked for: on a machine without bf16 products a
bf16 context warns and runs float32, and its checkpoint still says bf16; it
also says the precision that ran, and a resume that runs in the other one warns.
"""
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.checkpoint import load_state

pytestmark = pytest.mark.filterwarnings("ignore:precision='bf16'")


def model():
    return go.nn.Sequential(go.nn.Linear(8, 16, rng=0), go.nn.ReLU(), go.nn.Linear(16, 4, rng=1))


def dataset():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, 40)]
    return go.Dataset.from_arrays(x, y)


def fit(m, path, precision, nepoch=1, resume=False):
    return go.fit(m, dataset(), "cross_entropy", nepoch=nepoch, nbatch_logical=10,
                  nbatch_physical=10, silent=True, checkpoint=path, resume=resume,
                  precision=precision)


def context(precision):
    ctx = go.OptContext(model(), loss_type="cross_entropy", precision=precision)
    ctx.alloc(True)
    ctx.eval(None, inputs=np.ones((2, 8), np.float32), labels=np.eye(4, dtype=np.float32)[:2])
    return ctx


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_the_state_names_its_precision_and_load_restores_it(tmp_path, precision):
    ctx = context(precision)
    assert ctx.state_dict()["precision"] == precision
    ctx.save(tmp_path / "c.npz")
    assert load_state(tmp_path / "c.npz")["precision"] == precision
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = go.OptContext.load(tmp_path / "c.npz", model())
    assert loaded.state_dict()["precision"] == precision
    assert loaded.precision == ctx.precision   # what runs here, from the same request


def test_another_precision_s_state_is_refused_and_nothing_changes():
    f32, bf16 = context("f32"), context("bf16")
    before = f32.state_dict()
    with pytest.raises(ValueError, match="precision='bf16'.*precision='f32'"):
        f32.load_state_dict(bf16.state_dict())
    after = f32.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before
               if isinstance(before[k], np.ndarray))


def test_a_state_without_the_entry_is_float32_s():
    """Files written before the entry existed come from float32 runs."""
    sd = context("f32").state_dict()
    del sd["precision"]
    ctx = context("f32")
    ctx.load_state_dict(sd)
    assert ctx.state_dict()["precision"] == "f32"


@pytest.mark.parametrize("saved,resumed", [("bf16", "f32"), ("f32", "bf16")])
def test_fit_resumes_only_in_the_checkpoint_s_precision(tmp_path, saved, resumed):
    path = tmp_path / "fit.npz"
    fit(model(), path, saved)
    m = model()
    weights = [p.data.copy() for p in m.parameters()]
    with pytest.raises(ValueError, match=f"precision={saved!r}"):
        fit(m, path, resumed, nepoch=2, resume=True)
    # refused before the context takes the model
    assert all(np.array_equal(w, p.data) for w, p in zip(weights, m.parameters()))
    history = fit(m, path, saved, nepoch=2, resume=True)
    assert len(history.epochs) == 2


def test_a_precision_of_the_wrong_type_is_a_type_error():
    for bad in (16, None, b"bf16"):
        with pytest.raises(TypeError, match="precision"):
            go.OptContext(model(), precision=bad)
        with pytest.raises(TypeError, match="precision"):
            go.fit(model(), dataset(), "cross_entropy", nbatch_logical=10, silent=True,
                   precision=bad)


def test_a_resume_that_multiplies_otherwise_than_the_saved_run_warns(tmp_path, monkeypatch):
    # bf16 asked for on a machine without bf16 products ran float32; resumed where
    # they run, the products change mid-run: allowed, and said
    from ggmlopt import gemm

    native, _ = gemm.bf16_support()
    if not native:
        pytest.skip("this machine has no bf16 products to resume on")
    with monkeypatch.context() as m:
        m.setattr(gemm, "bf16_support", lambda: (False, "no bf16 products here"))
        fell_back = context("bf16")
    assert fell_back.precision == "f32"
    sd = fell_back.state_dict()
    assert (sd["precision"], sd["precision_run"]) == ("bf16", "f32")
    resumed = context("bf16")
    assert resumed.precision == "bf16"
    with pytest.warns(UserWarning, match="multiplied in f32 and this machine multiplies in bf16"):
        resumed.load_state_dict(sd)
    np.testing.assert_array_equal(resumed.state_dict()["param.0"], sd["param.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        context("bf16").load_state_dict(resumed.state_dict())   # the same: no word


def test_a_resume_across_the_products_warns_once(tmp_path, monkeypatch):
    # fit's resume and OptContext.load check the state before the context's
    # load_state_dict does: the warning comes from the latter alone
    from ggmlopt import gemm

    if not gemm.bf16_support()[0]:
        pytest.skip("this machine has no bf16 products to resume on")
    with monkeypatch.context() as m:
        m.setattr(gemm, "bf16_support", lambda: (False, "no bf16 products here"))
        fit(model(), tmp_path / "run.npz", "bf16")
        context("bf16").save(tmp_path / "ctx.npz")
    for resume in (lambda: fit(model(), tmp_path / "run.npz", "bf16", nepoch=2, resume=True),
                   lambda: go.OptContext.load(tmp_path / "ctx.npz", model())):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resume()
        said = [w for w in seen if "precision_run" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in said]


def test_a_state_without_the_run_s_precision_loads_quietly():
    sd = context("bf16").state_dict()
    del sd["precision_run"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        context("bf16").load_state_dict(sd)
