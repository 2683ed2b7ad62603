"""Training hyper-parameters as a user of torch / transformers' Trainer / TRL /
llama-finetune reads them: the learning rate of every optimizer step under
ggmlopt.schedules against transformers' and torch's schedulers stepped as the
Trainer steps them (scheduler.step() after each optimizer.step(), so step n
uses lr_lambda(n - 1)); fit with gradient clipping, accumulation, a validation
split and max_steps cutting an epoch against the same loop in torch (AdamW and
SGD, full and LoRA); how fit counts steps, batches and validation windows; and
the finetune command's schedule, options and help."""
import argparse

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import finetune, lora, nn
from ggmlopt import schedules as S

EPS32 = float(np.finfo(np.float32).eps)


def torch_lrs(make_scheduler, steps, per_epoch=False):
    """The learning rate each of steps optimizer steps (or epochs) runs at under
    a torch scheduler made by make_scheduler(optimizer) with lr 1, stepped after
    every optimizer step (or epoch) as transformers' Trainer and torch's docs do."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# ---- schedules -----------------------------------------------------------------------

@pytest.mark.parametrize("total", [1, 2, 7, 10])
def test_linear_and_cosine_by_step_are_transformers_schedules(total):
    transformers = pytest.importorskip("transformers")
    lin = torch_lrs(lambda o: transformers.get_linear_schedule_with_warmup(o, 0, total), total)
    cos = torch_lrs(lambda o: transformers.get_cosine_schedule_with_warmup(o, 0, total), total)
    for t in range(1, total + 1):   # ggmlopt's t is ctx.iter, 1-based
        assert S.Linear(total, unit="step").factor(t) == pytest.approx(lin[t - 1], rel=1e-12)
        assert S.Cosine(total, unit="step").factor(t) == pytest.approx(cos[t - 1], rel=1e-12)
    # the last step is the smallest rate of the run, and it is not 0
    assert lin[-1] == min(lin) > 0 and cos[-1] == min(cos) > 0


@pytest.mark.parametrize("warmup,total", [(1, 5), (3, 10), (4, 6)])
def test_warmup_cosine_is_transformers_one_step_sooner_in_the_warmup_only(warmup, total):
    """The documented difference: transformers' warmup trains its first step at
    lr 0 and reaches lr at step warmup + 1; ggmlopt's at step t <= warmup is
    lr * t / warmup (never 0), and steps warmup and warmup + 1 both run at lr;
    the cosine after the warmup is transformers' step for step."""
    transformers = pytest.importorskip("transformers")
    hf = torch_lrs(lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, total),
                   total + 1)
    sched = S.WarmupCosine(warmup, total, unit="step")
    assert hf[0] == 0.0
    for t in range(1, total + 1):
        expected = hf[t] if t <= warmup else hf[t - 1]
        assert sched.factor(t) == pytest.approx(expected, rel=1e-12), t
    assert sched.factor(warmup) == sched.factor(warmup + 1) == 1.0


def test_step_linear_cosine_by_epoch_are_torch_schedulers_stepped_per_epoch():
    torch = pytest.importorskip("torch")
    lr_sched = torch.optim.lr_scheduler
    n = 9
    cases = [(S.Step(3, 0.5), lambda o: lr_sched.StepLR(o, 3, 0.5)),
             (S.Linear(6, 0.2, 0.05), lambda o: lr_sched.LinearLR(o, 0.2, 0.05, 6)),
             (S.Cosine(6, 0.1), lambda o: lr_sched.CosineAnnealingLR(o, 6, eta_min=0.1))]
    for ours, theirs in cases:
        ref = torch_lrs(theirs, n if not isinstance(ours, S.Cosine) else 7)
        for epoch, lr in enumerate(ref, 1):   # fit hands get_opt_pars the 1-based epoch
            assert ours.lr(epoch) / 1e-3 == pytest.approx(lr, rel=1e-12), (ours, epoch)


# ---- fit against torch ---------------------------------------------------------------

def _model(use_lora):
    rng = np.random.default_rng(0)
    m = nn.Sequential(nn.Linear(8, 16, rng=rng), nn.Tanh(), nn.Linear(16, 4, rng=rng))
    if use_lora:
        lora.apply(m, rank=2, alpha=4.0, targets=("0", "2"), seed=3)
        for name, p in m.named_parameters():   # B nonzero, so every adapter moves
            if name.endswith("lora_b"):
                p.data[...] = np.random.default_rng(4).standard_normal(p.data.shape) * 0.3
    return m


