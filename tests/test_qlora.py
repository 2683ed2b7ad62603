"""A frozen base kept in its file's types (QuantizedLinear, QuantizedEmbedding,
load_gguf(keep_types=True)), LoRA over it (QLoRA), and files written back in
those types."""
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig, Qwen2, Qwen2Config
from ggmlopt.nn import Linear, QuantizedEmbedding, QuantizedLinear, Sequential

gguf = pytest.importorskip("gguf")
from ggmlopt.io import load_gguf, save_gguf, save_hf, save_safetensors
from ggmlopt.io.gguf_reader import GgufFile
from ggmlopt.text import ByteTokenizer

T = gguf.GGMLQuantizationType
U = 2.0 ** -24


def quantized_linear(lin, qtype):
    rows = np.ascontiguousarray(lin.weight.data.T)
    if qtype == "F16":
        raw = rows.astype(np.float16)
    else:
        raw = gguf.quants.quantize(rows, T[qtype])
    return QuantizedLinear(raw, qtype, lin.in_features, lin.out_features, bias=lin.bias)


def product_bound(a, b):
    """|fl(a b) - a b| <= gamma_n |a| |b| (any summation order), n the inner size,
    plus one rounding of the result."""
    n = a.shape[-1]
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    return (n * U / (1 - n * U) + U) * mag + 1e-30


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "F16"])
@pytest.mark.parametrize("rows", [1, 3, 5, 37])   # the direct path and the panels
def test_quantized_linear_is_the_dequantized_linear(qtype, rows, monkeypatch):
    monkeypatch.setattr("ggmlopt.nn.quantized.PANEL_FLOATS", 64 * 40)   # several panels
    rng = np.random.default_rng(rows)
    q = quantized_linear(Linear(64, 96, bias=False, rng=0), qtype)
    w = q.dequantize()
    assert w.shape == (64, 96) and w.dtype == np.float32
    np.testing.assert_array_equal(w, gguf.quants.dequantize(q.qweight.view(np.uint8), T[qtype]).T
                                  if qtype != "F16" else q.qweight.astype(np.float32).T)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert (np.abs(q(x) - exact) <= product_bound(x, w)).all()
    assert (np.abs(q.infer(x) - exact) <= product_bound(x, w)).all()
    g = rng.standard_normal((rows, 96)).astype(np.float32)
    q.forward(x)
    dx = q.backward(g)
    exact_dx = g.astype(np.float64) @ w.T.astype(np.float64)
    # summed over panels of 40 rows: at most 3 partial sums, each rounded
    assert (np.abs(dx - exact_dx) <= 2 * product_bound(g, w.T)).all()
    assert q.parameters() == []   # no Parameter holds the weight


