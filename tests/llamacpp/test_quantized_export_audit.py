"""save_gguf(dtype=...) against llama.cpp's own llama-quantize, family by family,
and the fine-tune-then-export round trip (load_gguf, LoRA, merge, save_gguf).

- For llama, qwen2, qwen3, gemma3 and phi3 models (rows of 256 values, where
  the K types apply, and of 576, where llama-quantize falls back), the file
  save_gguf writes for each file type has, tensor for tensor, the types and
  bytes llama-quantize writes from the float32 file of the same model (the
  binary named by GGMLOPT_LLAMA_QUANTIZE: these tests skip without it), and
  its general.file_type.
- llama.cpp runs each such file with the logits of load_gguf(keep_types=True):
  within twice what rounding the weights to Q8_0 moves them (llama.cpp's
  8-bit activations; test_llamacpp_qlora's bound).
- A model read from a GGUF that llama-quantize wrote (Phi-3's vocabulary from
  GGMLOPT_LLAMA_CPP_SRC: a chat template, special ids; general.* keys),
  LoRA-tuned, merged and saved as q8_0 keeps what its file said and labels
  itself Q8_0; a tokenizer key the tokenizer dropped after loading (its chat
  template, end-of-turn or padding id) is not written back.
"""
import os
import pathlib
import subprocess
import warnings

import numpy as np
import pytest
from llama_cpp_source import MODELS
from llamacpp_run import eight_bit_error, logits_of, open_llama, relative

from ggmlopt import lora
from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf
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
)
from ggmlopt.text import ByteTokenizer

gguf = pytest.importorskip("gguf")

TOK = ByteTokenizer()
TEXT = "a quantized export read by llama.cpp: é ✓ and some words " * 2
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
DTYPES = ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")


def _quantize_binary():
    path = os.environ.get("GGMLOPT_LLAMA_QUANTIZE")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("set GGMLOPT_LLAMA_QUANTIZE to a llama-quantize binary")
    return path


def _llama_quantize(src, dst, dtype):
    done = subprocess.run([_quantize_binary(), str(src), str(dst), dtype.upper(), "1"],
                          check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _model(family, dim, ffn, n_layers, vocab=TOK.vocab_size, seed=5):
    """Matrices scaled up (logits that depend on them more than on rounding),
    norms and biases drawn (ones and zeros would test nothing)."""
    tie = family == "gemma3"
    kw = {"vocab_size": vocab, "dim": dim, "n_layers": n_layers, "n_heads": 4,
          "n_kv_heads": 2, "ffn_dim": ffn, "max_seq_len": 64, "tie_embeddings": tie}
    if family == "gemma3":
        model = Gemma3(Gemma3Config(**kw, head_dim=dim // 4, query_pre_attn_scalar=dim / 4,
                                    sliding_window=32), seed=seed)
    else:
        cls, cfg = {"llama": (Llama, LlamaConfig), "qwen2": (Qwen2, Qwen2Config),
                    "qwen3": (Qwen3, Qwen3Config), "phi3": (Phi3, Phi3Config)}[family]
        model = cls(cfg(**kw), seed=seed)
    rng = np.random.default_rng(1)
    for _, p in model.named_parameters():
        if p.data.ndim == 2:
            p.data *= 4.0
        else:
            p.data[...] += rng.normal(0, 0.3, p.shape)
    return model


def _tensors(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).tobytes())
                    for t in reader.tensors}


def _save_quiet(model, path, dtype, tokenizer=TOK):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fall-backs' warning
        save_gguf(model, path, tokenizer=tokenizer, dtype=dtype)