@pytest.mark.parametrize("use_lora,optimizer,schedule,clip", [
    (False, "adamw", "linear", 0.5), (True, "adamw", "cosine", 0.3),
    (False, "sgd", "cosine", 0.5), (True, "sgd", "linear", 0.3)])
def test_fit_equals_the_torch_loop(use_lora, optimizer, schedule, clip):
    """20 optimizer steps of 2 physical batches, 6 a epoch (val_split 0.25 holds the
    last 2 logical batches out), so max_steps=20 cuts the fourth epoch after 2:
    torch.optim.AdamW / SGD under transformers' schedule and clip_grad_norm_ over the
    trainable tensors (LoRA: the adapters), the loss divided by the accumulation
    steps, in float64."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    steps, L, P, ndata, lr, wd = 20, 8, 4, 64, 0.05, 0.1
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ndata, 8)).astype(np.float32)
    y = rng.standard_normal((ndata, 4)).astype(np.float32)
    m = _model(use_lora)
    w0 = {n: p.data.astype(np.float64) for n, p in m.named_parameters()}
    train = [n for n, p in m.named_parameters() if getattr(p, "requires_grad", True)]
    base = go.OptimizerParams(go.AdamWParams(alpha=lr, wd=wd), go.SGDParams(alpha=lr, wd=wd))
    ours = (S.Linear if schedule == "linear" else S.Cosine)(steps, base=base, unit="step")
    history = go.fit(m, go.Dataset.from_arrays(x, y), "mean_squared_error", ours, nepoch=None,
                     max_steps=steps, nbatch_logical=L, nbatch_physical=P, val_split=0.25,
                     silent=True, optimizer=optimizer, clip_grad_norm=clip, shuffle=False,
                     seed=0)
    assert len(history) == 4 and history.ndata_train == 48

    w = {n: torch.tensor(v, requires_grad=n in train) for n, v in w0.items()}
    params = [w[n] for n in train]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    else:   # ggml's SGD decay w * (1 - lr * wd) is torch's L2 term without momentum
        opt = torch.optim.SGD(params, lr=lr, weight_decay=wd)
    make = (transformers.get_linear_schedule_with_warmup if schedule == "linear"
            else transformers.get_cosine_schedule_with_warmup)
    sched = make(opt, 0, steps)

    def linear(i, h):
        out = h @ w[f"{i}.weight"] + w[f"{i}.bias"]
        if use_lora:
            out = out + h @ w[f"{i}.lora_a"] @ w[f"{i}.lora_b"] * 2.0
        return out

    X, Y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    clipped = 0
    for step in range(steps):
        b = step % 6   # the first 6 logical batches train, in order (shuffle=False)
        opt.zero_grad()
        for k in range(L // P):
            s = slice(b * L + k * P, b * L + (k + 1) * P)
            out = linear(2, torch.tanh(linear(0, X[s])))
            (torch.nn.functional.mse_loss(out, Y[s]) / (L // P)).backward()
        clipped += float(torch.nn.utils.clip_grad_norm_(params, clip)) > clip
        opt.step()
        sched.step()
    assert clipped >= steps // 2   # the clipping is exercised

    scale = max(np.abs(w[n].detach().numpy()).max() for n in w)
    for name, p in m.named_parameters():
        ref = w[name].detach().numpy()
        if name not in train:   # frozen: never changed, not even rounded
            np.testing.assert_array_equal(p.data, w0[name].astype(np.float32), err_msg=name)
            continue
        # a few float32 roundings of the weights' size per step, over 20 steps
        np.testing.assert_allclose(p.data, ref, rtol=0, atol=4 * steps * EPS32 * scale,
                                   err_msg=name)


# ---- counting ------------------------------------------------------------------------

class _Recorder:
    """A layer that records, for each forward pass, whether it trained and the
    datapoints' indices (column 0)."""

    def __init__(self):
        self.training, self.log = False, []

    def parameters(self):
        return []

    def forward(self, x):
        self.log.append((self.training, tuple(int(v) for v in x[:, 0])))
        return x

    def backward(self, grad):
        return grad


