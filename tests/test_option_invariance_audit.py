"""Options that must not change the numbers of a training step, or change them
exactly as documented: gradient checkpointing (with LoRA dropout, packed
documents and sliding windows; and a user's random layer in a Checkpoint),
optimizer_in_backward, micro-batches (DESIGN.md sections 2 and 6: the loss is
the mean over the labelled positions of a physical batch, scaled by
1/opt_period), kernel threads, the GEMM engines, bf16 with checkpointing, and a
mid-epoch resume, over Llama, Qwen3 (q/k norms), Gemma 3 (sliding windows),
Phi-3 (fused qkv) and GPT-2, full fine-tuning, LoRA and QLoRA (GGUF q8_0 and
q4_k kept in their types)."""
import json
import os
import subprocess
import sys
import warnings

import lm_dist_problem as lm
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Gemma3, Gemma3Config, Llama, LlamaConfig
from ggmlopt.nn import Checkpoint, Linear, ReLU, Sequential

U = 2.0 ** -24
FAMILIES = ["llama", "qwen3", "gemma3", "phi3", "gpt2"]
PARS = go.OptimizerParams(go.AdamWParams(alpha=1e-2, wd=0.1))
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _adapt(model, mode):
    """mode: "full" (everything trains), "lora" or "lora_drop" (dropout 0.3); the
    B matrices made nonzero so that the adapters' A get gradients from step one."""
    if mode != "full":
        lora.apply(model, rank=4, targets="all-linear",
                   dropout=0.3 if mode == "lora_drop" else 0.0, seed=2)
        for _, layer in lora.named_adapters(model):
            layer.lora_b.data[...] = 0.01
    return model


def _trained(model):
    return {n: p.data.copy() for n, p in model.named_parameters()
            if getattr(p, "requires_grad", True)}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _fit_windows(model, **kw):
    """Two AdamW steps on the masked windows of tests/lm_dist_problem.py."""
    x, y = lm.token_windows(ndata=24)
    go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", lambda ep: PARS,
           nbatch_logical=12, nbatch_physical=kw.pop("nbatch_physical", 12), silent=True,
           seed=3, **kw)
    return _trained(model)


# ---- 1, 2: checkpointing and the step in the backward pass, bit for bit --------------

@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("mode", ["full", "lora", "lora_drop"])
def test_checkpointing_and_step_in_backward_train_bit_for_bit(kind, mode):
    want = _fit_windows(_adapt(lm.make_model(kind), mode))
    ck = _adapt(lm.make_model(kind), mode)
    ck.gradient_checkpointing_enable()
    _assert_same(_fit_windows(ck), want)
    _assert_same(_fit_windows(_adapt(lm.make_model(kind), mode), optimizer_in_backward=True),
                 want)
    both = _adapt(lm.make_model(kind), mode)
    both.gradient_checkpointing_enable()
    _assert_same(_fit_windows(both, optimizer_in_backward=True), want)
    if mode == "lora_drop":   # the masks were drawn: another trajectory than without
        other = _fit_windows(_adapt(lm.make_model(kind), "lora"))
        assert max(np.abs(other[k] - want[k]).max() for k in want) > 1e-3


def _chats(n=24):
    rng = np.random.default_rng(0)
    return [[{"role": "user", "content": "".join(rng.choice(list("abcdef"), rng.integers(1, 6)))},
             {"role": "assistant",
              "content": "".join(rng.choice(list("xyz"), rng.integers(1, 9)))}]
            for _ in range(n)]


def _packed(tok):
    return go.Dataset.from_chat(_chats(), tok, 200, packing=True)


