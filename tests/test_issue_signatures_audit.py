"""Spellings a reader of issues 26-30 (and of llama.cpp's tools they name) would use,
checked against the calls that take them: llama-finetune's flag names and type names
in any case, numpy-style dtype names, a tokenizer's token names, Hugging Face's
gradient_checkpointing_enable arguments, gguf-py's type enum, and the top-level
functions beside generate."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny(dim=32, ffn=64, seed=0):
    return Llama(LlamaConfig(vocab_size=257, dim=dim, n_layers=1, n_heads=2, ffn_dim=ffn,
                             max_seq_len=128), seed=seed)


# ---- issue 29: llama-finetune's flags "with the same meaning" --------------------------

BASE = ["-m", "model.gguf", "--data", "train.jsonl"]


@pytest.mark.parametrize("args,dest,value", [
    # llama.cpp compares -opt case-insensitively (common_opt_get_optimizer)
    (["-opt", "ADAMW"], "optimizer", "adamw"),
    (["--optimizer", "SGD"], "optimizer", "sgd"),
    # llama-quantize upper-cases the type it is given (try_parse_ftype)
    (["--out-type", "Q8_0"], "out_type", "q8_0"),
    (["--out-type", "Q4_K_M"], "out_type", "q4_k_m"),
    (["--out-type", "F16"], "out_type", "f16"),
    # fit(precision=) takes these; the command takes what fit takes
    (["--precision", "bfloat16"], "precision", "bf16"),
    (["--precision", "BF16"], "precision", "bf16"),
    (["--precision", "float32"], "precision", "f32"),
    # llama-finetune's long forms of -c, -b, -ub, -lr (common/arg.cpp)
    (["--ctx-size", "64"], "ctx", 64),
    (["--batch-size", "128"], "tokens_batch", 128),
    (["--ubatch-size", "64"], "tokens_ubatch", 64),
    (["--learning-rate", "0.001"], "lr", 1e-3),
])
def test_finetune_takes_llama_cpps_spellings(args, dest, value):
    from ggmlopt.finetune import parser
    assert getattr(parser().parse_args(BASE + args), dest) == value


@pytest.mark.parametrize("args", [["-opt", "lion"], ["--out-type", "q3_k"],
                                  ["--precision", "f16"]])
def test_finetune_still_refuses_unknown_values(args, capsys):
    from ggmlopt.finetune import parser
    with pytest.raises(SystemExit):
        parser().parse_args(BASE + args)
    assert args[0] in capsys.readouterr().err


def test_finetune_runs_with_upper_case_types_and_long_flags(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from ggmlopt.io import save_gguf
    save_gguf(tiny(dim=64, ffn=128), tmp_path / "model.gguf",
              tokenizer=ByteTokenizer(chat_template=CHATML))
    chat = [{"role": "user", "content": "Capital of Zorblax?"},
            {"role": "assistant", "content": "Quimby."}]
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": chat}) + "\n" for _ in range(4))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "ggmlopt.finetune", "-m", "model.gguf",
                        "--data", "train.jsonl", "--ctx-size", "96", "--batch", "2",
                        "--max-steps", "1", "-opt", "ADAMW", "--learning-rate", "1e-3",
                        "--merge-out", "merged.gguf", "--out-type", "Q8_0", "--silent"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    types = {t.name: t.tensor_type.name
             for t in gguf.GGUFReader(str(tmp_path / "merged.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0", types


# ---- issue 26: save_gguf's dtype as numpy names it ---------------------------------------

def test_save_gguf_takes_bfloat16_as_it_takes_float16(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf
    model = tiny()
    save_gguf(model, tmp_path / "a.gguf", tokenizer=ByteTokenizer(), dtype="bf16")
    save_gguf(model, tmp_path / "b.gguf", tokenizer=ByteTokenizer(), dtype="bfloat16")
    a = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "a.gguf")).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "b.gguf")).tensors}
    assert a.keys() == b.keys()
    assert a["blk.0.attn_q.weight"].tensor_type.name == "BF16"
    for name, t in a.items():
        assert t.tensor_type == b[name].tensor_type, name
        np.testing.assert_array_equal(t.data, b[name].data, err_msg=name)


# ---- issue 28: token_to_id / id_to_token on the tokenizer a GGUF gives back --------------

def test_byte_tokenizer_names_tokens_as_its_files_do(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf_tokenizer, save_gguf, save_hf
    from ggmlopt.text import load_hf_tokenizer
    save_gguf(tiny(), tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    tok = load_gguf_tokenizer(tmp_path / "m.gguf")
    assert isinstance(tok, ByteTokenizer)
    field = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.tokens"]
    stored = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert [tok.id_to_token(i) for i in range(tok.vocab_size)] == stored
    assert [tok.token_to_id(t) for t in stored] == list(range(tok.vocab_size))
    assert tok.token_to_id("<|endoftext|>") == tok.eos_id == 256
    assert tok.token_to_id("hello") is None
    assert tok.id_to_token(np.int32(65)) == "A"
    for bad in (-1, 257):
        with pytest.raises(IndexError, match="token_id"):
            tok.id_to_token(bad)
    # the tokenizer.json save_hf writes names them the same way
    pytest.importorskip("tokenizers")
    save_hf(tiny(), tmp_path / "hf", tokenizer=ByteTokenizer())
    hf = load_hf_tokenizer(tmp_path / "hf")
    assert [hf.id_to_token(i) for i in range(257)] == stored
    assert [hf.token_to_id(t) for t in stored] == list(range(257))


# ---- issue 26 / 28 notes: kept layers' type names -----------------------------------------

def _q8_layer(qtype):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.nn import QuantizedLinear
    rows = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    return QuantizedLinear(raw, qtype, 64, 64), raw


def test_quantized_linear_takes_gguf_pys_type_enum():
    gguf = pytest.importorskip("gguf")
    by_name, raw = _q8_layer("Q8_0")
    by_enum, _ = _q8_layer(gguf.GGMLQuantizationType.Q8_0)
    assert by_enum.qtype == by_name.qtype == "Q8_0"
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).T
    np.testing.assert_array_equal(by_enum.dequantize(), want)
    with pytest.raises(TypeError, match="qtype"):
        _q8_layer(8)


def test_set_activations_takes_a_type_name_in_any_case():
    from ggmlopt.nn.quantized import set_activations
    layer, _ = _q8_layer("Q8_0")
    assert set_activations(layer, "Q8_0") == 1
    assert layer.activations == "q8_0"
    assert set_activations(layer, "F32") == 0
    assert layer.activations == "f32"
    for bad in ("q4_0", None):
        with pytest.raises(ValueError, match="activations"):
            set_activations(layer, bad)
    assert layer.activations == "f32"


# ---- issue 27: Hugging Face's gradient_checkpointing_enable --------------------------------

def test_gradient_checkpointing_enable_takes_hugging_faces_kwargs():
    model = tiny()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable({"use_reentrant": True, "preserve_rng_state": True})
    assert model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    for bad in ({"preserve_rng_state": False}, {"context_fn": None}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=bad)
        assert not model.is_gradient_checkpointing
    with pytest.raises(TypeError, match="gradient_checkpointing_kwargs"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=["use_reentrant"])


# ---- issue 27: "generate, perplexity, evaluate or predict" ---------------------------------

def test_perplexity_sits_beside_generate_evaluate_and_predict():
    assert go.perplexity is go.lm.perplexity
    assert "perplexity" in go.__all__
    ids = np.random.default_rng(0).integers(0, 257, 40)
    assert go.perplexity(tiny(), ids, n_ctx=16).ppl > 0