def test_steps_batches_and_validation_windows_are_counted_as_documented():
    """32 datapoints, logical batches of 4 in physical batches of 2, val_split 0.25:
    6 optimizer steps an epoch, the last 8 datapoints validate (shuffle=False: in
    order, as llama-finetune); max_steps=7 cuts epoch 2 after one step, which still
    validates; the step schedule sees t = 1..7; eval_every=2 evaluates after the
    steps 2, 4, 6 (6 being epoch 1's validation)."""
    x = np.zeros((32, 3), np.float32)
    x[:, 0] = np.arange(32)
    rec = _Recorder()
    model = nn.Sequential(rec, nn.Linear(3, 2, rng=np.random.default_rng(0)))
    seen = []

    class Recorded(S.Constant):
        def __call__(self, userdata):
            seen.append(self._t(userdata))
            return super().__call__(userdata)

    history = go.fit(model, go.Dataset.from_arrays(x, np.zeros((32, 2), np.float32)),
                     "mean_squared_error", Recorded(unit="step"), nepoch=None, max_steps=7,
                     nbatch_logical=4, nbatch_physical=2, val_split=0.25, eval_every=2,
                     shuffle=False, silent=True, seed=0)
    assert seen[1:] == [1, 2, 3, 4, 5, 6, 7]   # (seen[0]: fit's check of the last step)
    log = rec.log[1:]   # (the context's first forward pass on zeros, learning the shapes)
    trained = [b for t, b in log if t]
    assert trained == [(i, i + 1) for i in range(0, 24, 2)] + [(0, 1), (2, 3)]
    val = [(i, i + 1) for i in range(24, 32, 2)]
    # steps 2 and 4 pause epoch 1 to validate; step 6's evaluation is epoch 1's validation
    assert [b for t, b in log if not t] == val * 4
    assert [e.step for e in history.evaluations] == [2, 4, 6]
    assert [e.epoch for e in history.epochs] == [1, 2]
    assert (history.ndata_train, history.ndata_val) == (24, 8)


# ---- the finetune command -------------------------------------------------------------

def _args(**kw):
    ns = {"lr": 1e-3, "weight_decay": 0.0, "max_steps": None, "epochs": None,
          "lr_schedule": "constant", "warmup": 0}
    return argparse.Namespace(**{**ns, **kw})


def test_finetune_schedules_are_what_its_help_says():
    transformers = pytest.importorskip("transformers")
    spe = 5
    lin = finetune._optimizer(_args(lr_schedule="linear", epochs=2), spe)
    cos = finetune._optimizer(_args(lr_schedule="cosine", max_steps=7), spe)
    warm = finetune._optimizer(_args(lr_schedule="cosine", warmup=3, max_steps=9), spe)
    const = finetune._optimizer(_args(), spe)
    hf_lin = torch_lrs(lambda o: transformers.get_linear_schedule_with_warmup(o, 0, 10), 10)
    hf_cos = torch_lrs(lambda o: transformers.get_cosine_schedule_with_warmup(o, 0, 7), 7)
    hf_warm = torch_lrs(lambda o: transformers.get_cosine_schedule_with_warmup(o, 3, 9), 10)
    for t in range(1, 11):
        assert lin.lr(t) == pytest.approx(1e-3 * hf_lin[t - 1], rel=1e-12)
        assert const.lr(t) == 1e-3
    for t in range(1, 8):
        assert cos.lr(t) == pytest.approx(1e-3 * hf_cos[t - 1], rel=1e-12)
    for t in range(1, 10):   # --warmup N: step t <= N at lr * t / N, the cosine HF's
        expected = 1e-3 * t / 3 if t <= 3 else 1e-3 * hf_warm[t - 1]
        assert warm.lr(t) == pytest.approx(expected, rel=1e-12)
    # the linear decay and the constant rate after a warmup, HF's likewise
    warm_lin = finetune._optimizer(_args(lr_schedule="linear", warmup=2, max_steps=8), spe)
    warm_const = finetune._optimizer(_args(warmup=2, max_steps=8), spe)
    hf_warm_lin = torch_lrs(lambda o: transformers.get_linear_schedule_with_warmup(o, 2, 8), 8)
    for t in range(1, 9):
        assert warm_lin.lr(t) == pytest.approx(1e-3 * t / 2 if t <= 2 else
                                               1e-3 * hf_warm_lin[t - 1], rel=1e-12)
        assert warm_const.lr(t) == pytest.approx(1e-3 * min(t / 2, 1), rel=1e-12)
    helps = {a.dest: a.help for a in finetune.parser()._actions}
    assert "t/N" in helps["warmup"] and "Hugging Face's warmup starts at 0" in helps["warmup"]
    assert "decay to 0" in helps["lr_schedule"]
    assert "Trainer leaves those out" in helps["weight_decay"]


def test_finetune_takes_llama_finetunes_epochs_flag():
    """llama-finetune spells it -epochs (and --epochs); argparse said "unrecognized
    arguments: -epochs 3"."""
    base = ["-m", "model.gguf", "--data", "train.jsonl"]
    assert finetune.parser().parse_args(base + ["-epochs", "3"]).epochs == 3
    assert finetune.parser().parse_args(base + ["--epochs", "2"]).epochs == 2
