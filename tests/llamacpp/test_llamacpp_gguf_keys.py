"""The keys (and optional tensors) llama.cpp's load_hparams reads for each
architecture ggmlopt loads, set to values other than the writer's: a file
load_gguf takes gives llama.cpp's logits on it (f32 weights, an f32 KV cache),
and one it cannot compute as llama.cpp does is refused by name, never read
with the key dropped.  (llama-cpp-python is optional: these tests skip without it.)

- phi3.rope.scaling.attn_factor without LongRoPE's factor tensors: llama.cpp
  multiplies the rotated q and k by it on every layer; refused unless 1;
- rope_freqs.weight in a file of another architecture than llama: llama.cpp
  refuses the file ("wrong number of tensors"), so does load_gguf;
- found right: the norm epsilon and RoPE base, linear scaling, uniform per-layer
  arrays (head counts, feed-forward width) on llama, qwen2, qwen3, smollm3 and
  phi3; Phi-3's partial rotary share without LongRoPE; Gemma 3's window pattern
  (an integer, an array), its local base missing, no window, and its 62-layer
  attention scale (dim / heads, not head_dim).
"""
import warnings

import numpy as np
import pytest
from test_io_gguf_llama import rewrite
from test_llamacpp_gguf import TEXT, llama_cpp_logits, open_llama, our_logits, relative_error

from ggmlopt.io import load_gguf, save_gguf
from ggmlopt.models import (
    Gemma3,
    Gemma3Config,
    Llama,
    LlamaConfig,
    Phi3,
    Phi3Config,
    Qwen2,
    Qwen2Config,
    Qwen3,
    Qwen3Config,
    SmolLM3,
    SmolLM3Config,
)
from ggmlopt.text import ByteTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")
VT = gguf.GGUFValueType

N_CTX = 48
IDS = ByteTokenizer().encode(TEXT)[:40]
SHAPE = {"vocab_size": 257, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
         "max_seq_len": N_CTX}
GELU_TOL = 2e-3   # ggml's float16 GELU table (Gemma 3), as test_llamacpp_gguf finds
FAMILIES = {"llama": (Llama, LlamaConfig, 2), "qwen2": (Qwen2, Qwen2Config, 2),
            "qwen3": (Qwen3, Qwen3Config, 2), "smollm3": (SmolLM3, SmolLM3Config, 4),
            "phi3": (Phi3, Phi3Config, 2)}


