"""ggmlopt.schedules against their formulas, and plugged into OptContext and fit."""
import math

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import schedules as S

BASE = go.OptimizerParams(go.AdamWParams(alpha=0.02, beta1=0.8, beta2=0.95, eps=1e-6, wd=0.1),
                          go.SGDParams(alpha=0.5, wd=0.2))


def reference(kind, t, **kw):
    """The documented formulas, written out again in float64."""
    if kind == "constant":
        return 1.0
    if kind == "step":
        return kw["gamma"] ** math.floor((t - 1) / kw["step_size"])
    if kind == "linear":
        T = kw["total"]
        s, e = kw.get("start_factor", 1.0), kw.get("end_factor", 0.0)
        return s + (e - s) * min(t - 1, T) / T
    m = kw.get("min_factor", 0.0)
    if kind == "cosine":
        T = kw["total"]
        return m + (1 - m) * (1 + math.cos(math.pi * min(t - 1, T) / T)) / 2
    W, T = kw["warmup"], kw["total"]
    if t <= W:
        return t / W
    if kind == "warmup_linear":
        e = kw.get("end_factor", 0.0)
        return e if T == W else 1 + (e - 1) * min(t - 1 - W, T - W) / (T - W)
    if T == W:
        return m
    return m + (1 - m) * (1 + math.cos(math.pi * min(t - 1 - W, T - W) / (T - W))) / 2


CASES = [
    ("constant", S.Constant, {}),
    ("step", S.Step, {"step_size": 3, "gamma": 0.5}),
    ("step", S.Step, {"step_size": 1, "gamma": 0.9}),
    ("linear", S.Linear, {"total": 7}),
    ("linear", S.Linear, {"total": 1, "start_factor": 0.5, "end_factor": 2.0}),
    ("linear", S.Linear, {"total": 5, "start_factor": 0.1, "end_factor": 1.0}),
    ("cosine", S.Cosine, {"total": 9}),
    ("cosine", S.Cosine, {"total": 4, "min_factor": 0.25}),
    ("warmup_cosine", S.WarmupCosine, {"warmup": 3, "total": 10}),
    ("warmup_cosine", S.WarmupCosine, {"warmup": 0, "total": 6, "min_factor": 0.1}),
    ("warmup_cosine", S.WarmupCosine, {"warmup": 4, "total": 4, "min_factor": 0.3}),
    ("warmup_linear", S.WarmupLinear, {"warmup": 3, "total": 10}),
    ("warmup_linear", S.WarmupLinear, {"warmup": 0, "total": 6, "end_factor": 0.1}),
    ("warmup_linear", S.WarmupLinear, {"warmup": 2, "total": 7, "end_factor": 1.0}),
    ("warmup_linear", S.WarmupLinear, {"warmup": 4, "total": 4, "end_factor": 0.3}),
]


@pytest.mark.parametrize("kind,cls,kw", CASES, ids=[f"{c[0]}{c[2]}" for c in CASES])
def test_factors_match_the_formulas(kind, cls, kw):
    sched = cls(base=BASE, **kw)
    total = kw.get("total", 12)
    end = {"linear": kw.get("end_factor", 0.0), "cosine": kw.get("min_factor", 0.0),
           "warmup_cosine": kw.get("min_factor", 0.0),
           "warmup_linear": kw.get("end_factor", 0.0)}.get(kind, 1.0)
    last = total + 3 if end > 0 else total
    for t in range(1, last + 1):
        f = reference(kind, t, **kw)
        assert sched.factor(t) == pytest.approx(f, rel=1e-12, abs=1e-15), t
        assert f > 0
        p = sched(t)
        # only the two learning rates change
        assert p.adamw.alpha == pytest.approx(0.02 * f, rel=1e-12)
        assert p.sgd.alpha == pytest.approx(0.5 * f, rel=1e-12)
        assert (p.adamw.beta1, p.adamw.beta2, p.adamw.eps, p.adamw.wd, p.sgd.wd) == \
            (0.8, 0.95, 1e-6, 0.1, 0.2)
        assert sched.lr(t, "sgd") == pytest.approx(0.5 * f, rel=1e-12)
    assert BASE.adamw.alpha == 0.02  # the base is never modified