@pytest.fixture(scope="module")
def kept_bases(tmp_path_factory):
    """Gemma 3 (a sliding window of 5 on its first layer) as q8_0 and as q4_k
    (dim 256: rows of whole Q4_K blocks) GGUF files, and the tokenizer."""
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from ggmlopt.text import ByteTokenizer
    tok = ByteTokenizer(chat_template=CHATML)
    folder = tmp_path_factory.mktemp("kept")
    files = {}
    for dtype, dim in (("q8_0", 32), ("q4_k", 256)):
        cfg = Gemma3Config(vocab_size=257, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_dim=dim, max_seq_len=200, head_dim=dim // 4, sliding_window=5,
                           query_pre_attn_scalar=float(dim // 4), sliding_layers=(True, False))
        files[dtype] = folder / f"{dtype}.gguf"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # q4_k_m's own mix (Q6_K rows) is said
            go.io.save_gguf(Gemma3(cfg, seed=1), files[dtype], dtype=dtype, tokenizer=tok)
    return files, tok


def _qlora(path, checkpointing, dropout=0.2):
    model, _ = go.io.load_gguf(path, keep_types=True)
    lora.apply(model, rank=4, targets="all-linear", dropout=dropout, seed=2)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = 0.01
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k"])
def test_packed_chats_over_a_kept_base_train_bit_for_bit(kept_bases, dtype):
    files, tok = kept_bases
    ds = _packed(tok)
    docs = np.asarray(ds.document_ids)
    assert (docs.max(axis=1) >= 2).sum() >= 8   # windows of two or three chats (and padding)
    types = {getattr(layer._base, "qtype", None) for _, layer in
             lora.named_adapters(_qlora(files[dtype], False))}
    assert ("Q4_K" in types) if dtype == "q4_k" else (types == {"Q8_0"})

    def run(checkpointing, in_backward=False):
        model = _qlora(files[dtype], checkpointing)
        go.fit(model, _packed(tok), "cross_entropy", lambda ep: PARS, nbatch_logical=2,
               nbatch_physical=2, silent=True, seed=3, optimizer_in_backward=in_backward)
        return _trained(model)

    want = run(False)
    _assert_same(run(True), want)
    _assert_same(run(False, True), want)
    _assert_same(run(True, True), want)


# ---- the Checkpoint wrapper replays a user's random layer ------------------------------

class GaussianNoise:
    """ggmlopt.nn.module's example of a user's layer with randomness (set_rng
    protocol), verbatim."""

    def __init__(self, sigma):
        self.sigma, self.training, self.rng = sigma, False, None

    def set_rng(self, rng):
        self.rng = rng

    def parameters(self):
        return []

    def forward(self, x):
        if not self.training:
            return x
        return x + self.sigma * self.rng.standard_normal(x.shape, np.float32)

    def backward(self, grad_out):
        return grad_out


def _noisy(wrap, noise):
    inner = Sequential(Linear(16, 16, rng=2), noise, ReLU(), Linear(16, 16, rng=3))
    return Sequential(Linear(8, 16, rng=0), Checkpoint(inner) if wrap else inner, ReLU(),
                      Linear(16, 3, rng=4))


def _fit_noisy(model):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.standard_normal((32, 3)).astype(np.float32)
    h = go.fit(model, go.Dataset.from_arrays(x, y), "mean_squared_error", nepoch=2,
               nbatch_logical=8, silent=True, seed=4)
    return [e.train_loss for e in h.epochs], [p.data.copy() for p in model.parameters()]


def test_a_checkpointed_users_random_layer_recomputes_its_own_draws():
    # before the fix only Dropout's generators were put back: the recomputation drew
    # other noise (gradients of another forward than the loss's) and moved the stream
    # (the next batches' noise): epoch losses 1.1020/1.0779 against 1.0966/1.0847,
    # parameters 1.2e-2 apart
    want_losses, want = _fit_noisy(_noisy(False, GaussianNoise(0.5)))
    got_losses, got = _fit_noisy(_noisy(True, GaussianNoise(0.5)))
    assert got_losses == want_losses
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", [lambda: go.nn.Dropout(0.3, rng=7), lambda: GaussianNoise(0.5)],
                         ids=["dropout", "users-layer"])
def test_a_random_layer_wrapped_itself_draws_from_the_context(make):
    # before the fix the walk that hands out the context's generator (set_rng, every
    # alloc) skipped the module a Checkpoint wraps: a Dropout kept drawing from its
    # own generator (epoch losses 1.2979/1.2008 against 1.2949/1.1969 unwrapped,
    # parameters 9.3e-3 apart; a checkpoint could not restore it), a user's layer
    # had none at all
    def model(wrap):
        layer = make()
        return Sequential(Linear(8, 16, rng=0), ReLU(), Checkpoint(layer) if wrap else layer,
                          Linear(16, 3, rng=4))

    want_losses, want = _fit_noisy(model(False))
    got_losses, got = _fit_noisy(model(True))
    assert got_losses == want_losses
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # a Checkpoint inside a checkpointed block: the inner wrapper is no random layer
    # of its own, the layer it wraps is replayed
    nested = Sequential(Linear(8, 16, rng=0), ReLU(),
                        Checkpoint(Sequential(Checkpoint(make()), Linear(16, 16, rng=5))),
                        Linear(16, 3, rng=4))
    flat = Sequential(Linear(8, 16, rng=0), ReLU(), make(), Linear(16, 16, rng=5),
                      Linear(16, 3, rng=4))
    want_losses, want = _fit_noisy(flat)
    got_losses, got = _fit_noisy(nested)
    assert got_losses == want_losses
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_random_layer_whose_generator_cannot_be_found_is_refused():
    class Hidden(GaussianNoise):   # keeps the generator out of reach of the replay
        def set_rng(self, rng):
            self.rng = None
            self.box = [rng]

        def forward(self, x):
            if not self.training:
                return x
            return x + self.sigma * self.box[0].standard_normal(x.shape, np.float32)

    model = _noisy(True, Hidden(0.5))
    before = [p.data.copy() for p in model.parameters()]
    with pytest.raises(TypeError, match="Hidden: has set_rng.*Generator"):
        _fit_noisy(model)
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)


