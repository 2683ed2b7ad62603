"""What issues 26 (LoRA as PEFT means it, QLoRA over a kept base), 27 (memory:
gradients only where training needs them, checkpointing, the fused head,
memory_report) and 30 (the GEMM engine, bf16) promise, tested as an outside
reader of those texts would: only the names the issues give."""
import os
import re
import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig

U = 2.0 ** -24
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tiny(tie=False, dim=64, ffn=96, layers=2, vocab=257, seed=3):
    return Llama(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4,
                             n_kv_heads=2, ffn_dim=ffn, max_seq_len=64,
                             tie_embeddings=tie), seed=seed)


def windows(vocab=257, n=8, n_ctx=16, seed=0):
    """n windows (from_tokens cuts them n_ctx / 2 apart, as llama.cpp does)."""
    ids = np.random.default_rng(seed).integers(0, vocab, n * (n_ctx // 2) + n_ctx + 1)
    ds = go.Dataset.from_tokens(ids, n_ctx=n_ctx)
    assert len(ds) == n
    return ds


def _run(cmd, **kw):
    """cmd in a child process from the repository, its output captured."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, **kw)


def trainable_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adamw(lr=1e-2):
    return lambda epoch: go.OptimizerParams(go.AdamWParams(alpha=lr))


def tensors(path):
    gguf = pytest.importorskip("gguf")
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# ---------------------------------------------------------------- issue 26, item 1

def test_apply_freezes_everything_but_the_adapters():
    model = tiny()
    lora.apply(model, rank=4)
    names = trainable_names(model)
    assert names and all("lora" in n.lower() for n in names), names
    # the attention projections q/k/v/o (the issue's 921,600 for SmolLM2 is that count)
    dim, kv = 64, 64 // 4 * 2
    per_layer = 4 * ((dim + dim) + (dim + kv) + (dim + kv) + (dim + dim))
    trainable, total = lora.trainable_parameters(model)
    assert trainable == 2 * per_layer
    assert total == sum(p.data.size for _, p in model.named_parameters())


def test_apply_takes_the_issues_arguments_and_keeps_what_trainable_names():
    model = tiny()
    lora.apply(model, rank=4, alpha=8, targets=("q_proj", "v_proj"), dropout=0.0, seed=1,
               trainable=("lm_head", "norm"))
    names = set(trainable_names(model))
    assert "lm_head.weight" in names and "norm.weight" in names
    assert not any("mlp" in n or n.startswith("embed") for n in names), names
    assert not any(n.endswith(("k_proj.weight", "q_proj.weight", "o_proj.weight"))
                   for n in names)


def test_all_linear_adapts_every_linear_but_the_head():
    model = tiny()
    before = {n: p.data.shape for n, p in model.named_parameters() if p.data.ndim == 2}
    lora.apply(model, rank=2, targets="all-linear")
    trainable, _ = lora.trainable_parameters(model)
    want = sum(2 * (i + o) for n, (i, o) in before.items()
               if "embed" not in n and not n.startswith("lm_head"))
    assert trainable == want
    assert not any("lm_head" in n for n in trainable_names(model))


def test_an_embedding_adapter_as_peft_builds_it():
    vocab, dim, r = 257, 64, 4
    model = tiny()
    tokens = np.random.default_rng(1).integers(0, vocab, (2, 9))
    lora.apply(model, rank=r, alpha=8, targets=("embed_tokens",))
    shapes = {p.data.shape for n, p in model.named_parameters() if p.requires_grad}
    assert shapes == {(vocab, r), (r, dim)}
    # give both factors values, then merging must not move the logits
    rng = np.random.default_rng(2)
    for _, p in model.named_parameters():
        if p.requires_grad:
            p.data[...] = rng.standard_normal(p.data.shape) * 0.1
    got = model(tokens)
    merged = lora.merge(model) or model
    want = merged(tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert float(np.abs(got - tiny()(tokens)).max()) > 1e-3   # the adapter counted


def test_print_trainable_parameters_prints_peft_line(capsys):
    model = tiny()
    lora.apply(model, rank=4)
    trainable, total = lora.trainable_parameters(model)
    assert isinstance(trainable, int) and isinstance(total, int)
    lora.print_trainable_parameters(model)
    out = capsys.readouterr().out.strip()
    assert out == (f"trainable params: {trainable:,d} || all params: {total:,d} || "
                   f"trainable%: {100 * trainable / total:.4f}")


def test_save_gguf_lora_refuses_other_trainable_weights(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf_lora
    model = tiny()
    lora.apply(model, rank=4, trainable=("lm_head",))
    path = tmp_path / "a.gguf"
    with pytest.raises(ValueError) as e:
        save_gguf_lora(model, path)
    msg = str(e.value)
    assert "lm_head.weight" in msg and "lora.merge" in msg and "save_gguf" in msg
    assert "freeze" in msg.lower() or "requires_grad" in msg
    assert not path.exists()
    # many: up to five named
    for _, p in model.named_parameters():
        p.requires_grad = True
    with pytest.raises(ValueError) as e:
        save_gguf_lora(model, path)
    others = [n for n in trainable_names(model) if "lora" not in n.lower()]
    assert 1 <= sum(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", str(e.value)) is not None
                    for n in others) <= 5


# ---------------------------------------------------------------- issue 26, item 2

TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def same_type(qtype, tensor_type):
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        return int(qtype) == int(tensor_type)
    return str(getattr(qtype, "name", qtype)).upper().split(".")[-1] == tensor_type.name


@pytest.fixture(scope="module", params=TYPES)
def kept(request, tmp_path_factory):
    """An untied llama (rows of 256, as the k-quants need) saved as one type,
    read back with keep_types=True."""
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = tmp_path_factory.mktemp("kept") / f"m_{request.param}.gguf"
    save_gguf(tiny(dim=256, ffn=256), path, tokenizer=ByteTokenizer(), dtype=request.param)
    model, _ = load_gguf(path, keep_types=True)
    return request.param, path, model


def test_keep_types_holds_each_matrix_in_its_file_type(kept):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.nn import QuantizedLinear
    dtype, path, model = kept
    t = tensors(path)
    names = [n for n, _ in model.named_parameters()]
    assert all(p.data.ndim == 1 for _, p in model.named_parameters()), names
    assert "embed_tokens.weight" not in names
    pairs = {"layers.0.self_attn.v_proj": "blk.0.attn_v.weight",
             "layers.1.mlp.down_proj": "blk.1.ffn_down.weight",
             "layers.0.mlp.gate_proj": "blk.0.ffn_gate.weight",
             "lm_head": "output.weight"}
    modules = dict(model.named_modules())
    for mod, tname in pairs.items():
        q = modules[mod]
        assert isinstance(q, QuantizedLinear), (mod, type(q))
        assert same_type(q.qtype, t[tname].tensor_type), (mod, q.qtype, t[tname].tensor_type)
        assert q.parameters() == [] or all(p.data.ndim == 1 for p in q.parameters())
        w = q.dequantize()
        rows = gguf.quants.dequantize(t[tname].data, t[tname].tensor_type)
        assert w.dtype == np.float32 and w.shape == rows.T.shape
        np.testing.assert_array_equal(w, rows.T.astype(np.float32), err_msg=f"{dtype} {mod}")
    if dtype in ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        # asked for one of the issue's types: at least the v projection is that type
        assert t["blk.0.attn_v.weight"].tensor_type.name in (dtype.upper(), "Q6_K", "Q8_0")


def test_keep_types_logits_equal_the_widened_model(kept):
    from ggmlopt.io import load_gguf
    _, path, model = kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        widened, _ = load_gguf(path)
    tokens = np.random.default_rng(0).integers(0, 257, (2, 12))
    want = widened(tokens)
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["q8_0", "f16"])
def test_keep_types_maps_the_file(tmp_path, dtype):
    """Memory-mapped: bytes written into the file later show in the layer."""
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = tmp_path / "m.gguf"
    save_gguf(tiny(dim=256, ffn=256), path, tokenizer=ByteTokenizer(), dtype=dtype)
    model, _ = load_gguf(path, keep_types=True)
    t = tensors(path)["blk.0.attn_v.weight"]
    rows = gguf.quants.dequantize(t.data, t.tensor_type)
    new = np.ascontiguousarray(rows[::-1] * 0.5)      # other values, same shape
    raw = (new.astype(np.float16) if dtype == "f16"
           else gguf.quants.quantize(new, t.tensor_type))
    with open(path, "r+b") as f:
        f.seek(t.data_offset)
        f.write(raw.tobytes())
    q = dict(model.named_modules())["layers.0.self_attn.v_proj"]
    np.testing.assert_array_equal(q.dequantize(),
                                  gguf.quants.dequantize(raw, t.tensor_type).T)


def test_keep_types_load_copies_no_weights(tmp_path):
    """No copy beyond the page cache: what the load keeps allocated, and the
    resident memory it adds at its peak, are a small part of the float32 weights.
    (Peak *allocations* are not the measure: the model is built over untouched
    buffers that the kept layers replace, which never take resident memory.)"""
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = tmp_path / "m.gguf"
    model = tiny(dim=512, ffn=2048, layers=2)
    f32 = sum(p.data.nbytes for _, p in model.named_parameters())
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype="q8_0")
    tracemalloc.start()
    try:
        load_gguf(path, keep_types=True)     # the modules a load imports, imported
        _kept = load_gguf(path, keep_types=True)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # the only copies: a Llama's q and k rows, which llama.cpp's files hold permuted
    assert kept < 0.25 * os.path.getsize(path), (kept, os.path.getsize(path))
    code = """
import sys
from ggmlopt.io import load_gguf
def status(key):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) * 1024
start = status("VmRSS:")
m, _ = load_gguf(sys.argv[1], keep_types=True)
print(status("VmHWM:") - start)
"""
    r = _run([sys.executable, "-c", code, str(path)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) < 0.5 * f32, (int(r.stdout), f32)


def test_a_full_finetune_of_a_kept_model_is_refused(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    path = tmp_path / "m.gguf"
    save_gguf(tiny(), path, tokenizer=ByteTokenizer(), dtype="q8_0")
    model, _ = load_gguf(path, keep_types=True)
    with pytest.raises((ValueError, TypeError)) as e:
        go.fit(model, windows(), "cross_entropy", adamw(), silent=True)
    assert "lora.apply" in str(e.value) and "keep_types=False" in str(e.value)


def test_lora_over_a_kept_base_equals_lora_over_the_widened_base_and_merges(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.nn import Linear, QuantizedLinear
    from ggmlopt.text import ByteTokenizer
    path = tmp_path / "m.gguf"
    save_gguf(tiny(), path, tokenizer=ByteTokenizer(), dtype="q8_0")
    kept, _ = load_gguf(path, keep_types=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        widened, _ = load_gguf(path)
    for m in (kept, widened):
        lora.apply(m, rank=4, alpha=8, seed=5)
    q = dict(kept.named_modules())["layers.0.self_attn.q_proj"]
    assert isinstance(q, lora.LoRALinear)
    assert any(isinstance(v, QuantizedLinear) for v in vars(q).values())
    rng = np.random.default_rng(4)
    values = {n: rng.standard_normal(p.data.shape).astype(np.float32) * 0.05
              for n, p in widened.named_parameters() if p.requires_grad}
    for m in (kept, widened):
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.data[...] = values[n]
    tokens = rng.integers(0, 257, (2, 10))
    want = widened.forward(tokens).copy()
    got = kept.forward(tokens).copy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    g = rng.standard_normal(want.shape).astype(np.float32)
    grads = []
    for m in (kept, widened):
        m.zero_grad()
        m.forward(tokens)
        m.backward(g)
        grads.append({n: np.array(p.grad) for n, p in m.named_parameters() if p.requires_grad})
    for n in grads[1]:
        np.testing.assert_allclose(grads[0][n], grads[1][n], rtol=0,
                                   atol=1e-4 * np.abs(grads[1][n]).max(), err_msg=n)
    merged = lora.merge(kept) or kept
    mq = dict(merged.named_modules())["layers.0.self_attn.q_proj"]
    assert isinstance(mq, Linear) and mq.weight.data.dtype == np.float32
    np.testing.assert_allclose(merged(tokens), got, rtol=0, atol=1e-5 * np.abs(got).max())


def test_load_hf_keep_types_reads_float16_and_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf
    from ggmlopt.nn import QuantizedLinear
    for dt in (torch.float16, torch.bfloat16):
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg).to(dt)
        d = tmp_path / str(dt).split(".")[-1]
        hf.save_pretrained(d)
        model = load_hf(d, keep_types=True)
        model = model[0] if isinstance(model, tuple) else model
        v = dict(model.named_modules())["layers.1.self_attn.v_proj"]
        assert isinstance(v, QuantizedLinear)
        want = hf.model.layers[1].self_attn.v_proj.weight.float().T.detach().numpy()
        np.testing.assert_array_equal(v.dequantize(), want)
        assert all(p.data.ndim == 1 for _, p in model.named_parameters())
        tokens = np.arange(10)[None] % 97
        ref = hf.float()(torch.tensor(tokens)).logits.detach().numpy()
        np.testing.assert_allclose(model(tokens), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


# ---------------------------------------------------------------- issue 26, item 4

@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_save_gguf_quantizes_as_ggml_rounds(tmp_path, dtype):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = tiny(dim=256, ffn=256)
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype=dtype)
    t = tensors(path)
    v = t["blk.0.attn_v.weight"]
    assert v.tensor_type.name == dtype.upper()
    w = dict(model.named_parameters())["layers.0.self_attn.v_proj.weight"].data
    want = gguf.quants.quantize(np.ascontiguousarray(w.T), v.tensor_type)
    np.testing.assert_array_equal(np.asarray(v.data).view(np.uint8).ravel(),
                                  want.view(np.uint8).ravel())
    assert t["blk.0.attn_norm.weight"].tensor_type.name == "F32"


@pytest.mark.parametrize("dtype,ftype", [("q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
                                         ("q4_k", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
                                         ("q6_k", "LLAMA_FTYPE_MOSTLY_Q6_K")])
def test_save_gguf_writes_what_llama_quantize_writes(tmp_path, dtype, ftype):
    """Each tensor of the same type as llama-quantize gives it holds the same bytes."""
    import ctypes
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = tiny(dim=256, ffn=512)
    ours, f32, theirs = tmp_path / "ours.gguf", tmp_path / "f32.gguf", tmp_path / "q.gguf"
    save_gguf(model, ours, tokenizer=ByteTokenizer(), dtype=dtype)
    save_gguf(model, f32, tokenizer=ByteTokenizer())
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(),
                                          ctypes.byref(params)) == 0
    a, b = tensors(ours), tensors(theirs)
    same = 0
    for name, tb in b.items():
        ta = a[name]
        if ta.tensor_type == tb.tensor_type:
            same += 1
            np.testing.assert_array_equal(np.asarray(ta.data).view(np.uint8),
                                          np.asarray(tb.data).view(np.uint8), err_msg=name)
    types = {n: (a[n].tensor_type.name, b[n].tensor_type.name) for n in b}
    assert same == len(b), types


def test_save_gguf_keeps_the_source_files_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    plain, src = tmp_path / "plain.gguf", tmp_path / "src.gguf"
    save_gguf(tiny(), plain, tokenizer=ByteTokenizer())
    # the same file with a license, a name and a chat template added, as a hub file has
    r = gguf.GGUFReader(plain)
    w = gguf.GGUFWriter(src, arch="llama")
    extra = {"general.license": "apache-2.0", "general.name": "Tiny Test",
             "general.organization": "Nobody",
             "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in extra:
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, list(field.contents()), vt, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vt)
    for key, value in extra.items():
        w.add_string(key, value)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model, tok = load_gguf(src)
    out = tmp_path / "out.gguf"
    save_gguf(model, out, tokenizer=tok, dtype="q8_0")
    got = gguf.GGUFReader(out).fields
    for key, value in extra.items():
        assert key in got and got[key].contents() == value, key
    for key in r.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            assert got[key].contents() == r.fields[key].contents(), key


# ---------------------------------------------------------------- llama.cpp itself

def test_llama_cpp_applies_an_adapter_trained_over_a_quantized_base(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    sys.path.insert(0, os.path.join(HERE, "llamacpp"))
    from llamacpp_run import logits_of, open_llama, relative

    from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
    from ggmlopt.text import ByteTokenizer
    base = tmp_path / "base.gguf"
    save_gguf(tiny(dim=64), base, tokenizer=ByteTokenizer(), dtype="q8_0")
    model, _ = load_gguf(base, keep_types=True)
    lora.apply(model, rank=4, alpha=8, seed=0)
    go.fit(model, windows(n=8), "cross_entropy", adamw(3e-2), nepoch=3, nbatch_logical=4,
           silent=True, seed=0)
    adapter = tmp_path / "a.gguf"
    save_gguf_lora(model, adapter)
    ids = np.random.default_rng(3).integers(0, 256, 20)
    ours = model(ids[None])[0].astype(np.float64)
    theirs = logits_of(open_llama(base, adapter), ids)
    base_only = logits_of(open_llama(base), ids)
    assert relative(base_only, theirs) > 1e-2          # the adapter moved llama.cpp's logits
    # llama.cpp multiplies a Q8_0 base with 8-bit activations: the base alone differs
    # by that much; the adapter adds at most the issue's 1e-3 of scale to it
    bare, _ = load_gguf(base, keep_types=True)
    base_ours = bare(ids[None])[0].astype(np.float64)
    floor = relative(base_ours, base_only)
    assert relative(ours, theirs) < floor + 1e-3, (relative(ours, theirs), floor)


# ---------------------------------------------------------------- issue 27

def test_no_gradients_at_build_load_or_generate(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    # a large tied table, as SmolLM2's: a build that copies each matrix once peaks at
    # 1.24x here (the table twice); the init draws 4 MiB of float64 at a time
    cfg = LlamaConfig(vocab_size=16384, dim=512, n_layers=2, n_heads=4, ffn_dim=1024,
                      max_seq_len=64, tie_embeddings=True)
    tracemalloc.start()
    try:
        model = Llama(cfg, seed=0)
        build_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    weights = sum(p.data.nbytes for _, p in model.named_parameters())
    assert build_peak <= 1.15 * weights, build_peak / weights
    # load and generate: a model of the byte vocabulary llama.cpp's file needs
    model = tiny(dim=512, ffn=2048, layers=2)
    weights = sum(p.data.nbytes for _, p in model.named_parameters())
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    del model
    tracemalloc.start()
    try:
        model, _ = load_gguf(path)
        load_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        go.generate(model, np.arange(8), max_new_tokens=8, temperature=0.0)
        gen = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert load_peak <= 1.15 * weights, load_peak / weights
    assert gen <= 0.15 * weights, gen / weights     # KV cache of 16 positions is tiny


def test_a_lora_fit_allocates_no_gradients_for_the_frozen_base():
    cfg = LlamaConfig(vocab_size=2000, dim=256, n_layers=4, n_heads=4, ffn_dim=1024,
                      max_seq_len=16)
    model = Llama(cfg, seed=0)
    weights = sum(p.data.nbytes for _, p in model.named_parameters())
    lora.apply(model, rank=4)
    ds = windows(vocab=2000, n=2, n_ctx=8)
    tracemalloc.start()
    try:
        go.fit(model, ds, "cross_entropy", adamw(), nbatch_logical=2, silent=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.25 * weights, peak / weights


def _grads(model, tokens, g):
    model.zero_grad()
    model.forward(tokens)
    model.backward(g)
    return {n: np.array(p.grad) for n, p in model.named_parameters() if p.requires_grad}


def _families():
    from ggmlopt import models as m
    small = {"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}
    kv = {"n_kv_heads": 2, "ffn_dim": 48}
    return [(m.Llama, m.LlamaConfig(**small, **kv)), (m.GPT2, m.GPT2Config(**small)),
            (m.Qwen2, m.Qwen2Config(**small, **kv)), (m.Qwen3, m.Qwen3Config(**small, **kv)),
            (m.Mistral, m.MistralConfig(**small, **kv)), (m.Phi3, m.Phi3Config(**small, **kv)),
            (m.Gemma3, m.Gemma3Config(**small, **kv, sliding_window=4)),
            (m.SmolLM3, m.SmolLM3Config(**small, **kv))]


@pytest.mark.parametrize("i", range(8))
def test_gradient_checkpointing_gives_the_same_gradients_bit_for_bit(i):
    cls, cfg = _families()[i]
    a, b = cls(cfg, seed=1), cls(cfg, seed=1)
    b.gradient_checkpointing_enable()
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, 97, (2, 12))
    g = rng.standard_normal((2, 12, 97)).astype(np.float32)
    ga, gb = _grads(a, tokens, g), _grads(b, tokens, g)
    assert ga.keys() == gb.keys()
    for n in ga:
        np.testing.assert_array_equal(ga[n], gb[n], err_msg=n)
    b.gradient_checkpointing_disable()
    gc = _grads(b, tokens, g)
    for n in ga:
        np.testing.assert_array_equal(ga[n], gc[n], err_msg=n)


def test_gradient_checkpointing_with_lora_and_dropout_trains_the_same_bits():
    runs = []
    for ckpt in (False, True):
        model = tiny()
        lora.apply(model, rank=4, dropout=0.2, seed=0)
        if ckpt:
            model.gradient_checkpointing_enable()
        go.fit(model, windows(), "cross_entropy", adamw(), nepoch=2, nbatch_logical=4,
               silent=True, seed=0)
        runs.append({n: p.data.copy() for n, p in model.named_parameters()})
    for n in runs[0]:
        np.testing.assert_array_equal(runs[0][n], runs[1][n], err_msg=n)


def test_checkpoint_wraps_any_block_of_a_users_model():
    from ggmlopt.nn import Checkpoint, Dropout, Linear, ReLU, Sequential
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    runs = []
    for wrap in (False, True):
        block = Sequential(Linear(16, 16, rng=1), ReLU(), Dropout(0.3), Linear(16, 16, rng=2))
        model = Sequential(Linear(8, 16, rng=0), Checkpoint(block) if wrap else block,
                           ReLU(), Linear(16, 3, rng=3))
        ds = go.Dataset.from_arrays(x, y)
        go.fit(model, ds, "cross_entropy", adamw(), nepoch=2, nbatch_logical=16,
               silent=True, seed=0)
        runs.append([p.data.copy() for p in model.parameters()])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_the_fused_head_loss_and_accuracy_equal_the_logits_and_masked_rows_cost_nothing():
    model = tiny(vocab=97)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, (4, 16)).astype(np.int32)
    labels = rng.integers(0, 97, (4, 16)).astype(np.int32)
    labels[:, :10] = -1                       # a prompt
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
    ctx.alloc(True)
    result = go.Result()
    ctx.eval(result, inputs=tokens, labels=labels)
    # the loss is of the weights before the step: a fresh copy of them
    ref = tiny(vocab=97)(tokens).astype(np.float64)
    keep = labels >= 0
    z = ref[keep]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = float(np.mean(lse - z[np.arange(len(z)), labels[keep]]))
    assert abs(ctx.loss - want) <= 1e-6 * max(1.0, abs(want)) + 1e-5, (ctx.loss, want)
    acc = float(np.mean(z.argmax(1) == labels[keep]))
    assert abs(result.accuracy()[0] - acc) < 1e-9


def test_the_head_never_holds_the_whole_logits():
    """(8 x 512) rows of a 16384 vocabulary: 256 MiB of logits, 512 MiB with their
    gradient; the head may hold 64 MiB.  Resident memory (a fresh process), since
    buffers allocated and never written take none."""
    code = """
import numpy as np, ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
def status(key):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) * 1024
model = Llama(LlamaConfig(vocab_size=16384, dim=32, n_layers=1, n_heads=2, ffn_dim=32,
                          max_seq_len=512), seed=0)