def test_landmarks():
    assert S.Cosine(total=10).factor(1) == 1.0
    assert S.Cosine(total=10).factor(6) == pytest.approx(0.5)
    assert S.Linear(total=4).factor(3) == pytest.approx(0.5)
    wc = S.WarmupCosine(warmup=4, total=12, min_factor=0.2)
    assert [wc.factor(t) for t in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]
    assert wc.factor(13) == pytest.approx(0.2) and wc.factor(100) == pytest.approx(0.2)
    assert [S.Step(2, 0.1).factor(t) for t in (1, 2, 3, 5)] == pytest.approx([1, 1, 0.1, 0.01])
    # the default base is ggml's default parameters
    assert S.Constant()(1) == go.default_optimizer_params()
    assert S.cosine is S.Cosine and S.warmup_cosine is S.WarmupCosine
    wl = S.WarmupLinear(warmup=4, total=12)
    assert [wl.factor(t) for t in (1, 2, 4, 5, 9, 12)] == pytest.approx([0.25, 0.5, 1, 1, 0.5,
                                                                         0.125])
    assert S.warmup_linear is S.WarmupLinear


def test_warmup_linear_is_hugging_faces_schedule_shifted_into_the_warmup():
    # get_linear_schedule_with_warmup / get_constant_schedule_with_warmup at the 0-based
    # step t - 1: the decay step for step, the warmup one step ahead (no rate 0)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for warmup, total, end, make in (
            (3, 10, 0.0, lambda o: transformers.get_linear_schedule_with_warmup(o, 3, 10)),
            (1, 5, 0.0, lambda o: transformers.get_linear_schedule_with_warmup(o, 1, 5)),
            (4, 9, 1.0, lambda o: transformers.get_constant_schedule_with_warmup(o, 4))):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        hf = make(opt)
        factors = []
        for _ in range(total):
            factors.append(opt.param_groups[0]["lr"])
            opt.step()
            hf.step()
        ours = S.WarmupLinear(warmup, total, end_factor=end)
        for t in range(1, total + 1):
            want = t / warmup if t <= warmup else factors[t - 1]
            assert ours.factor(t) == pytest.approx(want, rel=1e-12, abs=1e-15), (warmup, t)


def test_argument_errors():
    for make, exc, match in [
        (lambda: S.Linear(total=0), ValueError, "total.*>= 1"),
        (lambda: S.Cosine(total=2.5), TypeError, "total.*int"),
        (lambda: S.Cosine(total=True), TypeError, "total"),
        (lambda: S.WarmupCosine(warmup=5, total=4), ValueError, "warmup.*total=4"),
        (lambda: S.WarmupCosine(warmup=-1, total=4), ValueError, "warmup.*>= 0"),
        (lambda: S.WarmupLinear(warmup=5, total=4), ValueError, "warmup.*total=4"),
        (lambda: S.WarmupLinear(warmup=1, total=4, end_factor=-1), ValueError, "end_factor"),
        (lambda: S.Cosine(total=3, min_factor=1.5), ValueError, "min_factor"),
        (lambda: S.Cosine(total=3, min_factor=float("nan")), ValueError, "min_factor"),
        (lambda: S.Linear(total=3, start_factor=0), ValueError, "start_factor.*> 0"),
        (lambda: S.Linear(total=3, end_factor=-0.1), ValueError, "end_factor.*>= 0"),
        (lambda: S.Step(step_size=0), ValueError, "step_size"),
        (lambda: S.Step(step_size=2, gamma=0), ValueError, "gamma.*> 0"),
        (lambda: S.Step(step_size=2, gamma=float("inf")), ValueError, "gamma"),
        (lambda: S.Constant(unit="batch"), ValueError, "unit"),
        (lambda: S.Constant(base={"alpha": 1}), TypeError, "base.*OptimizerParams"),
    ]:
        with pytest.raises(exc, match=match):
            make()
    epoch = S.Cosine(total=3)
    for ud, exc, match in [(0, ValueError, ">= 1"), (None, TypeError, "fit hands it"),
                           (1.0, TypeError, "int"), (True, TypeError, "int")]:
        with pytest.raises(exc, match=match):
            epoch(ud)
    with pytest.raises(TypeError, match="OptContext"):
        S.Cosine(total=3, unit="step")("ctx")
    # past the end with an end value of 0 there is no learning rate left
    with pytest.raises(ValueError, match="past total=3"):
        epoch(4)
    with pytest.raises(ValueError, match="past total=2.*end_factor"):
        S.Linear(total=2)(3)


