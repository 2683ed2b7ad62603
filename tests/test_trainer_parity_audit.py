"""A LoRA fine-tune end to end against the Hugging Face stack a user would run
instead: the same small random transformers checkpoint (Llama, and Gemma 3 /
Qwen2), PEFT's get_peft_model with its own initial A and B copied into
lora.apply(config=...)'s adapters, the same windows with the prompt and a tail
masked (-100 there, -1 here), in the same order, AdamW with the same lr, betas,
eps and weight decay under a linear or cosine schedule (with warmup), with and
without max_grad_norm: transformers' Trainer against ggmlopt.fit, step for step
(the loss each step logs and the adapters at the end)."""
import copy
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt import schedules as S

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

from test_lora_config import _HF, FAMILIES

STEPS, BATCH, T, NTRAIN, LR, WD = 12, 2, 16, 8, 5e-3, 0.1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EPS32 = float(np.finfo(np.float32).eps)


def _checkpoint(family, directory):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**_HF, **extra))
    with torch.no_grad():   # norms off ones
        for _, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(directory)
    return directory


def _start(family, path, dtype=torch.float32, dropout=0.0, how="copy"):
    """(ggmlopt's model, PEFT's model of the checkpoint in dtype, {hf name: (our
    adapter, PEFT's A, B)}): PEFT's initial adapters (A kaiming-uniform, B zero)
    copied into lora.apply(config=...)'s (how="copy") or saved by PEFT and read
    by load_peft (how="load_peft")."""
    from ggmlopt.io import load_hf, load_peft
    from ggmlopt.models.registry import family_of
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = getattr(transformers, FAMILIES[family][1]).from_pretrained(path)
        peft_model = peft.get_peft_model(hf, copy.deepcopy(config)).to(dtype)
    model = load_hf(path)
    if how == "load_peft":
        peft_model.save_pretrained(path / "adapter")
        load_peft(path / "adapter", model)
    else:
        lora.apply(model, config=copy.deepcopy(config))
    prefix = family_of(model).hf_prefix
    pairs = {}
    for name, ours in lora.named_adapters(model):
        t = peft_model.base_model.model.get_submodule(prefix + name)
        a, b = t.lora_A["default"].weight, t.lora_B["default"].weight
        if how == "copy":
            ours.lora_a.data[...] = a.detach().float().numpy().T
            ours.lora_b.data[...] = b.detach().float().numpy().T
        np.testing.assert_array_equal(ours.lora_a.data, a.detach().float().numpy().T)
        assert not ours.lora_b.data.any()
        pairs[name] = (ours, a, b)
    assert len(pairs) == 7 * _HF["num_hidden_layers"]
    return model, peft_model, pairs


def _windows(nval=0):
    """NTRAIN (+ nval) windows of T + 1 tokens: HF's input_ids and labels (-100 on
    a prompt of 2-7 tokens and a tail of 0-3), and ggmlopt's Dataset of the same
    windows (T tokens, each position's next token as its label, -1 masked)."""
    rng = np.random.default_rng(2)
    n = NTRAIN + nval
    seqs = rng.integers(0, _HF["vocab_size"], (n, T + 1))
    labels = seqs.copy()
    for i in range(n):
        labels[i, :rng.integers(2, 8)] = -100
        labels[i, T + 1 - rng.integers(0, 4):] = -100
    ours = np.where(labels[:, 1:] == -100, -1, labels[:, 1:])
    ds = go.Dataset.from_arrays(seqs[:, :T].astype(np.int32), ours.astype(np.int32))
    return seqs[:NTRAIN], labels[:NTRAIN], ds


def _ours(kind, warmup):
    base = go.OptimizerParams(go.AdamWParams(alpha=LR, beta1=0.9, beta2=0.999, eps=1e-8, wd=WD))
    if kind == "linear":
        assert warmup == 0
        return S.Linear(STEPS, base=base, unit="step")
    return S.WarmupCosine(warmup, STEPS, base=base, unit="step")