# 8 layers of 256: every K type, and use_more_bits' layers (0, 3, 6, 7) differ from
# the rest; 3 layers of 576 (and a 1536 feed-forward): every K type falls back
SHAPES = [(256, 512, 8), (576, 1536, 3)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dim,ffn,n_layers", SHAPES)
def test_save_gguf_writes_what_the_llama_quantize_binary_writes(tmp_path, family, dim, ffn,
                                                                  n_layers):
    _quantize_binary()
    model = _model(family, dim, ffn, n_layers)
    f32 = tmp_path / "f32.gguf"
    save_gguf(model, f32, tokenizer=TOK)
    for dtype in DTYPES:
        theirs, ours = tmp_path / f"{dtype}_t.gguf", tmp_path / f"{dtype}_o.gguf"
        _llama_quantize(f32, theirs, dtype)
        _save_quiet(model, ours, dtype)
        (ra, a), (rb, b) = _tensors(ours), _tensors(theirs)
        assert set(a) == set(b), dtype
        for name in b:
            assert a[name][0] == b[name][0], (dtype, name)
            assert a[name][1] == b[name][1], (dtype, name, a[name][0])
        for key in ("general.file_type", "general.quantization_version"):
            assert ra.fields[key].contents() == rb.fields[key].contents(), (dtype, key)


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_each_export_with_the_kept_models_logits(tmp_path, family):
    pytest.importorskip("llama_cpp")
    ids = np.array(TOK.encode(TEXT)[:64])
    for dim, ffn in ((256, 512), (576, 1536)):
        model = _model(family, dim, ffn, n_layers=1)
        bound = 2 * eight_bit_error(model, ids)
        for dtype in DTYPES:
            path = tmp_path / f"{dim}_{dtype}.gguf"
            _save_quiet(model, path, dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kept, _ = load_gguf(path, keep_types=True)
            ours = kept(ids[None])[0].astype(np.float64)
            err = relative(ours, logits_of(open_llama(path), ids))
            assert err <= bound, (dim, dtype, err, bound)


# ---- the round trip: a file llama-quantize wrote, tuned, merged, saved as q8_0 ----

PHI3_VOCAB = pathlib.Path(MODELS) / "ggml-vocab-phi-3.gguf"   # GGMLOPT_LLAMA_CPP_SRC
EXTRA = {"general.license": "mit", "general.size_label": "3.8B", "general.basename": "Phi-3",
         "general.finetune": "instruct", "general.organization": "Microsoft"}


def _with_keys(src, dst, keys):
    """dst: the float32 GGUF src with more key-values {key: (value, GGUFValueType)},
    as llama.cpp's converter writes them."""
    vt = gguf.GGUFValueType
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             field.types[-1] if vtype == vt.ARRAY else None)
    for key, (value, vtype) in keys.items():
        writer.add_key_value(key, value, vtype, vt.STRING if vtype == vt.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def phi3_q4_k_m(tmp_path_factory):
    """A Phi-3 with Phi-3's own vocabulary (its chat template, special ids,
    add_bos), more general.* keys, an end-of-turn id and a named template,
    quantized by llama-quantize to Q4_K_M."""
    if not PHI3_VOCAB.exists():
        pytest.skip(f"no {PHI3_VOCAB} (set GGMLOPT_LLAMA_CPP_SRC to llama.cpp's source)")
    vt = gguf.GGUFValueType
    tok = load_gguf_tokenizer(PHI3_VOCAB)
    where = tmp_path_factory.mktemp("phi3")
    f32 = where / "f32.gguf"
    save_gguf(_model("phi3", 256, 512, 2, vocab=tok.vocab_size), f32, tokenizer=tok,
              metadata={"general.name": "Phi-3 Mini", **EXTRA})
    _with_keys(f32, where / "f32b.gguf", {
        "tokenizer.ggml.eot_token_id": (32007, vt.UINT32),
        "tokenizer.chat_template.tool_use": ("{{ 'tools' }}", vt.STRING),
        "general.tags": (["text-generation", "nlp"], vt.ARRAY)})
    _llama_quantize(where / "f32b.gguf", where / "src.gguf", "q4_k_m")
    return where / "src.gguf"


def _fields(path):
    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if not key.startswith("GGUF."):
            out[key] = (field.contents(), field.types[0].name)
    return out


@pytest.mark.parametrize("keep_types", [False, True])
def test_a_tuned_merged_q8_0_export_says_what_its_source_said(tmp_path, phi3_q4_k_m,
                                                              keep_types):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # dequantized to float32 (keep_types=False)
        model, tok = load_gguf(phi3_q4_k_m, keep_types=keep_types)
    lora.apply(model, rank=4, alpha=8.0, targets="all-linear", seed=1)
    rng = np.random.default_rng(0)
    for _, layer in lora.named_adapters(model):   # zeros would change nothing
        layer.lora_b.data[...] = rng.normal(0, 0.05, layer.lora_b.shape)
    lora.merge(model)
    out = tmp_path / "tuned.gguf"
    _save_quiet(model, out, "q8_0", tokenizer=tok)
    src, ours = _fields(phi3_q4_k_m), _fields(out)
    assert src["general.file_type"][0] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert ours["general.file_type"][0] == gguf.LlamaFileType.MOSTLY_Q8_0
    # (gguf-py lists the named templates as convert_hf_to_gguf does)
    assert ours.pop("tokenizer.chat_templates")[0] == ["tool_use"]
    differ = {k for k in set(src) | set(ours) if src.get(k) != ours.get(k)}
    assert differ == {"general.file_type"}, differ
    # the merged matrices are Q8_0; the ones kept in their types (the embedding and
    # head all-linear leaves alone) are the source's
    _, tensors = _tensors(out)
    _, source = _tensors(phi3_q4_k_m)
    for name, (qtype, _) in tensors.items():
        if name in ("token_embd.weight", "output.weight") and keep_types:
            assert tensors[name] == source[name], name
        elif name.endswith("norm.weight"):
            assert qtype == "F32", name
        else:
            assert qtype == "Q8_0", name
    pytest.importorskip("llama_cpp")
    ids = np.array(tok.encode("<|user|>\nHello, world<|end|>\n<|assistant|>\n")[:32])
    err = relative(model(ids[None])[0].astype(np.float64), logits_of(open_llama(out), ids))
    assert err <= 2 * eight_bit_error(model, ids), err


@pytest.mark.parametrize("attribute,key", [
    ("chat_template", "tokenizer.chat_template"),
    ("named_chat_templates", "tokenizer.chat_template.tool_use"),
    ("eot_id", "tokenizer.ggml.eot_token_id"),
    ("pad_id", "tokenizer.ggml.padding_token_id")])
def test_a_tokenizer_key_dropped_after_loading_is_not_written_back(tmp_path, phi3_q4_k_m,
                                                                   attribute, key):
    """Before: the source's key was carried, and the written file (and llama.cpp,
    which stops generating at its end-of-turn id) said what the tokenizer
    written no longer held; read back, the tokenizer had it again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = load_gguf(phi3_q4_k_m)
    assert getattr(tok, attribute)
    setattr(tok, attribute, {} if attribute == "named_chat_templates" else None)
    out = tmp_path / "out.gguf"
    _save_quiet(model, out, "q8_0", tokenizer=tok)
    fields = _fields(out)
    assert key not in fields
    assert "tokenizer.chat_templates" not in fields or attribute != "named_chat_templates"
    assert fields["general.license"][0] == "mit"   # the rest is carried as before
    _, again = load_gguf(out)
    assert not getattr(again, attribute, None)