# ---- 2: what the step in the backward pass cannot do is refused -------------------------

@pytest.mark.parametrize("kw, match", [({"clip_grad_norm": 1.0}, "clip_grad_norm"),
                                       ({"nbatch_physical": 6}, "opt_period")])
def test_step_in_backward_refuses_clipping_and_accumulation(kw, match):
    model = _adapt(lm.make_model("llama"), "lora_drop")
    before = _trained(model)
    with pytest.raises(ValueError, match=f"optimizer_in_backward.*{match}"):
        _fit_windows(model, optimizer_in_backward=True, **kw)
    _assert_same(_trained(model), before)


# ---- 3: micro-batches, as documented ---------------------------------------------------

def _logical_batch(kind, batches, fused=True):
    """One logical batch of len(batches) physical batches through a fresh model:
    (each trainable parameter's accumulated gradient, the losses, the Result,
    the warnings)."""
    model = lm.make_model(kind)
    model.fused_head = fused
    ctx = go.OptContext(model, loss_type="cross_entropy", opt_period=len(batches), seed=5)
    res, losses = go.Result(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches:
            ctx.alloc(True)
            ctx.eval(res, inputs=x, labels=y)
            losses.append(float(ctx.loss))
    return [ctx.grad_acc(p).copy() for p in model.parameters()], losses, res, caught


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("fused", [True, False])
def test_micro_batches_take_each_physical_batchs_mean_over_its_labels(kind, fused):
    x, y = lm.token_windows(ndata=12)
    b1, b2 = (x[:6], y[:6].copy()), (x[6:], y[6:].copy())
    b2[1][:3] = -1   # b2 has about half b1's labelled positions
    g1, (l1,) = _logical_batch(kind, [b1], fused)[:2]
    g2, (l2,) = _logical_batch(kind, [b2], fused)[:2]
    g, losses, res, _ = _logical_batch(kind, [b1, b2], fused)
    # each physical batch's loss is its own masked mean halved (exact: a power of two)
    assert losses == [np.float32(l1) / 2, np.float32(l2) / 2]
    n1, n2 = int((b1[1] >= 0).sum()), int((b2[1] >= 0).sum())
    assert res.nlabelled == n1 + n2 and res.loss()[0] == pytest.approx((l1 + l2) / 2, rel=1e-6)
    # the gradient is g1/2 + g2/2, not the mean over the logical batch's labels
    # ((n1 g1 + n2 g2) / (n1 + n2), 17% of the gradient away here).  The two ways
    # differ only where a product accumulates into the gradient instead of adding
    # it after: at most gamma_K of the products' magnitude per element, K = 48
    # rows (6 windows x 8), bounded by 4 K u of the largest gradient entry.
    for a, p, q in zip(g, g1, g2):
        want = p / 2 + q / 2
        scale = max(np.abs(p).max(), np.abs(q).max())
        assert np.abs(a - want).max() <= 4 * 48 * U * scale
    mean = [(n1 * p + n2 * q) / (n1 + n2) for p, q in zip(g1, g2)]
    assert max(np.abs(a - m).max() for a, m in zip(g, mean)) > 1e-3


@pytest.mark.parametrize("fused", [True, False])
def test_a_physical_batch_without_labels_adds_nothing_and_no_nan(fused):
    x, y = lm.token_windows(ndata=12)
    b1, empty = (x[:6], y[:6]), (x[6:], np.full_like(y[6:], -1))
    g1, (l1,) = _logical_batch("llama", [b1], fused)[:2]
    g, losses, res, caught = _logical_batch("llama", [b1, empty], fused)
    assert losses == [np.float32(l1) / 2, 0.0]
    for a, p in zip(g, g1):   # halving is exact: the gradient is b1's alone, halved
        np.testing.assert_array_equal(a, p / 2)
    assert any("no labelled position" in str(w.message) for w in caught)
    # the empty batch has no loss: Result's mean is b1's, unscaled
    assert res.loss()[0] == pytest.approx(l1, rel=1e-7) and res.nlabelled == (b1[1] >= 0).sum()
    g, losses, res, _ = _logical_batch("llama", [empty, empty], fused)
    assert losses == [0.0, 0.0] and all(not a.any() for a in g)
    assert np.isnan(res.loss()[0]) and np.isnan(res.accuracy()[0])   # documented: no loss


# ---- 4: threads, engines, bf16 --------------------------------------------------------

def _fit_wide(kind, mode, *, checkpointing=False, precision="f32"):
    """A model whose activations, logits and arena pass the kernels' thresholds
    for splitting over threads (65536 elements): rows of 8 x 64 tokens."""
    kw = {"vocab_size": 257, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 192, "max_seq_len": 64}
    model = Gemma3(Gemma3Config(**kw, head_dim=16, sliding_window=5,
                                query_pre_attn_scalar=16.0, sliding_layers=(True, False)),
                   seed=1) if kind == "gemma3" else Llama(LlamaConfig(**kw), seed=1)
    _adapt(model, mode)
    if checkpointing:
        model.gradient_checkpointing_enable()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 257, (16, 64)).astype(np.int32)
    y = np.roll(x, -1, 1)
    y[:, :5] = -1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # bf16 where the CPU has no bf16 products
        go.fit(model, go.Dataset.from_arrays(x, y), "cross_entropy", lambda ep: PARS,
               nbatch_logical=8, silent=True, seed=3, precision=precision)
    return _trained(model)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["full", "lora_drop"])