def test_quantized_linear_bias_and_bad_input():
    lin = Linear(32, 8, rng=1)
    raw = gguf.quants.quantize(np.ascontiguousarray(lin.weight.data.T), T.Q8_0)
    q = QuantizedLinear(raw, "q8_0", 32, 8, bias=np.arange(8, dtype=np.float32))
    assert q.qtype == "Q8_0" and not q.bias.requires_grad and q.nbytes == raw.nbytes
    x = np.ones((2, 32), np.float32)
    np.testing.assert_allclose(q(x), x @ q.dequantize() + np.arange(8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="qweight: expected 8 rows of 34 bytes"):
        QuantizedLinear(raw[:4], "Q8_0", 32, 8)
    with pytest.raises(ValueError, match="qtype: 'IQ2_XXS'"):
        QuantizedLinear(raw, "IQ2_XXS", 32, 8)
    with pytest.raises(ValueError, match="bias: expected shape"):
        QuantizedLinear(raw, "Q8_0", 32, 8, bias=np.zeros(3))
    with pytest.raises(ValueError, match="x: expected"):
        q(np.ones((2, 31), np.float32))


@pytest.mark.parametrize("rows", [3, 37])   # the direct path and the panels
def test_kept_layers_take_rows_apart_in_memory(rows):
    # a column slice (rows 128 floats apart), as a Linear takes it
    rng = np.random.default_rng(rows)
    q = quantized_linear(Linear(64, 8, bias=False, rng=0), "Q8_0")
    emb = QuantizedEmbedding(q.qweight, "Q8_0", 8, 64)
    x = rng.standard_normal((rows, 128)).astype(np.float32)[:, ::2]
    w = q.dequantize()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    for got in (q(x), lora.LoRALinear(q, 2, 4.0, rng=0)(x), emb.project(x)):
        assert (np.abs(got - exact) <= product_bound(x, w)).all()


def test_quantized_embedding_gathers_and_projects():
    rng = np.random.default_rng(4)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    raw = gguf.quants.quantize(table, T.Q4_1)
    e = QuantizedEmbedding(raw, "Q4_1", 50, 64)
    full = e.dequantize()
    ids = rng.integers(0, 50, (3, 7))
    np.testing.assert_array_equal(e(ids), full[ids])
    rows = rng.standard_normal((9, 64)).astype(np.float32)
    assert (np.abs(e.project(rows) - rows.astype(np.float64) @ full.T) <=
            product_bound(rows, full.T)).all()
    with pytest.raises(IndexError, match="id 50"):
        e(np.array([[0, 50]]))


def tiny_llama(tie=True, cls=Llama, cfg_cls=LlamaConfig, **kw):
    cfg = cfg_cls(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=64, tie_embeddings=tie, **kw)
    return cls(cfg, seed=3)


def widened_and_kept(tmp_path, dtype="q8_0"):
    """An untied tiny llama written as dtype to tmp_path/m.gguf, read back widened to
    float32 and kept."""
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(tie=False), path, tokenizer=ByteTokenizer(), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the float32 load warns that it dequantized
        widened, _ = load_gguf(path)
    kept, _ = load_gguf(path, keep_types=True)
    return widened, kept


@pytest.fixture(params=["q8_0", "q4_0", "q5_1", "bf16", "f16"])
def quant_file(request, tmp_path):
    model = tiny_llama()
    path = tmp_path / f"m_{request.param}.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype=request.param)
    return request.param, path, model


def test_keep_types_model_equals_the_dequantized_model(quant_file):
    dtype, path, _ = quant_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the float32 load warns that it dequantized
        widened, _ = load_gguf(path)
    kept, tok = load_gguf(path, keep_types=True)
    assert isinstance(tok, ByteTokenizer)
    q = kept.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.qtype == dtype.upper()
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    # the weights are not Parameters: only norms remain
    assert all(p.data.ndim == 1 for p in kept.parameters())
    ids = np.arange(60).reshape(3, 20) % 257
    a, b = widened(ids), kept(ids)
    scale = np.abs(a).max()
    # same values, products summed in other orders: float32 rounding of the logits
    assert np.abs(a - b).max() <= 1e-5 * scale
    # decoding one token at a time reads the blocks directly: the same text
    prompt = [5, 6, 7]
    np.testing.assert_array_equal(go.generate(kept, prompt, max_new_tokens=6, temperature=0),
                                  go.generate(widened, prompt, max_new_tokens=6, temperature=0))


def test_keep_types_maps_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(tie=False), path, tokenizer=ByteTokenizer(), dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    down = kept.layers[1].mlp.down_proj
    assert not down.qweight.flags.writeable   # a view of the mapped file, not a copy
    assert isinstance(kept.lm_head, QuantizedLinear) and kept.lm_head.qtype == "Q8_0"


def test_a_full_finetune_of_a_kept_model_is_refused(quant_file):
    _, path, _ = quant_file
    kept, _ = load_gguf(path, keep_types=True)
    with pytest.raises(ValueError, match=r"lora\.apply.*keep_types=False"):
        go.OptContext(kept, batch_size=2, ne_datapoint=16, loss_type="cross_entropy")
    # the same way out when nothing trains at all (the norms frozen too)
    for p in kept.parameters():
        p.requires_grad = False
    with pytest.raises(ValueError, match=r"lora\.apply.*keep_types=False"):
        go.OptContext(kept, batch_size=2, ne_datapoint=16, loss_type="cross_entropy")


@pytest.mark.parametrize("cls,cfg_cls", [(Llama, LlamaConfig), (Qwen2, Qwen2Config)])
def test_qlora_gradients_equal_lora_over_the_dequantized_model(tmp_path, cls, cfg_cls):
    """The adapters' gradients over a kept Q8_0 base equal those over the same
    base widened to float32 (the quantized kernels are only a storage)."""
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(cls=cls, cfg_cls=cfg_cls), path, tokenizer=ByteTokenizer(),
              dtype="q8_0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        widened, _ = load_gguf(path)
    kept, _ = load_gguf(path, keep_types=True)
    for m in (widened, kept):
        lora.apply(m, rank=4, targets="all-linear", seed=5)
        for _, layer in lora.named_adapters(m):
            layer.lora_b.data[...] = np.random.default_rng(1).standard_normal(
                layer.lora_b.data.shape) * 0.05
    assert lora.trainable_parameters(kept) == lora.trainable_parameters(widened)
    ids = np.random.default_rng(2).integers(0, 257, (2, 24))
    grads = []
    for m in (widened, kept):
        logits = m.forward(ids)
        m.backward(np.ascontiguousarray(logits * np.float32(0.01)))
        grads.append({n: p.grad.copy() for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    for name in grads[0]:
        a, b = grads[0][name], grads[1][name]
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max() + 1e-12, name


def test_a_resume_over_a_base_kept_otherwise_is_refused(tmp_path):
    # the adapters' names and shapes are the same over a Q4_0, a Q8_0 or a widened
    # base: the checkpoint says which base the run trained over
    for dtype in ("q4_0", "q8_0"):
        save_gguf(tiny_llama(), tmp_path / f"{dtype}.gguf", tokenizer=ByteTokenizer(), dtype=dtype)
    tokens = np.random.default_rng(0).integers(0, 257, 24 * 8 + 1).astype(np.int32)

    def run(dtype, keep, nepoch):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the widened load warns that it dequantized
            model, _ = load_gguf(tmp_path / f"{dtype}.gguf", keep_types=keep)
        lora.apply(model, rank=4)
        go.fit(model, go.Dataset.from_tokens(tokens, n_ctx=24), "cross_entropy",
               nepoch=nepoch, nbatch_logical=7, silent=True, seed=0,
               checkpoint=tmp_path / "c.npz", resume=nepoch > 1)

    run("q4_0", True, 1)
    with pytest.raises(ValueError, match=r"fit.model: .*kept Q4_0, this model has "
                                         r"(kept Q8_0|float32)"):
        run("q8_0", True, 2)
    with pytest.raises(ValueError, match="do not match|fit.model"):   # widened: Parameters
        run("q4_0", False, 2)
    run("q4_0", True, 2)   # the same base resumes


def test_qlora_trains_saves_and_merges(tmp_path):
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(), path, tokenizer=ByteTokenizer(), dtype="q4_0")
    kept, _ = load_gguf(path, keep_types=True)
    lora.apply(kept, rank=4)
    trainable, total = lora.trainable_parameters(kept)
    assert trainable == 2 * 4 * (4 * 64 + 64 + 32 + 32 + 64)   # q, k, v, o of 2 layers
    assert total == 257 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 96 + 2 * 64) + 64 \
        + trainable
    tokens = np.random.default_rng(0).integers(0, 257, 24 * 8 + 1).astype(np.int32)
    data = go.Dataset.from_tokens(tokens, n_ctx=24)
    history = go.fit(kept, data, "cross_entropy", nepoch=3, nbatch_logical=data.ndata,
                     silent=True, get_opt_pars=lambda _: go.OptimizerParams(
                         adamw=go.AdamWParams(alpha=1e-2)))
    assert history.epochs[-1].train_loss < history.epochs[0].train_loss
    adapter = tmp_path / "adapter.gguf"
    go.io.save_gguf_lora(kept, adapter)
    ids = tokens[None, :20]
    before = kept(ids)
    base, _ = load_gguf(path, keep_types=True)
    go.io.load_gguf_lora(adapter, base)
    np.testing.assert_allclose(base(ids), before, rtol=0, atol=1e-5 * np.abs(before).max())
    lora.merge(kept)
    merged_q = kept.layers[0].self_attn.q_proj
    assert type(merged_q) is Linear and merged_q.weight.data.dtype == np.float32
    assert isinstance(kept.layers[0].mlp.up_proj, QuantizedLinear)   # not adapted: kept
    np.testing.assert_allclose(kept(ids), before, rtol=0, atol=1e-4 * np.abs(before).max())


def test_kept_types_are_written_back_as_they_are(quant_file, tmp_path):
    _, path, _ = quant_file
    kept, tok = load_gguf(path, keep_types=True)
    again = tmp_path / "again.gguf"
    save_gguf(kept, again, tokenizer=tok)
    a, b = GgufFile(str(path)), GgufFile(str(again))
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].type == b.tensors[name].type, name
        np.testing.assert_array_equal(a.raw(name), b.raw(name))
    assert a.fields["general.file_type"] == b.fields["general.file_type"]