ids = np.random.default_rng(0).integers(0, 16384, 8 * 256 + 513)
ds = go.Dataset.from_tokens(ids, n_ctx=512)
start = status("VmRSS:")
go.fit(model, ds, "cross_entropy", nbatch_logical=8, silent=True)
print(status("VmHWM:") - start)
"""
    r = _run([sys.executable, "-c", code], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) < 128 * 2 ** 20, int(r.stdout) / 2 ** 20


def _report(r, *names):
    for n in names:
        if isinstance(r, dict) and n in r:
            return r[n]
        if hasattr(r, n):
            return getattr(r, n)
    raise AssertionError(f"memory_report has none of {names}: {r!r}")


def test_memory_report_gives_each_part_in_bytes():
    model = tiny()
    weights = sum(p.data.nbytes for _, p in model.named_parameters())
    r = go.memory_report(model, 2, 16)
    assert _report(r, "weights") == weights
    assert _report(r, "gradients") == weights
    assert _report(r, "optimizer_state", "optimizer") == 2 * weights
    parts = [_report(r, n) for n in ("activations", "head")]
    assert all(isinstance(p, (int, np.integer)) and p > 0 for p in parts)
    assert _report(r, "total") >= 4 * weights
    lora.apply(model, rank=4)
    adapters = sum(p.data.nbytes for _, p in model.named_parameters() if p.requires_grad)
    r = go.memory_report(model, 2, 16)
    assert _report(r, "gradients") == adapters
    assert _report(r, "optimizer_state", "optimizer") == 2 * adapters


def test_fit_prints_the_memory_report_unless_silent(capsys):
    model = tiny()
    go.fit(model, windows(), "cross_entropy", adamw(), nbatch_logical=8, silent=False)
    loud = capsys.readouterr()
    go.fit(model, windows(), "cross_entropy", adamw(), nbatch_logical=8, silent=True)
    quiet = capsys.readouterr()
    assert "gradients" in (loud.out + loud.err).lower()
    assert "gradients" not in (quiet.out + quiet.err).lower()


def test_fit_refuses_what_does_not_fit_before_allocating():
    """Run in a child under an address-space limit, so a fit that does allocate
    fails there (with numpy's message, not one naming the ways out)."""
    code = r"""
import resource, numpy as np, ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
n_ctx, batch = 32768, 32
model = Llama(LlamaConfig(vocab_size=97, dim=512, n_layers=2, n_heads=4, ffn_dim=1024,
                          max_seq_len=n_ctx), seed=0)
est = go.memory_report(model, batch, n_ctx)
total = est["total"] if isinstance(est, dict) else est.total
avail = int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024
assert total > 2 * avail, (total, avail)
ids = np.random.default_rng(0).integers(0, 97, batch * n_ctx // 2 + n_ctx + 1)
ds = go.Dataset.from_tokens(ids, n_ctx=n_ctx)
try:
    go.fit(model, ds, "cross_entropy", nbatch_logical=batch, silent=True)
except MemoryError as e:
    print("REFUSED:", e)
"""
    out = _run([sys.executable, "-c", code], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    msg = out.stdout.lower()
    assert "refused:" in msg
    # activations weigh here: the ways out that shrink them are named (the message
    # names LoRA and keep_types=True where gradients and weights weigh)
    for word in ("checkpointing", "gradient_checkpointing_enable", "batch"):
        assert word in msg, (word, out.stdout)


def test_optimizer_in_backward_follows_the_same_trajectory():
    runs = []
    for inbwd in (False, True):
        model = tiny()
        go.fit(model, windows(), "cross_entropy", adamw(), nepoch=2, nbatch_logical=4,
               silent=True, seed=0, optimizer_in_backward=inbwd)
        runs.append({n: p.data.copy() for n, p in model.named_parameters()})
    for n in runs[0]:
        np.testing.assert_array_equal(runs[0][n], runs[1][n], err_msg=n)


def test_the_finetune_command_takes_optimizer_in_backward():
    out = _run([sys.executable, "-m", "ggmlopt.finetune", "--help"], timeout=120)
    assert out.returncode == 0 and "--optimizer-in-backward" in out.stdout


# ---------------------------------------------------------------- issue 30

def test_show_config_reports_the_gemm_engine(capsys):
    ret = go.show_config()
    text = capsys.readouterr().out + (ret if isinstance(ret, str) else str(ret or ""))
    assert re.search(r"gemm|engine", text, re.IGNORECASE), text
    assert "numpy" in text.lower()
    assert re.search(r"bf16", text, re.IGNORECASE), text


CHILD_GEMM = r"""
import numpy as np, ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
m = Llama(LlamaConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, ffn_dim=96,
                      max_seq_len=32), seed=0)
t = np.random.default_rng(0).integers(0, 97, (2, 20))
np.save("{out}", m(t))
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    go.show_config()
print(buf.getvalue())
"""


@pytest.mark.parametrize("engine", ["numpy", "native", "mkl"])
def test_every_gemm_engine_by_environment_variable(tmp_path, engine):
    if engine == "mkl":
        import importlib.util
        if importlib.util.find_spec("mkl") is None:
            pytest.skip("mkl not installed")
    outs = {}
    for e in ("numpy", engine):
        f = tmp_path / f"{e}.npy"
        env = dict(os.environ, GGMLOPT_GEMM=e)
        r = _run([sys.executable, "-c", CHILD_GEMM.replace("{out}", str(f))], env=env,
                 timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert e in r.stdout.lower()
        outs[e] = np.load(f)
    ref = outs["numpy"]
    np.testing.assert_allclose(outs[engine], ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_a_bad_gemm_variable_is_refused_naming_it():
    r = _run([sys.executable, "-c", "import ggmlopt"],
             env=dict(os.environ, GGMLOPT_GEMM="fastest"), timeout=120)
    assert r.returncode != 0 and "GGMLOPT_GEMM" in r.stderr


def _bf16_native():
    return bool(go.gemm.bf16_support())


def test_bf16_fit_keeps_float32_master_weights_and_differs_only_by_bf16_rounding():
    runs = {}
    for precision in ("f32", "bf16"):
        model = tiny()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = go.fit(model, windows(), "cross_entropy", adamw(1e-3), nepoch=1,
                       nbatch_logical=4, silent=True, seed=0, precision=precision)
        assert all(p.data.dtype == np.float32 for _, p in model.named_parameters())
        runs[precision] = (h[-1].train_loss, {n: p.data.copy()
                                              for n, p in model.named_parameters()})
    la, lb = runs["f32"][0], runs["bf16"][0]
    la, lb = float(np.ravel(la)[0]), float(np.ravel(lb)[0])
    assert abs(la - lb) < 0.02 * abs(la)
    if _bf16_native():
        assert any(not np.array_equal(runs["f32"][1][n], runs["bf16"][1][n])
                   for n in runs["f32"][1])


def test_optcontext_precision_and_fallback_says_so():
    code = r"""
import warnings, numpy as np, ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
m = Llama(LlamaConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=64,
                      max_seq_len=16), seed=0)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ctx = go.OptContext(m, loss_type="cross_entropy", inputs_dtype=np.int32, precision="bf16")
print("PRECISION", ctx.precision)
print("WARN", [str(x.message) for x in w])
"""
    env = dict(os.environ, GGMLOPT_SIMD="avx2", GGMLOPT_GEMM_BF16="native")
    r = _run([sys.executable, "-c", code], env=env, timeout=120)
    if r.returncode != 0 and "GGMLOPT_SIMD" in r.stderr:
        pytest.skip("this CPU has no avx2 path")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"PRECISION f32|PRECISION float32", r.stdout), r.stdout
    assert re.search(r"float32", r.stdout.split("WARN", 1)[1]), r.stdout


def test_a_bad_precision_is_refused_naming_it():
    with pytest.raises(ValueError, match="precision"):
        go.fit(tiny(), windows(), "cross_entropy", precision="fp8", silent=True)
    with pytest.raises(ValueError, match="precision"):
        go.OptContext(tiny(), loss_type="cross_entropy", inputs_dtype=np.int32,
                      precision="float8")