def test_kernel_threads_and_bf16_checkpointing_change_no_bit(kind, mode, monkeypatch):
    # one BLAS thread throughout (OpenBLAS's own rounding depends on its threads,
    # docs/threads.md); the kernel threads are what is compared
    monkeypatch.setenv("GGMLOPT_BLAS_THREADS", "1")
    threads = go.get_num_threads()
    try:
        go.set_num_threads(1)
        one = _fit_wide(kind, mode)
        one16 = _fit_wide(kind, mode, precision="bf16")
        go.set_num_threads(2)
        _assert_same(_fit_wide(kind, mode), one)
        _assert_same(_fit_wide(kind, mode, precision="bf16", checkpointing=True), one16)
    finally:
        go.set_num_threads(threads)


_ENGINE_RUN = r"""
import json, sys
import numpy as np, ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig
go.set_num_threads(int(sys.argv[1]))
kw = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
rng = np.random.default_rng(0)
x = rng.integers(0, 97, (4, 32)).astype(np.int32)
y = np.roll(x, -1, 1)
out = {"engine": go.gemm.engine()}
for mode in ("full", "lora"):
    m = Llama(LlamaConfig(**kw), seed=1)
    if mode == "lora":
        lora.apply(m, rank=4, targets="all-linear", seed=2)
        for _, layer in lora.named_adapters(m):
            layer.lora_b.data[...] = 0.05
    ctx = go.OptContext(m, loss_type="cross_entropy", seed=5)
    ctx.alloc(True)
    ctx.eval(None, inputs=x, labels=y)
    g = np.concatenate([ctx.grad_acc(p).ravel() for p in m.parameters() if p.requires_grad])
    out[mode] = g.tolist()
print(json.dumps(out))
"""


def _engine_grads(engine, threads):
    env = {**os.environ, "GGMLOPT_GEMM": engine, "GGMLOPT_BLAS_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _ENGINE_RUN, str(threads)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["engine"] == engine
    return {k: np.array(v, np.float32) for k, v in out.items() if k != "engine"}


def test_gemm_engines_agree_to_rounding_and_native_is_the_same_on_any_threads():
    numpy = _engine_grads("numpy", 2)
    native = _engine_grads("native", 2)
    native1 = _engine_grads("native", 1)
    for mode in numpy:
        np.testing.assert_array_equal(native1[mode], native[mode])   # docs/precision.md
        # each product within K u of the exact sum on either engine (docs/precision.md),
        # K <= 128 (4 x 32 rows); a gradient is the end of a chain of at most 2 x 12
        # products (forward and backward of 2 blocks, head): 2 K u per product, in
        # units of the largest gradient entry
        bound = 2 * 128 * 24 * U * np.abs(numpy[mode]).max()
        assert np.abs(native[mode] - numpy[mode]).max() <= bound, mode


# ---- 5: a mid-epoch resume with checkpointing and LoRA dropout -------------------------

def test_a_mid_epoch_resume_with_checkpointing_and_dropout_is_bit_exact(kept_bases, tmp_path):
    files, tok = kept_bases
    sched = go.schedules.WarmupCosine(2, 8, base=PARS, unit="step")

    def run(**kw):
        model = _qlora(files["q4_k"], True)
        h = go.fit(model, _packed(tok), "cross_entropy", sched, nepoch=2, nbatch_logical=2,
                   nbatch_physical=1, val_split=0.2, silent=True, seed=3, **kw)
        return _trained(model), [(e.train_loss, e.val_loss) for e in h.epochs]

    want, want_losses = run()
    ck = tmp_path / "ck.npz"
    stopped, _ = run(checkpoint=ck, checkpoint_every=1, max_steps=3)   # inside epoch 1
    assert max(np.abs(stopped[k] - want[k]).max() for k in want) > 1e-3
    got, got_losses = run(checkpoint=ck, checkpoint_every=1, resume=True)
    _assert_same(got, want)
    assert got_losses == want_losses
