"""fit(accumulate="tokens"): Hugging Face Trainer's gradient accumulation (since
transformers 4.46, num_items_in_batch) beside ggml's.  With several micro-batches
a step, ggml's rule (the default) scales each micro-batch's mean loss by
1/opt_period; "tokens" scales it by its labelled positions over the logical
batch's, so the step's gradient and loss are the mean over every labelled
position of the step.  Checked against a float64 NumPy reference, against
Trainer + PEFT LoRA with gradient_accumulation_steps > 1, bit for bit against
the default with one micro-batch a step, through checkpoints and the command."""
import copy
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora, schedules
from ggmlopt.models import Llama, LlamaConfig

EPS32 = float(np.finfo(np.float32).eps)
V, D, T = 13, 8, 6


def _tiny(seed=1):
    return go.nn.Sequential(go.nn.Embedding(V, D, rng=seed), go.nn.Linear(D, V, rng=seed + 1))


def _windows(counts, seed=0, vocab=V, t=T):
    """One window of t token ids per entry of counts, its last counts[i] positions
    labelled (the rest -1, a prompt), as int32 arrays."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (len(counts), t)).astype(np.int32)
    y = rng.integers(0, vocab, (len(counts), t)).astype(np.int32)
    for i, n in enumerate(counts):
        y[i, :t - n] = -1
    return x, y


def _reference(params, x, y, micro):
    """float64: (token-mean loss, {name: (gradient by the tokens rule, by ggml's
    rule, the tokens rule's sum of |terms|)}) of Embedding + Linear on windows x,
    labels y, in micro-batches of micro windows."""
    emb, w, b = (p.astype(np.float64) for p in params)
    h = emb[x]                                         # (n, T, D)
    logits = h @ w + b
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labelled = y >= 0
    d = p.copy()
    d[labelled, y[labelled]] -= 1.0
    d[~labelled] = 0.0
    nll = -np.log(p[labelled, y[labelled]])
    n_step = labelled.sum()
    per_micro = labelled.reshape(-1, micro, T).sum(axis=(1, 2))
    period = len(per_micro)
    weights = {"tokens": np.full(x.shape[0], 1.0 / n_step),
               "batches": np.repeat(1.0 / (period * np.maximum(per_micro, 1)), micro)}
    out = {}
    for rule, wt in weights.items():
        dl = d * wt[:, None, None]
        for name, g in (("emb", _scatter(x, dl @ w.T)), ("w", np.einsum("ntd,ntv->dv", h, dl)),
                        ("b", dl.sum(axis=(0, 1)))):
            out.setdefault(name, {})[rule] = g
    da = np.abs(d) / n_step
    out["emb"]["abs"] = _scatter(x, da @ np.abs(w).T)
    out["w"]["abs"] = np.einsum("ntd,ntv->dv", np.abs(h), da)
    out["b"]["abs"] = da.sum(axis=(0, 1))
    return nll.sum() / n_step, out


def _scatter(x, rows):
    g = np.zeros((V, rows.shape[-1]))
    np.add.at(g, x.reshape(-1), rows.reshape(-1, rows.shape[-1]))
    return g


def _fit_one_step(counts, accumulate, micro=2, **kw):
    x, y = _windows(counts)
    model = _tiny()
    start = [p.data.copy() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="eval: physical batch")  # a masked one
        h = go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", nbatch_logical=len(counts),
                   nbatch_physical=micro, shuffle=False, silent=True, optimizer="sgd",
                   accumulate=accumulate, **kw)
    # the arena's gradients keep the step's sum after its optimizer step
    grads = dict(zip(("emb", "w", "b"), (p.grad.astype(np.float64) for p in model.parameters())))
    return start, x, y, h.train_loss[0], grads


# 3 micro-batches of 2 windows: 1, 12 and 5 labelled positions; with one of none
@pytest.mark.parametrize("counts", [(1, 0, 6, 6, 3, 2), (0, 0, 6, 6, 3, 2)])
def test_gradient_of_a_logical_batch_is_the_token_mean(counts):
    """The gradients after one logical batch are the mean over its labelled
    positions (float64), within float32 rounding: each term's few roundings and
    the sums over the step's N tokens, the D of a row and the V of the head's
    product, bounded by (N + V + D + 8) eps32 times the sum of the terms' |.|;
    the default is ggml's mean of the micro-batches' means, far from it (and as
    close to its own reference).  The loss fit reports is the token mean too,
    also when a micro-batch has no labelled position (it counts for 0)."""
    got = {}
    for rule in ("tokens", "batches"):
        start, x, y, got[rule + " loss"], got[rule] = _fit_one_step(counts, rule)
    loss, ref = _reference(start, x, y, 2)
    n = sum(counts)
    for name, r in ref.items():
        bound = (n + V + D + 8) * EPS32 * r["abs"]
        assert np.all(np.abs(got["tokens"][name] - r["tokens"]) <= bound), name
        assert np.all(np.abs(got["batches"][name] - r["batches"]) <= bound), name
        assert np.abs(r["tokens"] - r["batches"]).max() > 1000 * bound.max(), name
    loss_bound = 4 * n * EPS32 * loss   # a mean of n rounded token losses
    assert abs(got["tokens loss"] - loss) <= loss_bound
    micro_means = [ln for ln in _micro_losses(start, x, y) if ln is not None]
    assert abs(got["batches loss"] - np.mean(micro_means)) <= loss_bound
    assert abs(got["batches loss"] - loss) > 100 * loss_bound


def _micro_losses(params, x, y):
    """float64 mean loss of each micro-batch of 2 windows (None without labels)."""
    out = []
    for i in range(0, len(x), 2):
        xs, ys = x[i:i + 2], y[i:i + 2]
        if (ys >= 0).sum() == 0:
            out.append(None)
            continue
        out.append(_reference(params, xs, ys, 2)[0])
    return out


LLAMA = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 48, "max_seq_len": 32}


def _lm_data(n=12, t=12, seed=3):
    rng = np.random.default_rng(seed)
    return go.Dataset.from_arrays(*_windows(rng.integers(1, t + 1, n), seed, 61, t))


def _lm_fit(accumulate, micro, nepoch=2, **kw):
    model = Llama(LlamaConfig(**LLAMA), seed=1)
    lora.apply(model, rank=4, seed=0)
    h = go.fit(model, _lm_data(), "cross_entropy", nepoch=nepoch, nbatch_logical=6,
               nbatch_physical=micro, silent=True, seed=0, accumulate=accumulate, **kw)
    return [p.data.copy() for p in model.parameters() if p.requires_grad], h


def test_one_micro_batch_a_step_is_the_default_bit_for_bit():
    """nbatch_physical == nbatch_logical: both rules are the mean over the step's
    labelled positions, and "tokens" gives ggml's bits (the fused head's path,
    and the unfused one on Embedding + Linear)."""
    a, ha = _lm_fit("batches", 6)
    b, hb = _lm_fit("tokens", 6)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p, q)
    assert ha.train_loss == hb.train_loss
    x, y = _windows((1, 5, 6, 3), seed=4)
    runs = []
    for rule in ("batches", "tokens"):
        model = _tiny()
        h = go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", nepoch=3,
                   nbatch_logical=2, silent=True, seed=0, accumulate=rule)
        runs.append(([p.data.copy() for p in model.parameters()], h.train_loss))
    for p, q in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(p, q)
    assert runs[0][1] == runs[1][1]


def test_the_fused_head_weighs_tokens_as_the_full_logits():
    """The language model's fused head and loss (context._fused_head_loss) takes
    the token weight as the unfused loss does: the same adapters to float32
    rounding after 4 steps of 3 micro-batches, where ggml's rule is far off."""
    fused, _ = _lm_fit("tokens", 2)
    model = Llama(LlamaConfig(**LLAMA), seed=1)
    model.fused_head = False
    lora.apply(model, rank=4, seed=0)
    go.fit(model, _lm_data(), "cross_entropy", nepoch=2, nbatch_logical=6, nbatch_physical=2,
           silent=True, seed=0, accumulate="tokens")
    full = [p.data for p in model.parameters() if p.requires_grad]
    ggml, _ = _lm_fit("batches", 2)
    scale = max(float(np.abs(p).max()) for p in full)
    d = max(float(np.abs(p - q).max()) for p, q in zip(fused, full))
    d_ggml = max(float(np.abs(p - q).max()) for p, q in zip(ggml, full))
    assert d <= 1e-4 * scale, (d, scale)
    assert d_ggml > 100 * d


# ---- refusals and checkpoints ---------------------------------------------------------

def test_refusals_name_accumulate_and_change_nothing():
    x, y = _windows((1, 2, 3, 4))
    model = _tiny()
    before = [p.data.copy() for p in model.parameters()]
    ds = go.Dataset.from_arrays(x, y)
    with pytest.raises(ValueError, match=r"accumulate: expected 'batches' .* or 'tokens'.*"
                                         r"got 'token'"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, nbatch_physical=2, silent=True,
               accumulate="token")
    with pytest.raises(TypeError, match="accumulate: expected 'batches'"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, silent=True, accumulate=None)
    onehot = np.eye(V, dtype=np.float32)[np.abs(y[:, 0])]
    flat = go.nn.Sequential(go.nn.Linear(T, V, rng=0))
    with pytest.raises(ValueError, match="accumulate: 'tokens' .* labels are float"):
        go.fit(flat, go.Dataset.from_arrays(x.astype(np.float32), onehot), "cross_entropy",
               nbatch_logical=4, nbatch_physical=2, silent=True, accumulate="tokens")
    with pytest.raises(ValueError, match="accumulate: 'tokens' .* loss_type is "
                                         "MEAN_SQUARED_ERROR"):
        go.fit(flat, go.Dataset.from_arrays(x.astype(np.float32), onehot),
               "mean_squared_error", nbatch_logical=4, silent=True, accumulate="tokens")
    from thread_comm import ThreadComm, ThreadGroup
    with pytest.raises(ValueError, match="accumulate: 'tokens' is not supported with comm"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=4, nbatch_physical=2, silent=True,
               accumulate="tokens", comm=ThreadComm(ThreadGroup(1), 0))
    for p, q in zip(before, model.parameters()):
        np.testing.assert_array_equal(p, q.data)
    np.testing.assert_array_equal(ds.permutation, np.arange(4))


@pytest.mark.parametrize("rule", ["batches", "tokens"])
def test_a_resume_goes_on_bit_for_bit_in_its_mode(tmp_path, rule):
    """3 epochs straight, or stopped at step 3 (inside epoch 2) and resumed: the
    same adapters and history, bit for bit; a resume in the other mode is
    refused naming accumulate, before the model changes."""
    straight, h = _lm_fit(rule, 2, nepoch=3)
    path = tmp_path / "c.npz"
    _lm_fit(rule, 2, nepoch=3, checkpoint=path, max_steps=3)
    resumed, h2 = _lm_fit(rule, 2, nepoch=3, checkpoint=path, resume=True)
    for p, q in zip(straight, resumed):
        np.testing.assert_array_equal(p, q)
    assert h.train_loss == h2.train_loss
    assert int(go.checkpoint.load_state(path)["fit.accumulate"]) == (rule == "tokens")
    other = "batches" if rule == "tokens" else "tokens"
    with pytest.raises(ValueError, match=f"fit.accumulate: the checkpoint was made with "
                                         f"accumulate='{rule}', this fit has accumulate="
                                         f"'{other}'.*pass accumulate='{rule}'"):
        _lm_fit(other, 2, nepoch=3, checkpoint=path, resume=True)


def test_a_checkpoint_without_the_entry_was_ggml_s_accumulation(tmp_path):
    path = tmp_path / "c.npz"
    _lm_fit("batches", 2, nepoch=1, checkpoint=path)
    sd = go.checkpoint.load_state(path)
    assert int(sd.pop("fit.accumulate")) == 0
    go.checkpoint.save_state(path, sd)
    _lm_fit("batches", 2, nepoch=2, checkpoint=path, resume=True)
    go.checkpoint.save_state(path, sd)
    with pytest.raises(ValueError, match="accumulate='batches', this fit has accumulate="):
        _lm_fit("tokens", 2, nepoch=2, checkpoint=path, resume=True)


# ---- against transformers' Trainer --------------------------------------------------------

STEPS, LOGICAL, MICRO, NTRAIN, NVAL, TT, LR, WD = 6, 6, 2, 12, 6, 16, 5e-3, 0.1


def _hf_windows():
    """NTRAIN + NVAL windows of TT + 1 tokens, prompts of 1 to 14 tokens masked
    (-100), so the micro-batches' answer tokens differ several-fold (5 to 29);
    HF's (input_ids, labels) of the training ones and ggmlopt's Dataset of all."""
    from test_lora_config import _HF
    rng = np.random.default_rng(5)
    n = NTRAIN + NVAL
    seqs = rng.integers(0, _HF["vocab_size"], (n, TT + 1))
    labels = seqs.copy()
    prompts = [13, 14, 2, 1, 8, 12, 1, 3, 14, 13, 6, 2] + list(rng.integers(1, TT - 1, NVAL))
    for i, prompt in enumerate(prompts):
        labels[i, :prompt + 1] = -100
    ours = np.where(labels[:, 1:] == -100, -1, labels[:, 1:])
    ds = go.Dataset.from_arrays(seqs[:, :TT].astype(np.int32), ours.astype(np.int32))
    return seqs[:NTRAIN], labels[:NTRAIN], ds


def _schedule():
    base = go.OptimizerParams(go.AdamWParams(alpha=LR, beta1=0.9, beta2=0.999, eps=1e-8, wd=WD))
    return schedules.Linear(STEPS, base=base, unit="step")


def _fit_steps(model, ds, rule):
    """fit's loss of each step (from the running training loss each evaluation
    records), in order."""
    h = go.fit(model, ds, "cross_entropy", _schedule(), nepoch=None, max_steps=STEPS,
               nbatch_logical=LOGICAL, nbatch_physical=MICRO, val_split=0.3, eval_every=1,
               shuffle=False, silent=True, seed=0, accumulate=rule)
    assert h.ndata_train == NTRAIN
    steps, per_epoch, prev = [], NTRAIN // LOGICAL, 0.0
    for e in h.evaluations:
        k = (e.step - 1) % per_epoch + 1
        steps.append(k * e.train_loss - (k - 1) * prev)
        prev = e.train_loss
    return np.array(steps)


def _trainer(peft_model, seqs, labels):
    import tempfile

    import torch
    import transformers
    train = [{"input_ids": torch.tensor(s), "labels": torch.tensor(lab)}
             for s, lab in zip(seqs, labels)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=LOGICAL // MICRO, max_steps=STEPS, learning_rate=LR,
            weight_decay=WD, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            lr_scheduler_type="linear", max_grad_norm=0.0, logging_steps=1, report_to=[],
            save_strategy="no", train_sampling_strategy="sequential", use_cpu=True,
            disable_tqdm=True, seed=0, bf16=False, fp16=False)
        trainer = transformers.Trainer(model=peft_model, args=args, train_dataset=train)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == STEPS
    return np.array([r["loss"] for r in logs], np.float64)


def test_fit_follows_trainer_with_gradient_accumulation(tmp_path):
    """6 steps of 3 micro-batches of 2 windows (3 epochs of 2 steps), LoRA
    on every linear layer, AdamW lr 5e-3 wd 0.1, linear decay: accumulate=
    "tokens" follows Trainer's gradient_accumulation_steps=3 step for step.
    The bounds are test_trainer_parity_audit's: the loss of a step is a mean of
    at most LOGICAL * TT rounded token losses (LOGICAL * TT * eps32 of it); the
    adapters within twice the float32 Trainer's distance to the float64 one plus
    one float32 ulp of their scale a step.  ggml's rule (the default) is off by
    more than 100 times the loss bound and 10 times the adapters'."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("safetensors")
    from test_trainer_parity_audit import _adapters, _checkpoint, _max_diff, _rms, _start
    path = _checkpoint("llama", tmp_path / "ckpt")
    seqs, labels, ds = _hf_windows()
    counts = (labels[:, 1:] != -100).sum(axis=1).reshape(-1, MICRO).sum(axis=1)
    assert counts.max() >= 5 * counts.min()    # the rules differ here
    runs = {}
    for rule in ("tokens", "batches"):
        model, _, pairs = _start("llama", path)
        assert model.fused_head
        runs[rule] = (_fit_steps(model, copy.deepcopy(ds), rule),
                      {k: v[0] for k, v in _adapters(pairs).items()})
    _, peft32, pairs32 = _start("llama", path)
    loss32 = _trainer(peft32, seqs, labels)
    hf32 = {k: v[1] for k, v in _adapters(pairs32).items()}
    _, peft64, pairs64 = _start("llama", path, torch.float64)
    loss64 = _trainer(peft64, seqs, labels)
    hf64 = {k: v[1] for k, v in _adapters(pairs64).items()}

    steps, ours = runs["tokens"]
    loss_bound = LOGICAL * TT * EPS32 * np.abs(loss64)
    assert np.all(np.abs(steps - loss64) <= loss_bound), (steps - loss64, loss_bound)
    assert np.all(np.abs(steps - loss32) <= loss_bound), (steps - loss32, loss_bound)
    d32 = _max_diff(hf32, hf64)
    scale = max(float(np.abs(v).max()) for v in hf64.values())
    bound = 2 * d32 + STEPS * EPS32 * scale
    assert _max_diff(ours, hf64) <= bound, (_max_diff(ours, hf64), d32, bound)
    floor = STEPS * EPS32 * scale
    assert _rms(ours, hf64) <= 2 * _rms(hf32, hf64) + floor
    ggml_steps, ggml = runs["batches"]
    assert np.abs(ggml_steps - loss64).max() > 100 * loss_bound.max()
    assert _max_diff(ggml, hf64) > 10 * bound
    print(f"\ntokens: loss {np.abs(steps - loss64).max():.3g} (bound "
          f"{loss_bound.min():.3g}), adapters {_max_diff(ours, hf64):.3g} (bound {bound:.3g}, "
          f"d32 {d32:.3g}); batches: loss {np.abs(ggml_steps - loss64).max():.3g}, adapters "
          f"{_max_diff(ggml, hf64):.3g}")


# ---- the command ----------------------------------------------------------------------

def test_the_command_accumulates_tokens(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files

    from ggmlopt import finetune
    help_text = " ".join(finetune.parser().format_help().split())
    assert "--accumulate {batches,tokens}" in help_text
    assert "Trainer's rule" in help_text
    files = write_files(tmp_path)
    args = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
            "--lora-rank", "4", "-c", "96", "--batch", "4", "--micro-batch", "2",
            "--epochs", "1", "--lr", "1e-2", "--silent", "--seed", "0"]
    outs = {}
    for rule in ("batches", "tokens"):
        out = tmp_path / rule
        assert finetune.main(args + ["--accumulate", rule, "--peft-out", str(out)]) == 0
        outs[rule] = (out / "adapter_model.safetensors").read_bytes()
    assert outs["batches"] != outs["tokens"]   # the micro-batches' answers differ
    with pytest.raises(SystemExit):
        finetune.main(args + ["--accumulate", "token"])
    assert "--accumulate: invalid choice" in capsys.readouterr().err
    pytest.importorskip("mpi4py")
    with pytest.raises(SystemExit):
        finetune.main(args + ["--accumulate", "tokens", "--mpi"])
    assert "--accumulate tokens: not with --mpi" in capsys.readouterr().err
