"""Audit of fit(accumulate="tokens") in the combinations test_token_weighted_accumulation
leaves out: every step's gradient must be the mean over the labelled positions of
its logical batch, and the loss fit reports for it their mean loss.

Two kinds of check.  On Embedding + Linear (the unfused loss path) the last step's
gradient is compared with a float64 reference of the token mean at the parameters
before that step, on the rows the dataset's permutation put in it, within the
bound of test_token_weighted_accumulation ((N + V + D + 8) eps32 times the sum of
the terms' |.|).  On the tiny Llama + LoRA (fused head unless said) one step is
run with 3 micro-batches of 2 windows and with one micro-batch of 6: under
"tokens" both are the token mean of the same 6 windows, computed by the same
per-token arithmetic; only the order of the sums over the step's R = 72 rows (and
the float32 weights n_i/N, 2 roundings) differ, so each entry differs by at most
about (R + 8) eps32 times the sum of its terms' |.|; we check (R + 8) eps32 times
4 max|g| of the tensor (a 4x allowance for cancellation in the sum), where ggml's
rule is off by more than 1000 times that."""
import os
import pathlib
import sys
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig

sys.path.insert(0, os.path.dirname(__file__))
from test_token_weighted_accumulation import EPS32, D, T, V, _reference, _tiny

LL = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
      "ffn_dim": 48, "max_seq_len": 32}
TT = 12