def test_save_gguf_quantizes_as_ggml_rounds(tmp_path):
    model = tiny_llama(tie=False)
    path = tmp_path / "q.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype="q4_0")
    f = GgufFile(str(path))
    assert f.tensors["blk.0.ffn_up.weight"].type_name == "Q4_0"
    assert f.tensors["output.weight"].type_name == "Q8_0"   # the head keeps 8 bits
    assert f.tensors["output_norm.weight"].type_name == "F32"
    want = gguf.quants.quantize(np.ascontiguousarray(model.layers[0].mlp.up_proj.weight.data.T),
                                T.Q4_0)
    np.testing.assert_array_equal(f.raw("blk.0.ffn_up.weight"), want)
    with pytest.raises(TypeError, match="dtype.*q8_0"):
        save_gguf(model, tmp_path / "x.gguf", tokenizer=ByteTokenizer(), dtype="q3_k")


def test_float_writers_refuse_kept_types(quant_file, tmp_path):
    _, path, _ = quant_file
    kept, _ = load_gguf(path, keep_types=True)
    with pytest.raises(ValueError, match="keep their weights in the file's types"):
        save_hf(kept, tmp_path / "hf")
    with pytest.raises(ValueError, match="keep their weights in the file's types"):
        save_safetensors(kept, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="keep_types: True builds the model"):
        load_gguf(path, tiny_llama(), keep_types=True)