def spread(model, seed, gain=8.0, norms=(0.5, 1.5)):
    """Logits of some size: matrices scaled by gain, biases N(0, 0.5), norms uniform."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= gain
        elif name.endswith(".bias"):
            p.data[...] = rng.normal(0, 0.5, p.shape)
        else:
            p.data[...] = rng.uniform(*norms, p.shape)


def saved(tmp_path, family, **config):
    cls, cfg_cls, n_layers = FAMILIES[family]
    model = cls(cfg_cls(**{**SHAPE, "n_layers": n_layers, **config}), seed=0)
    spread(model, 6)
    path = tmp_path / f"{family}.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    return model, path


def llama_cpp_on(path):
    return llama_cpp_logits(open_llama(path, n_ctx=N_CTX), IDS)


def loaded_logits(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = load_gguf(path)
    return our_logits(model, IDS)


# ---- defects: keys and tensors llama.cpp honours that ggmlopt dropped ------------------

def test_a_phi3_attention_factor_without_longrope_is_refused(tmp_path):
    # llama.cpp reads phi3.rope.scaling.attn_factor for any file and scales the rotated q
    # and k by it (cparams.yarn_attn_factor); without the LongRoPE factor tensors ggmlopt
    # read the key and dropped it: logits 0.7 of their scale away from llama.cpp's
    model, path = saved(tmp_path, "phi3")
    scaled = tmp_path / "attn_factor.gguf"
    rewrite(path, scaled, set_keys={"phi3.rope.scaling.attn_factor": (1.5, VT.FLOAT32, None)})
    assert relative_error(our_logits(model, IDS), llama_cpp_on(scaled)) > 0.1   # it counts
    with pytest.raises(ValueError, match=r"phi3.rope.scaling.attn_factor = 1.5 without "
                                         r"LongRoPE's"):
        load_gguf(scaled)
    # 1 scales nothing: read, and llama.cpp's logits
    one = tmp_path / "one.gguf"
    rewrite(path, one, set_keys={"phi3.rope.scaling.attn_factor": (1.0, VT.FLOAT32, None)})
    assert relative_error(loaded_logits(one), llama_cpp_on(one)) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "smollm3", "phi3", "gemma3"])
def test_rope_freqs_outside_the_llama_architecture_is_refused(tmp_path, family):
    # only llama.cpp's llama reads rope_freqs.weight; its other architectures refuse the
    # file, where ggmlopt applied the factors (the writer already refused to write them)
    if family == "gemma3":
        model = Gemma3(Gemma3Config(**SHAPE, n_layers=2, head_dim=16, query_pre_attn_scalar=16.0),
                       seed=0)
        path = tmp_path / "gemma3.gguf"
        save_gguf(model, path, tokenizer=ByteTokenizer())
    else:
        _, path = saved(tmp_path, family)
    with_freqs = tmp_path / "rope_freqs.gguf"
    _add_tensor(path, with_freqs, "rope_freqs.weight", np.linspace(1, 8, 8, dtype=np.float32))
    with pytest.raises(ValueError):
        open_llama(with_freqs)
    with pytest.raises(ValueError, match=f"rope_freqs.weight.*{family}"):
        load_gguf(with_freqs)


def _add_tensor(src, dst, name, array):
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == VT.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- keys found right: llama.cpp's logits from the file load_gguf reads -----------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_keys_give_llama_cpp_s_logits(tmp_path, family):
    _, path = saved(tmp_path, family, norm_eps=0.3, rope_base=500.0)
    n_layers = FAMILIES[family][2]
    variants = {
        "plain": {},
        "linear": {f"{family}.rope.scaling.type": ("linear", VT.STRING, None),
                   f"{family}.rope.scaling.factor": (4.0, VT.FLOAT32, None)},
        "per-layer": {f"{family}.{key}": ([value] * n_layers, VT.ARRAY, VT.UINT32)
                      for key, value in (("attention.head_count", 4),
                                         ("attention.head_count_kv", 2),
                                         ("feed_forward_length", 96))}}
    if family == "phi3":   # Phi-4-mini's partial rotary share, without LongRoPE
        variants["partial"] = {"phi3.rope.dimension_count": (12, VT.UINT32, None)}
    plain = None
    for name, keys in variants.items():
        out = tmp_path / f"{name}.gguf"
        rewrite(path, out, set_keys=keys)
        want = llama_cpp_on(out)
        assert relative_error(loaded_logits(out), want) < 1e-4, name
        if plain is None:
            plain = want
        elif name != "per-layer":   # the key counts: llama.cpp's logits moved
            assert relative_error(plain, want) > 1e-2, name


def _gemma3(tmp_path, n_layers=7, head_dim=16, ffn_dim=96):
    cfg = Gemma3Config(**{**SHAPE, "ffn_dim": ffn_dim}, n_layers=n_layers, head_dim=head_dim,
                       query_pre_attn_scalar=64 / 4 if n_layers == 62 else float(head_dim),
                       sliding_window=5, rope_base=10000.0, rope_local_base=100.0)
    model = Gemma3(cfg, seed=0)
    spread(model, 8, gain=4.0 if n_layers < 62 else 3.0, norms=(-0.5, 0.5))
    path = tmp_path / "gemma3.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer())
    return path


def test_gemma3_window_keys_give_llama_cpp_s_logits(tmp_path):
    path = _gemma3(tmp_path)
    variants = {
        "written": ({}, ()),
        "pattern 3": ({"gemma3.attention.sliding_window_pattern": (3, VT.UINT32, None)}, ()),
        "pattern array": ({"gemma3.attention.sliding_window_pattern": (
            [True, False, False, True, True, False, True], VT.ARRAY, VT.BOOL)}, ()),
        # without the pattern: every sixth layer global; without the local base: 10000
        "defaults": ({}, ("gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa")),
        "no window": ({"gemma3.attention.sliding_window": (0, VT.UINT32, None)}, ())}
    seen = []
    for name, (keys, dropped) in variants.items():
        out = tmp_path / f"{name.replace(' ', '_')}.gguf"
        rewrite(path, out, set_keys=keys, drop_keys=dropped)
        want = llama_cpp_on(out)
        assert relative_error(loaded_logits(out), want) < GELU_TOL, name
        assert all(relative_error(other, want) > 1e-2 for other in seen), name
        seen.append(want)


def test_a_62_layer_gemma3_scales_the_scores_by_dim_over_heads(tmp_path):
    # llama.cpp's gemma3 at 62 layers (Gemma 3 27B) scales by (dim / heads) ** -0.5 = 1/4,
    # not head_dim ** -0.5; 62 layers of ggml's float16 GELU table: 2^-8 of the scale
    path = _gemma3(tmp_path, n_layers=62, head_dim=32, ffn_dim=32)
    model, _ = load_gguf(path)
    assert model.config.query_pre_attn_scalar == 16.0
    assert relative_error(our_logits(model, IDS), llama_cpp_on(path)) < 8e-3