def _tiny_problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = np.eye(2, dtype=np.float32)[(x[:, 0] > 0).astype(int)]
    return go.Dataset.from_arrays(x, y), go.nn.Linear(3, 2, rng=1)


class Recorder:
    """A schedule-like get_opt_pars that records the t it is asked for."""

    def __init__(self, sched):
        self.sched, self.seen = sched, []
        self.unit = sched.unit

    def __call__(self, userdata):
        self.seen.append(self.sched._t(userdata))
        return self.sched(userdata)


@pytest.mark.parametrize("optimizer", list(go.OptimizerType))
def test_per_step_schedule_sees_ctx_iter_and_sets_the_step(optimizer):
    sched = S.WarmupCosine(warmup=2, total=6, base=BASE, unit="step")
    rec = Recorder(sched)
    model = go.nn.Linear(3, 2, rng=1)
    ctx = go.OptContext(model, batch_size=2, ne_datapoint=3, loss_type=go.LossType.CROSS_ENTROPY,
                        optimizer=optimizer, opt_period=2, get_opt_pars=rec, get_opt_pars_ud=77)
    ds, _ = _tiny_problem()
    go.epoch(ctx, ds)  # 6 physical batches, 3 optimizer steps
    assert rec.seen == [1, 2, 3]
    sd = ctx.state_dict()
    key = "adamw.alpha" if optimizer == go.OptimizerType.ADAMW else "sgd.alpha"
    base_alpha = 0.02 if optimizer == go.OptimizerType.ADAMW else 0.5
    assert sd[key] == float(np.float32(base_alpha * sched.factor(3)))


def test_sgd_step_uses_the_scheduled_rate():
    # SGD, one parameter, MEAN loss: w -= alpha(t) * d mean / dw exactly
    class Bias:
        def __init__(self):
            self.b = go.nn.Parameter(np.zeros(1, np.float32))

        def parameters(self):
            return [self.b]

        def forward(self, x):
            return x + self.b.data

        def backward(self, g):
            self.b.grad += g.sum(dtype=np.float32)

    sched = S.Step(1, gamma=0.5, base=go.OptimizerParams(sgd=go.SGDParams(alpha=1.0)),
                   unit="step")
    m = Bias()
    ctx = go.OptContext(m, batch_size=1, ne_datapoint=1, optimizer=go.OptimizerType.SGD,
                        get_opt_pars=sched)
    ws = []
    for _ in range(4):
        ctx.alloc(True)
        ctx.eval(None, inputs=np.zeros((1, 1)))
        ws.append(float(m.b.data[0]))
    # d mean / d b = 1: b = -(1 + 0.5 + 0.25 + 0.125)
    assert ws == [-1.0, -1.5, -1.75, -1.875]


def test_per_epoch_schedule_in_fit_gets_the_epoch():
    ds, model = _tiny_problem()
    rec = Recorder(S.Cosine(total=3, min_factor=0.5, base=BASE))
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=rec, nepoch=3,
           nbatch_logical=6, silent=True)
    assert rec.seen == [1, 1, 2, 2, 3, 3]
    rec = Recorder(S.Cosine(total=10, base=BASE, unit="step"))
    ds, model = _tiny_problem()
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=rec, nepoch=3,
           nbatch_logical=6, silent=True)
    assert rec.seen == [1, 2, 3, 4, 5, 6]


def test_a_per_step_schedule_wrapped_in_a_function_refuses_fit_s_epoch():
    # fit hands a function the epoch; a per-step schedule inside it would read the
    # epoch as the step (and not decay within an epoch): refused, naming the way out
    ds, model = _tiny_problem()
    sched = S.WarmupCosine(warmup=2, total=6, base=BASE, unit="step")
    with pytest.raises(ValueError, match="per-step schedule was handed fit's epoch"):
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=lambda ud: sched(ud),
               nepoch=1, nbatch_logical=6, silent=True)
    # the epoch is still the int ggml hands over: a function reading it works as before
    seen = []
    go.fit(model, ds, go.LossType.CROSS_ENTROPY,
           get_opt_pars=lambda ud: seen.append(ud) or BASE, nepoch=2, nbatch_logical=6,
           silent=True)
    assert seen == [1, 1, 2, 2] and all(isinstance(e, int) for e in seen)
    assert S.WarmupCosine(warmup=2, total=6, base=BASE, unit="epoch")(seen[-1]) is not None
