"""load_gguf reads what llama.cpp's own converter (convert_hf_to_gguf.py, in
llama.cpp's source: GGMLOPT_LLAMA_CPP_SRC) writes from a Hugging Face
checkpoint, bit for bit: for every family, a random model written by save_hf is
converted to an F32 GGUF by llama.cpp's model classes, and load_gguf gives back
the same config and every parameter's bits (the converter's q/k permutation,
fused tensors, norm offsets and rope factors undone exactly).

The converter reads a checkpoint's tokenizer from its tokenizer files and
knows only the vocabularies it has hashed; these tiny models run on bytes, so
the driver replaces the converter's vocabulary step with ggmlopt's byte
vocabulary (the same keys save_gguf writes) and runs the rest of it unchanged.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ggmlopt.io import load_gguf, save_hf
from ggmlopt.text import ByteTokenizer

pytest.importorskip("torch")
pytest.importorskip("gguf")
SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "for convert_hf_to_gguf.py) is not set")

DRIVER = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    src, model_dir, out, vocab = sys.argv[1:5]
    sys.path.insert(0, src)
    sys.path.insert(1, str(Path(src) / "gguf-py"))
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(Path(model_dir), False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    tok = json.loads(Path(vocab).read_text())

    def byte_vocabulary(self):   # the byte vocabulary save_gguf writes
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(tok["eos"])
        w.add_eos_token_id(tok["eos"])
        w.add_add_bos_token(False)

    cls.set_vocab = byte_vocabulary   # (a subclass would register itself as a model class)
    with torch.inference_mode():
        cls(Path(model_dir), gguf.LlamaFileType.ALL_F32, Path(out)).write()
''')


def _vocabulary(tmp_path):
    from ggmlopt.io._gguf_tokenizer_keys import tokenizer_keys
    keys = tokenizer_keys(ByteTokenizer(), 257)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({k: keys[k] for k in ("tokens", "types", "merges", "eos")}))
    return path


def _convert(model_dir, out, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    result = subprocess.run([sys.executable, str(driver), SRC, str(model_dir), str(out),
                             str(_vocabulary(tmp_path))], check=False, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _families():
    from ggmlopt.models import (
        GPT2,
        Gemma3,
        Gemma3Config,
        GPT2Config,
        Llama,
        LlamaConfig,
        Mistral,
        MistralConfig,
        Phi3,
        Phi3Config,
        Qwen2,
        Qwen2Config,
        Qwen3,
        Qwen3Config,
        SmolLM3,
        SmolLM3Config,
    )
    from ggmlopt.nn import RopeScaling
    common = {"vocab_size": 257, "n_layers": 4, "max_seq_len": 64}
    gqa = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}
    llama3 = RopeScaling("llama3", 32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=16)
    longrope = RopeScaling("longrope", 2.0, original_max_position_embeddings=32,
                           short_factor=tuple(1.0 + i / 10 for i in range(6)),
                           long_factor=tuple(2.0 + i / 4 for i in range(6)))
    return {
        "llama": lambda: Llama(LlamaConfig(**common, **gqa), seed=1),
        "llama3-tied": lambda: Llama(LlamaConfig(**common, **gqa, tie_embeddings=True,
                                                 rope_base=500000.0, rope_scaling=llama3),
                                     seed=2),
        "qwen2": lambda: Qwen2(Qwen2Config(**common, **gqa, tie_embeddings=True), seed=3),
        "qwen3": lambda: Qwen3(Qwen3Config(**common, **gqa, head_dim=24), seed=4),
        "mistral": lambda: Mistral(MistralConfig(**common, **gqa, sliding_window=None),
                                   seed=5),
        # Mistral Nemo's: heads narrower than dim // n_heads
        "mistral-head-dim": lambda: Mistral(MistralConfig(**common, **gqa, head_dim=8,
                                                          sliding_window=None), seed=5),
        "phi3": lambda: Phi3(Phi3Config(**common, **gqa), seed=6),
        # Phi-4-mini's: LongRoPE over half of its 64 positions, 3/4 of each head rotating
        "phi3-longrope": lambda: Phi3(Phi3Config(**common, **gqa, original_max_seq_len=32,
                                                 rope_scaling=longrope,
                                                 partial_rotary_factor=0.75), seed=6),
        "smollm3": lambda: SmolLM3(SmolLM3Config(**common, **gqa), seed=7),
        "gemma3": lambda: Gemma3(Gemma3Config(**{**common, "n_layers": 7}, **gqa, head_dim=16,
                                              query_pre_attn_scalar=16.0, sliding_window=5),
                                 seed=8),
        "gpt2": lambda: GPT2(GPT2Config(**common, dim=64, n_heads=4), seed=9),
    }


@pytest.mark.parametrize("family", list(_families()))
def test_load_gguf_reads_llama_cpps_conversion_bit_for_bit(tmp_path, family):
    import dataclasses

    from ggmlopt.models import Llama, LlamaConfig, Mistral
    model = _families()[family]()
    rng = np.random.default_rng(11)
    for _, p in model.named_parameters():   # norms and biases away from their init
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    save_hf(model, tmp_path / "hf")
    if family == "gemma3":   # its converter cuts the embedding to the tokenizer's size
        vocab = {t: i for i, t in enumerate(json.loads(_vocabulary(tmp_path).read_text())
                                            ["tokens"])}
        (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(
            {"model": {"vocab": vocab}, "added_tokens": []}))
    out = tmp_path / "converted.gguf"
    _convert(tmp_path / "hf", out, tmp_path)
    back, tok = load_gguf(out)
    assert isinstance(tok, ByteTokenizer)
    want = model.config
    if family == "mistral-head-dim":   # the llama architecture with its own head width
        assert type(back) is Mistral
    elif isinstance(model, Mistral):   # llama.cpp converts a Mistral to its llama
        assert type(back) is Llama
        want = LlamaConfig(**{f.name: getattr(want, f.name)
                              for f in dataclasses.fields(LlamaConfig)})
    else:
        assert type(back) is type(model)
    if family == "llama3-tied":
        # the converter stores Llama 3's scaling as llama.cpp's per-frequency factors
        # (rope_freqs), computed in float32: ours to a few ulps, the same logits
        from ggmlopt.io.gguf_llama import _rope_scaling_out
        _, tensors = _rope_scaling_out(want, "llama")
        factors = tensors[0][1]
        got = np.asarray(back.config.rope_scaling.freq_factors, np.float32)
        np.testing.assert_array_max_ulp(got, factors, maxulp=4)
        want = dataclasses.replace(want, rope_scaling=back.config.rope_scaling)
        ids = rng.integers(0, 257, (1, 40))
        a, b = model(ids).astype(np.float64), back(ids).astype(np.float64)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    if family == "phi3-longrope":
        # the converter writes the factors and its attention factor (transformers'
        # default from 64 / 32 positions) in float32: the same within their rounding,
        # the same logits on both sides of the switch
        s = back.config.rope_scaling
        assert s.short_factor == tuple(float(np.float32(f)) for f in want.rope_scaling.short_factor)
        assert s.attention_factor == pytest.approx(np.sqrt(1 + np.log(2) / np.log(32)), rel=1e-7)
        want = dataclasses.replace(want, rope_scaling=s)
        for T in (20, 40):
            ids = rng.integers(0, 257, (1, T))
            a, b = model(ids).astype(np.float64), back(ids).astype(np.float64)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert back.config == want
    ours = dict(model.named_parameters())
    theirs = dict(back.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        if family == "gemma3" and p.data.ndim == 1:
            # the file holds 1 + w (what Gemma's norms multiply by): that sum's bits
            one = np.float32(1.0)
            np.testing.assert_array_equal(one + theirs[name].data, one + p.data, err_msg=name)
            continue
        np.testing.assert_array_equal(theirs[name].data, p.data, err_msg=name)