def _windows(n, t, vocab, seed, empty=()):
    """n windows of t ids, the last 1..t positions labelled, windows in empty none."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, t)).astype(np.int32)
    y = rng.integers(0, vocab, (n, t)).astype(np.int32)
    for i, c in enumerate(rng.integers(1, t + 1, n)):
        y[i, :t - c] = -1
    y[list(empty)] = -1
    return x, y


# ---- against a float64 reference: shuffles, drop_last, validation, empty micro-batches --

def _tiny_fit(x, y, steps, monkeypatch, **kw):
    """fit's run, with each step's (parameters before it, its gradient, the
    dataset's order) recorded as SGD's step receives them (a validation after
    the step clears the arena's gradients)."""
    model = _tiny()
    ds = go.Dataset.from_arrays(x, y)
    seen = []
    step = go.optimizers.SGD.step

    def recording(self, weights, grads, state, hyper, iteration):
        seen.append(([p.data.astype(np.float64) for p in model.parameters()],
                     [p.grad.astype(np.float64) for p in model.parameters()],
                     np.asarray(ds.permutation)))
        return step(self, weights, grads, state, hyper, iteration)
    monkeypatch.setattr(go.optimizers.SGD, "step", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = go.fit(model, ds, "cross_entropy", nepoch=None, max_steps=steps, nbatch_logical=6,
                   nbatch_physical=2, silent=True, seed=3, optimizer="sgd",
                   accumulate="tokens", **kw)
    assert len(seen) == steps
    return model, seen, h


CASES = {
    "shuffle, drop_last, ragged": {"n": 20, "drop_last": True},
    "shuffle='train', validation": {"n": 24, "val_split": 0.25, "eval_every": 1, "shuffle": "train"},
    "shuffle=True, validation": {"n": 24, "val_split": 0.25, "eval_every": 1},
    "shuffle=False, validation": {"n": 24, "val_split": 0.25, "eval_every": 1, "shuffle": False},
    "last micro-batch masked": {"n": 12, "empty": (4, 5, 10, 11), "shuffle": False},
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_is_the_token_mean_of_its_rows(case, monkeypatch):
    kw = dict(CASES[case])
    n, empty = kw.pop("n"), kw.pop("empty", ())
    x, y = _windows(n, T, V, 7, empty)
    model, seen, h = _tiny_fit(x, y, 5, monkeypatch, **kw)   # into epoch 2 or 3: reshuffled
    per_epoch = h.ndata_train // 6
    losses = []
    for s, (params, grads, perm) in enumerate(seen):
        k = s % per_epoch   # the step's place in its epoch
        rows = perm[6 * k:6 * (k + 1)]
        xs, ys = x[rows], y[rows]
        loss, ref = _reference(params, xs, ys, 2)
        losses.append(loss)
        nlab = int((ys >= 0).sum())
        for name, got in zip(("emb", "w", "b"), grads):
            r = ref[name]
            bound = (nlab + V + D + 8) * EPS32 * r["abs"]
            assert np.all(np.abs(got - r["tokens"]) <= bound), (case, s, name)
            assert np.abs(r["tokens"] - r["batches"]).max() > 100 * bound.max(), (case, name)
    if kw.get("eval_every") == 1:
        # the running training loss each evaluation records: each step's token mean
        prev = 0.0
        for s, e in enumerate(h.evaluations):
            kk = s % per_epoch + 1
            step_loss = kk * e.train_loss - (kk - 1) * prev
            prev = e.train_loss
            assert abs(step_loss - losses[s]) <= 1e-6 * losses[s], (case, s)
        # validation keeps ggml's plain mean: the mean of its micro-batch means
        e = h.evaluations[-1]
        val = seen[-1][2][h.ndata_train:]
        now = [p.data for p in model.parameters()]
        means = [_reference(now, x[val[i:i + 2]], y[val[i:i + 2]], 2)[0]
                 for i in range(0, len(val), 2)]
        assert abs(e.val_loss - np.mean(means)) <= 1e-6 * np.mean(means), (case, e.val_loss)


# ---- regrouped: 3 micro-batches a step against one ------------------------------------

def _llama(fused=True, checkpointing=False):
    model = Llama(LlamaConfig(**LL), seed=1)
    model.fused_head = fused
    if checkpointing:
        model.gradient_checkpointing_enable()
    lora.apply(model, rank=4, seed=0)
    return model


def _kept_llama(tmp):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = pathlib.Path(tmp) / "q8.gguf"
    if not path.exists():
        save_gguf(Llama(LlamaConfig(**{**LL, "vocab_size": 257}), seed=1), path,
                  tokenizer=ByteTokenizer(), dtype="q8_0")
    model, _ = load_gguf(path, keep_types=True)
    assert go.nn.quantized.quantized_layers(model)
    lora.apply(model, rank=4, seed=0)
    return model


def _packed(x):
    from ggmlopt.nn.positions import mark_document_starts
    starts = np.zeros(x.shape, bool)
    starts[:, 0] = True
    starts[::2, TT // 2] = True   # two documents in every other window
    marked = mark_document_starts(x, starts)
    assert (marked < 0).any()
    return marked


REGROUPED = {
    "bf16": {"precision": "bf16"},
    "gradient checkpointing, bf16": {"checkpointing": True, "precision": "bf16"},
    "unfused head": {"fused": False},
    "unfused head, bf16, checkpointing": {"fused": False, "precision": "bf16",
                                              "checkpointing": True},
    "packed windows": {"packed": True},
    "last micro-batch masked": {"empty": (4, 5)},
    "ndata_shard=2": {"shard": 2},
    "kept q8_0 base": {"kept": True},
}


def _one_step(case, rule, micro, tmp):
    kw = dict(REGROUPED[case])
    vocab = 257 if kw.get("kept") else 61
    x, y = _windows(6, TT, vocab, 11, kw.pop("empty", ()))
    if kw.pop("packed", False):
        x = _packed(x)
    model = _kept_llama(tmp) if kw.pop("kept", False) else \
        _llama(kw.pop("fused", True), kw.pop("checkpointing", False))
    ds = go.Dataset.from_arrays(x, y, ndata_shard=kw.pop("shard", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = go.fit(model, ds, "cross_entropy", nbatch_logical=6, nbatch_physical=micro,
                   silent=True, seed=0, optimizer="sgd", accumulate=rule, **kw)
    grads = [p.grad.astype(np.float64) for p in model.parameters() if p.requires_grad]
    return grads, h.train_loss[0], y


@pytest.mark.parametrize("case", list(REGROUPED))
def test_three_micro_batches_give_the_one_batch_gradient(case, tmp_path_factory):
    tmp = tmp_path_factory.getbasetemp()
    whole, loss_whole, y = _one_step(case, "tokens", 6, tmp)
    split, loss_split, _ = _one_step(case, "tokens", 2, tmp)
    ggml, _, _ = _one_step(case, "batches", 2, tmp)
    rows = 6 * TT
    worst = 0.0
    for a, b, c in zip(whole, split, ggml):
        scale = 4 * float(np.abs(a).max())
        bound = (rows + 8) * EPS32 * scale
        assert np.abs(a - b).max() <= bound, (case, np.abs(a - b).max(), bound)
        worst = max(worst, np.abs(a - c).max() / max(bound, 1e-30))
    assert worst > 1000, (case, worst)      # ggml's rule differs here
    n = int((y >= 0).sum())
    assert abs(loss_split - loss_whole) <= 4 * n * EPS32 * loss_whole, case


# ---- resume mid-epoch with checkpoint_every, shuffled, validating ---------------------

@pytest.mark.parametrize("shuffle", [True, "train", False])
def test_checkpoint_every_resume_recounts_the_step(tmp_path, shuffle):
    x, y = _windows(24, TT, 61, 5)

    def run(**kw):
        model = _llama()
        h = go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", nepoch=3,
                   nbatch_logical=6, nbatch_physical=2, val_split=0.25, eval_every=2,
                   silent=True, seed=0, accumulate="tokens", shuffle=shuffle, **kw)
        return [p.data.copy() for p in model.parameters() if p.requires_grad], h

    straight, h = run()
    path = tmp_path / "c.npz"
    run(checkpoint=path, checkpoint_every=1, max_steps=4)   # stops inside epoch 2
    resumed, h2 = run(checkpoint=path, checkpoint_every=1, resume=True)
    for p, q in zip(straight, resumed):
        np.testing.assert_array_equal(p, q)
    assert h.train_loss == h2.train_loss and h.val_loss == h2.val_loss


# ---- the command: masked rows filling the last batch, micro-batches regrouped ---------

@pytest.mark.parametrize("packing", [False, True])
def test_the_command_s_micro_batches_regroup(tmp_path, packing):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    safetensors = pytest.importorskip("safetensors.numpy")
    from finetune_files import write_files

    from ggmlopt import finetune
    files = write_files(tmp_path)   # 15 chats: a masked row fills the 4th batch of 4
    args = ["-m", str(files / "base.gguf"), "--data", str(files / "train.jsonl"),
            "--lora-rank", "4", "-c", "96", "--batch", "4", "--epochs", "2", "--lr", "1e-2",
            "--silent", "--seed", "0", "-opt", "sgd"] + (["--packing"] if packing else [])
    outs = {}
    for rule, micro in (("tokens", 4), ("tokens", 2), ("tokens", 1), ("batches", 2)):
        out = tmp_path / f"{rule}{micro}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert finetune.main(args + ["--micro-batch", str(micro), "--accumulate", rule,
                                         "--peft-out", str(out)]) == 0
        outs[rule, micro] = safetensors.load_file(out / "adapter_model.safetensors")
    ref = outs["tokens", 4]
    moved = max(float(np.abs(v).max()) for k, v in ref.items() if "lora_B" in k)
    assert moved > 0

    def diff(o):
        return max(float(np.abs(o[k] - ref[k]).max()) for k in ref if "lora_B" in k)
    # lora_B starts at 0, so it is lr times the sum of the 8 steps' gradients: each
    # step's regrouped gradient within (R + 8) eps32 4 max|g| (R = 4 * 96 rows), so
    # the adapters within (R + 8) eps32 4 of what they moved (measured: 1.4e-9 of
    # 2.3e-6; ggml's rule 3e-5)
    bound = (4 * 96 + 8) * EPS32 * 4 * moved
    assert diff(outs["tokens", 2]) <= bound
    assert diff(outs["tokens", 1]) <= bound
    assert diff(outs["batches", 2]) > 10 * bound


# ---- a get_batch that changes the labels (fixed: it was silently off) ----------------

class _MaskingDataset(go.Dataset):
    """Masks the first 6 positions of every window as it gathers a batch: its
    micro-batches hold fewer labelled positions than dataset.labels."""

    def get_batch(self, data_batch, labels_batch, ibatch):
        super().get_batch(data_batch, labels_batch, ibatch)
        labels_batch[:, :6] = -1


def test_a_get_batch_that_changes_labels_is_refused_not_mis_weighted():
    """Before the fix the step's weights (counted in dataset.labels) summed to
    23/31 here: the gradient 19% off the token mean and the loss reported
    3.19 for 4.12, silently.  Now a ValueError naming the dataset, before the
    optimizer step; with one micro-batch a step (nothing to weigh) it trains."""
    x, y = _windows(12, TT, 61, 3)
    ds = _MaskingDataset.from_arrays(x, y)
    assert isinstance(ds, _MaskingDataset)
    model = _llama()
    before = [p.data.copy() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"dataset: accumulate='tokens' counted \d+ labelled "
                                         r"positions.*_MaskingDataset\.get_batch hold \d+"):
        go.fit(model, ds, "cross_entropy", nbatch_logical=6, nbatch_physical=2, silent=True,
               seed=0, shuffle=False, accumulate="tokens")
    for p, q in zip(before, model.parameters()):
        np.testing.assert_array_equal(p, q.data)
    go.fit(_llama(), _MaskingDataset.from_arrays(x, y), "cross_entropy", nbatch_logical=6,
           silent=True, seed=0, accumulate="tokens")
    go.fit(_llama(), _MaskingDataset.from_arrays(x, y), "cross_entropy", nbatch_logical=6,
           nbatch_physical=2, silent=True, seed=0, accumulate="batches")