def test_lora_over_a_quantized_layer_of_any_model():
    rng = np.random.default_rng(0)
    model = Sequential(quantized_linear(Linear(64, 32, rng=1), "Q8_0"), Linear(32, 3, rng=2))
    lora.apply(model, rank=2, targets="all-linear")
    names = [n for n, _ in lora.named_adapters(model)]
    assert names == ["0", "1"]
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = rng.standard_normal((16, 3)).astype(np.float32)
    history = go.fit(model, go.Dataset.from_arrays(x, y), "mean_squared_error", nepoch=4,
                     nbatch_logical=16, silent=True)
    assert history.epochs[-1].train_loss < history.epochs[0].train_loss


@pytest.mark.parametrize("cls,cfg_cls", [(Llama, LlamaConfig), (Qwen2, Qwen2Config)])
def test_load_hf_keep_types_reads_float16_safetensors_in_place(tmp_path, cls, cfg_cls):
    st = pytest.importorskip("safetensors.numpy")
    from ggmlopt.io import load_hf
    model = tiny_llama(tie=False, cls=cls, cfg_cls=cfg_cls)
    save_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    halves = {k: v.astype(np.float16) for k, v in st.load_file(str(path)).items()}
    st.save_file(halves, str(path))
    widened = load_hf(tmp_path)
    kept = load_hf(tmp_path, keep_types=True)
    up = kept.layers[0].mlp.up_proj
    assert isinstance(up, QuantizedLinear) and up.qtype == "F16"
    assert not up.qweight.flags.writeable   # a view of the mapped file
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    ids = np.arange(40).reshape(2, 20) % 257
    a, b = widened(ids), kept(ids)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    lora.apply(kept, rank=2)
    assert lora.other_trainable(kept) == []