def _fit(model, ds, kind, warmup, clip):
    """fit over the windows in order; (the loss of each step, the loss of each
    epoch).  The held-out windows make eval_every=1 record each step's running
    training loss (the progress bar's), from which each step's loss follows."""
    h = go.fit(model, ds, "cross_entropy", _ours(kind, warmup), nepoch=None, max_steps=STEPS,
               nbatch_logical=BATCH, val_split=1 - NTRAIN / ds.ndata, eval_every=1,
               shuffle=False, silent=True, clip_grad_norm=clip or None, seed=0)
    assert h.ndata_train == NTRAIN
    steps, per_epoch, prev = [], NTRAIN // BATCH, 0.0
    for e in h.evaluations:
        k = (e.step - 1) % per_epoch + 1   # running mean over the epoch's k steps
        steps.append(k * e.train_loss - (k - 1) * prev)
        prev = e.train_loss
    return np.array(steps), np.array(h.train_loss)


def _trainer(peft_model, seqs, labels, kind, warmup, clip, shifted=None):
    """transformers' Trainer over the windows in order (train_sampling_strategy=
    "sequential"), its default optimizer (torch's AdamW), one micro-batch a step,
    logging every step; shifted: a get_opt_pars schedule whose factors replace
    Trainer's scheduler.  Returns what it logs each step: the loss, the gradient
    norm (before clipping) and the learning rate."""
    import tempfile
    train = [{"input_ids": torch.tensor(s), "labels": torch.tensor(lab)}
             for s, lab in zip(seqs, labels)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS,
            learning_rate=LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.999,
            adam_epsilon=1e-8, lr_scheduler_type=kind, warmup_steps=warmup,
            max_grad_norm=clip, logging_steps=1, report_to=[], save_strategy="no",
            train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, seed=0,
            bf16=False, fp16=False)
        optimizers = (None, None)
        if shifted is not None:
            opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad],
                                    lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
            optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: shifted.factor(s + 1) if s < STEPS else 0.0))
        trainer = transformers.Trainer(model=peft_model, args=args, train_dataset=train,
                                       optimizers=optimizers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == STEPS
    return (np.array([r["loss"] for r in logs], np.float64),
            np.array([r["grad_norm"] for r in logs], np.float64),
            np.array([r["learning_rate"] for r in logs], np.float64))


def _adapters(pairs):
    """{name: (ours, theirs)} of every A and B (ours (in, r) / (r, out), float64)."""
    out = {}
    for name, (ours, a, b) in pairs.items():
        out[name + ".A"] = (ours.lora_a.data.astype(np.float64), a.detach().double().numpy().T)
        out[name + ".B"] = (ours.lora_b.data.astype(np.float64), b.detach().double().numpy().T)
    return out


def _max_diff(x, y):
    return max(float(np.abs(x[k] - y[k]).max()) for k in x)


def _rms(x, y):
    return float(np.sqrt(sum(((x[k] - y[k]) ** 2).sum() for k in x) / sum(x[k].size for k in x)))


def _run(family, path, kind, warmup, clip, how, shifted):
    """fit and Trainer (float32, and float64 as the reference) from the same start:
    {"ours": (step losses, epoch losses, adapters), "hf32"/"hf64": (logged losses,
    grad norms, learning rates, adapters)}."""
    seqs, labels, ds = _windows(nval=2)
    model, peft_model, pairs = _start(family, path, how=how)
    out = {"ours": (*_fit(model, ds, kind, warmup, clip),
                    {k: v[0] for k, v in _adapters(pairs).items()})}
    sched = _ours(kind, warmup) if shifted else None
    out["hf32"] = (*_trainer(peft_model, seqs, labels, kind, warmup, clip, sched),
                   {k: v[1] for k, v in _adapters(pairs).items()})
    _, peft64, pairs64 = _start(family, path, torch.float64)
    out["hf64"] = (*_trainer(peft64, seqs, labels, kind, warmup, clip, sched),
                   {k: v[1] for k, v in _adapters(pairs64).items()})
    return out


@pytest.mark.parametrize("family, kind, warmup, clip, how", [
    ("llama", "linear", 0, 0.0, "copy"),
    ("llama", "linear", 0, 0.3, "load_peft"),
    ("llama", "cosine", 3, 1.0, "copy"),       # Trainer's max_grad_norm default
    ("gemma3", "cosine", 0, 0.3, "copy"),
    ("gemma3", "linear", 0, 0.0, "load_peft"),
    ("qwen2", "cosine", 3, 0.3, "copy")])
def test_fit_follows_trainer_step_for_step(tmp_path, family, kind, warmup, clip, how):
    """12 steps of 2 windows (3 epochs of 4), AdamW lr 5e-3 wd 0.1, over every
    linear layer's adapters.  With warmup, Trainer runs WarmupCosine's factors
    (its own warmup starts at lr 0: test_trainer_s_warmup_is_the_documented_difference).

    The bounds.  Weights: float32 rounding and its growth through 12 AdamW steps
    is what the float32 Trainer's adapters are off the float64 Trainer's (d32;
    AdamW's m / sqrt(v) amplifies it where a gradient element is small, up to
    1e-3 of the adapters' scale here); ours, another float32 computation of the
    same steps, must be as close to float64 within a factor 2 (two independent
    roundings of the same size), plus one float32 ulp of the adapters' scale a
    step.  Losses: the mean of at most BATCH * T token losses, each rounded,
    so BATCH * T * eps32 of the loss (the adapters' difference adds |grad| *
    |dw|, below 1e-6 of it)."""
    path = _checkpoint(family, tmp_path / "ckpt")
    r = _run(family, path, kind, warmup, clip, how, shifted=warmup > 0)
    steps, epochs, ours = r["ours"]
    loss32, _, lr32, hf32 = r["hf32"]
    loss64, norm64, _, hf64 = r["hf64"]
    np.testing.assert_allclose(lr32, [_ours(kind, warmup).lr(t) for t in range(1, STEPS + 1)],
                               rtol=1e-6)
    if 0 < clip < 1:   # clipping is exercised (Trainer's 1.0 is not, here)
        assert (norm64 > clip).sum() >= STEPS // 2
    # the loss of each step, as fit reports it and as Trainer logs it
    loss_bound = BATCH * T * EPS32 * np.abs(loss64)
    assert np.all(np.abs(steps - loss64) <= loss_bound), (steps - loss64, loss_bound)
    assert np.all(np.abs(steps - loss32) <= loss_bound), (steps - loss32, loss_bound)
    # fit's loss of an epoch is the mean of the losses Trainer logs for its steps
    per_epoch = loss64.reshape(-1, NTRAIN // BATCH).mean(axis=1)
    assert np.all(np.abs(epochs - per_epoch) <= BATCH * T * EPS32 * per_epoch)
    d32 = _max_diff(hf32, hf64)
    scale = max(float(np.abs(v).max()) for v in hf64.values())
    bound = 2 * d32 + STEPS * EPS32 * scale
    d_ours = _max_diff(ours, hf64)
    assert d_ours <= bound, (d_ours, d32, bound)
    # the same over all elements (root mean square), where one element's
    # amplified noise weighs little and a systematic difference would show
    floor = STEPS * EPS32 * scale
    assert _rms(ours, hf64) <= 2 * _rms(hf32, hf64) + floor, (_rms(ours, hf64),
                                                              _rms(hf32, hf64))
    # and the adapters moved far beyond that (B from 0)
    moved = max(float(np.abs(v).max()) for k, v in hf64.items() if k.endswith(".B"))
    assert moved > 100 * bound


def test_trainer_s_warmup_is_the_documented_difference(tmp_path):
    """Trainer's own warmup (get_cosine_schedule_with_warmup) trains step 1 at
    lr 0, its gradient still entering AdamW's moments, and reaches lr at step
    warmup + 1; WarmupCosine starts at lr / warmup and reaches lr at step warmup
    (ggml takes no step at rate 0).  The first step's loss agrees (the same
    start); the rest of the run differs far beyond float32 rounding (1e-2 of the
    loss here), as docs/fine-tuning.md says; with WarmupCosine's factors Trainer
    follows fit (test_fit_follows_trainer_step_for_step)."""
    path = _checkpoint("llama", tmp_path / "ckpt")
    seqs, labels, ds = _windows(nval=2)
    model, peft_model, pairs = _start("llama", path)
    steps, _ = _fit(model, ds, "cosine", 3, 0.0)
    loss, _, lrs = _trainer(peft_model, seqs, labels, "cosine", 3, 0.0)
    ours = _ours("cosine", 3)
    assert lrs[0] == 0.0 and ours.lr(1) == pytest.approx(LR / 3, rel=1e-15)
    np.testing.assert_allclose(lrs[1:4], [ours.lr(t) for t in (1, 2, 3)], rtol=1e-6)
    np.testing.assert_allclose(lrs[4:], [ours.lr(t) for t in range(5, STEPS + 1)], rtol=1e-6)
    bound = BATCH * T * EPS32 * loss
    assert abs(steps[0] - loss[0]) <= bound[0]
    assert np.abs(steps - loss).max() > 100 * bound.max()
    adapters = _adapters(pairs)
    assert max(float(np.abs(a - b).max()) for a, b in adapters.values()) > 1e-3
    from pathlib import Path
    doc = " ".join((Path(__file__).parents[1] / "docs" / "fine-tuning.md").read_text().split())
    assert "first warmup step at learning rate 0" in doc


def test_lora_dropout_has_peft_s_expectation_and_eval_outputs(tmp_path):
    """lora_dropout > 0 draws other masks than torch, so only its distribution can
    agree: an adapted layer's output in training over R copies of one input has
    the eval output as its mean (inverted dropout, keep probability 1 - p) and
    the variance p / (1 - p) * sum_i (x_i s (A B)_ij)^2, in ggmlopt as in PEFT;
    in eval mode the model's logits are PEFT's (to float32 rounding of a 3-layer
    model's logits, 1e-4 of their scale, as tests/test_peft_parity_audit.py)."""
    p, R = 0.25, 20000
    path = _checkpoint("llama", tmp_path / "ckpt")
    model, peft_model, pairs = _start("llama", path, dropout=p)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for ours, _, b in pairs.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
            ours.lora_b.data[...] = b.numpy().T
    tokens = np.random.default_rng(3).integers(0, _HF["vocab_size"], (2, 12))
    want = peft_model.eval()(torch.tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())

    ours, a, b = pairs["layers.0.self_attn.q_proj"]
    assert ours.lora_dropout.p == p
    x = np.random.default_rng(4).standard_normal((1, _HF["hidden_size"])).astype(np.float32)
    s = 8 / 4
    ab = a.detach().double().numpy().T @ b.detach().double().numpy().T
    mean = ours.infer(x).astype(np.float64)[0]
    var = p / (1 - p) * ((x[0].astype(np.float64)[:, None] * s * ab) ** 2).sum(axis=0)
    theirs = peft_model.base_model.model.get_submodule("model.layers.0.self_attn.q_proj")
    theirs.train()
    with torch.no_grad():
        ys = {"peft": theirs(torch.tensor(np.repeat(x, R, axis=0))).double().numpy()}
    ours.train()
    ys["ggmlopt"] = ours(np.repeat(x, R, axis=0)).astype(np.float64)
    ours.eval()
    for who, y in ys.items():
        # the mean within 5 standard errors; the variance within 10% (its
        # standard error is about sqrt(2 / R) = 1% of it)
        assert np.all(np.abs(y.mean(axis=0) - mean) <= 5 * np.sqrt(var / R)), who
        np.testing.assert_allclose(y.var(axis=0), var, rtol=0.1, err_msg=who)