def test_load_hf_keep_types_reads_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import load_hf
    save_hf(tiny_llama(tie=True), tmp_path / "f32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "f32",
                                                       torch_dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    kept = load_hf(tmp_path / "bf16", keep_types=True)
    assert kept.layers[1].self_attn.o_proj.qtype == "BF16"
    ids = np.arange(20)[None]
    with torch.no_grad():
        want = hf.float()(torch.tensor(ids)).logits.numpy()
    got = kept(ids)
    # the same bfloat16 values, multiplied in float32 by both
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_an_embedding_adapter_over_a_kept_embedding(tmp_path):
    """embed_tokens as a target over a QuantizedEmbedding: the adapter's rows
    are added to the dequantized rows, its gradients equal those over the
    widened embedding, it round-trips through a GGUF adapter, and merge gives a
    float32 Embedding of the merged weight."""
    widened, kept = widened_and_kept(tmp_path)
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    for m in (widened, kept):
        lora.apply(m, rank=4, targets=("embed_tokens", "q_proj"), seed=3)
        m.embed_tokens.lora_a.data[...] = np.random.default_rng(4).standard_normal(
            m.embed_tokens.lora_a.data.shape) * 0.1
    assert lora.trainable_parameters(kept) == lora.trainable_parameters(widened)
    assert kept.embed_tokens.weight is None
    ids = np.random.default_rng(2).integers(0, 257, (2, 24))
    grads, outs = [], []
    for m in (widened, kept):
        logits = m.forward(ids)
        outs.append(logits.copy())
        m.backward(np.ascontiguousarray(logits * np.float32(0.01)))
        grads.append({n: p.grad.copy() for n, p in m.named_parameters() if p.requires_grad})
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
    assert {"embed_tokens.lora_a", "embed_tokens.lora_b"} <= grads[1].keys()
    for name in grads[0]:
        a, b = grads[0][name], grads[1][name]
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max() + 1e-12, name
    adapter = tmp_path / "adapter.gguf"
    go.io.save_gguf_lora(kept, adapter)
    again, _ = load_gguf(tmp_path / "m.gguf", keep_types=True)
    go.io.load_gguf_lora(adapter, again)
    np.testing.assert_array_equal(again.embed_tokens.lora_a.data, kept.embed_tokens.lora_a.data)
    np.testing.assert_allclose(again(ids), kept(ids), rtol=0, atol=1e-6 * np.abs(outs[1]).max())
    merged_w = kept.embed_tokens.merged_weight()
    lora.merge(kept)
    assert type(kept.embed_tokens).__name__ == "Embedding"
    np.testing.assert_array_equal(kept.embed_tokens.weight.data, merged_w)
    np.testing.assert_allclose(kept(ids), outs[1], rtol=0, atol=1e-5 * np.abs(outs[1]).max())


def test_an_embedding_adapter_keeps_its_own_copy_of_the_ids(tmp_path):
    """The caller may refill its ids array between forward and backward: the
    adapter's gradient scatters by the ids of the forward."""
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(tie=False), path, tokenizer=ByteTokenizer(), dtype="q8_0")
    grads = []
    for refill in (False, True):
        kept, _ = load_gguf(path, keep_types=True)
        lora.apply(kept, rank=2, targets=("embed_tokens",), seed=0)
        ids = np.arange(24, dtype=np.int32).reshape(2, 12)
        logits = kept.forward(ids)
        if refill:
            ids[...] = 200
        kept.backward(np.ascontiguousarray(logits * np.float32(0.01)))
        grads.append(kept.embed_tokens.lora_a.grad.copy())
    np.testing.assert_array_equal(grads[1], grads[0])
    assert np.abs(grads[0][:24]).max() > 0


def test_the_same_seed_draws_the_same_adapters_over_a_kept_base(tmp_path):
    """apply draws A in the order of the model's parameter names, whether the
    layers hold their weights as Parameters or keep them in the file's type:
    an untied head (a top-level layer, listed after the blocks) included."""
    widened, kept = widened_and_kept(tmp_path)
    targets = ("embed_tokens", "q_proj", "v_proj", "lm_head")
    drawn = [lora.apply(m, rank=4, targets=targets, seed=11) for m in (widened, kept)]
    names = [[name for name, _ in d] for d in drawn]
    assert names[0] == names[1] and names[0][0] == "embed_tokens" and names[0][-1] == "lm_head"
    for (name, a), (_, b) in zip(*drawn):
        np.testing.assert_array_equal(a.lora_a.data, b.lora_a.data, err_msg=name)
        np.testing.assert_array_equal(a.lora_b.data, b.lora_b.data, err_msg=name)


@pytest.mark.parametrize("name", ["lm_head", "embed_tokens", "layers.0", "mlp"])
def test_a_kept_layer_cannot_train_whole(tmp_path, name):
    """trainable= naming a kept layer, or a module holding one, is refused
    (it has no Parameter to train: the rest would train and it would not),
    before anything changes."""
    path = tmp_path / "m.gguf"
    save_gguf(tiny_llama(tie=False), path, tokenizer=ByteTokenizer(), dtype="q4_0")
    kept, _ = load_gguf(path, keep_types=True)
    before = [(n, p.requires_grad) for n, p in kept.named_parameters()]
    with pytest.raises(ValueError, match=f"trainable: '{name}' covers .*kept in its file's "
                                         r"type \((Q4_0|Q6_K|Q8_0)\).*keep_types=False"):
        lora.apply(kept, rank=4, targets=("layers.1.self_attn.q_proj",), trainable=(name,))
    assert [(n, p.requires_grad) for n, p in kept.named_parameters()] == before
    assert lora.named_adapters(kept) == []
    # a norm holds its weight as a Parameter: it trains whole
    lora.apply(kept, rank=4, targets=("q_proj",), trainable=("layers.0.input_layernorm",))
    assert kept.layers[0].input_layernorm.weight.requires_grad
