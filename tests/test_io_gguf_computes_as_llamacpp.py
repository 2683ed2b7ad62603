"""A GGUF file means one model: what llama.cpp reads from its keys is what
ggmlopt writes and loads, or ggmlopt says where they part (a refusal, or a
warning where it follows transformers): the local layers' RoPE of a Gemma 3
without a window, an integer window pattern of 0, Phi-3's window, a scaling
factor without its type, a file loaded into a model of another config, and the
file name llama.cpp reads a Phi-3 vocabulary's whitespace rule from."""
import dataclasses
import warnings

import numpy as np
import pytest
from test_io_gguf_llama import rewrite, small

from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf
from ggmlopt.models import (
    Gemma3,
    Gemma3Config,
    Llama,
    LlamaConfig,
    Phi3,
    Phi3Config,
    SmolLM3,
    SmolLM3Config,
)
from ggmlopt.nn.rope_scaling import RopeScaling
from ggmlopt.text import ByteTokenizer

gguf = pytest.importorskip("gguf")
VT = gguf.GGUFValueType
SHAPE = {"vocab_size": 257, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 48, "max_seq_len": 16}
TOKENS = np.array([[1, 200, 7, 256, 33, 9, 17, 3, 90, 120, 5, 6]])


def test_a_gemma3_without_a_window_is_refused_when_its_local_layers_skip_the_scaling(tmp_path):
    # llama.cpp's gemma3 without a window runs every layer as global: the rope
    # scaling on every layer, where this model's local layers have none
    model = Gemma3(Gemma3Config(**SHAPE, head_dim=8, query_pre_attn_scalar=8.0, sliding_window=None,
                                sliding_layers=(True, False, True),
                                rope_local_base=10000.0, rope_base=10000.0,
                                rope_scaling=RopeScaling("linear", 2.0)), seed=0)
    path = tmp_path / "g.gguf"
    with pytest.raises(ValueError, match="rope scaling on every layer"):
        save_gguf(model, path, tokenizer=ByteTokenizer())
    assert not path.exists()
    # the same layers with no scaling compute as llama.cpp's global layers: written
    plain = Gemma3(dataclasses.replace(model.config, rope_scaling=None), seed=0)
    save_gguf(plain, path, tokenizer=ByteTokenizer())
    back, _ = load_gguf(path)
    np.testing.assert_allclose(back.forward(TOKENS), plain.forward(TOKENS), rtol=0,
                               atol=1e-5)


def test_an_integer_window_pattern_of_zero_makes_every_gemma3_layer_local(tmp_path):
    # llama.cpp's set_swa_pattern(0): every layer slides (it divided by zero here)
    model = Gemma3(Gemma3Config(**SHAPE, head_dim=8, query_pre_attn_scalar=8.0, sliding_window=3), seed=0)
    src, dst = tmp_path / "a.gguf", tmp_path / "b.gguf"
    save_gguf(model, src, tokenizer=ByteTokenizer())
    rewrite(src, dst, set_keys={"gemma3.attention.sliding_window_pattern": (0, VT.UINT32, None)})
    back, _ = load_gguf(dst)
    assert back.config.sliding_layers == (True, True, True)
    rewrite(src, dst, set_keys={"gemma3.attention.sliding_window_pattern": (2, VT.UINT32, None)})
    assert load_gguf(dst)[0].config.sliding_layers == (True, False, True)


def test_a_phi3_window_shorter_than_the_context_is_said_on_loading(tmp_path):
    # the window is kept (transformers' Phi-3), llama.cpp's phi3 ignores it
    model = Phi3(Phi3Config(**SHAPE, sliding_window=5), seed=0)
    path = tmp_path / "p.gguf"
    with pytest.warns(UserWarning, match="llama.cpp's phi3 ignores"):
        save_gguf(model, path, tokenizer=ByteTokenizer())
    with pytest.warns(UserWarning, match=r"sliding_window is 5: .*llama.cpp's phi3 ignores "
                                         r"the window.*beyond 5 tokens of its 16"):
        back, _ = load_gguf(path)
    assert back.config.sliding_window == 5
    full = Phi3(Phi3Config(**SHAPE, sliding_window=16), seed=0)
    save_gguf(full, path, tokenizer=ByteTokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a window as long as the context changes nothing
        load_gguf(path)


def test_a_scaling_factor_without_its_type_scales_as_llamacpp_does(tmp_path):
    # llama.cpp reads a missing rope.scaling.type as linear, so its factor scales;
    # an explicit "none" never scales, whatever the factor
    model = Llama(LlamaConfig(**SHAPE, rope_scaling=RopeScaling("linear", 4.0)), seed=0)
    src, dst = tmp_path / "a.gguf", tmp_path / "b.gguf"
    save_gguf(model, src, tokenizer=ByteTokenizer())
    rewrite(src, dst, drop_keys=("llama.rope.scaling.type",))
    back, _ = load_gguf(dst)
    assert back.config.rope_scaling == RopeScaling("linear", 4.0)
    np.testing.assert_array_equal(back.forward(TOKENS), model.forward(TOKENS))
    rewrite(src, dst, set_keys={"llama.rope.scaling.type": ("none", VT.STRING, None)})
    assert load_gguf(dst)[0].config.rope_scaling is None


def test_a_file_is_not_loaded_into_a_model_that_computes_otherwise(tmp_path):
    path = tmp_path / "m.gguf"
    save_gguf(small(norm_eps=1e-5, rope_base=10000.0), path, tokenizer=ByteTokenizer())
    for other, field in ((small(norm_eps=0.1), "norm_eps"),
                         (small(rope_base=500000.0), "rope_base")):
        before = {n: p.data.copy() for n, p in other.named_parameters()}
        with pytest.raises(ValueError, match=f"{field} is .*the model's.*load_gguf\\(path\\)"):
            load_gguf(path, other)
        for n, p in other.named_parameters():   # nothing was loaded
            np.testing.assert_array_equal(p.data, before[n])
    # another window length is not another model
    longer = small()
    longer_cfg = dataclasses.replace(longer.config, max_seq_len=128)
    load_gguf(path, Llama(longer_cfg, seed=3))
    # a SmolLM3 file (RoPE left out of every fourth layer) into a Llama of its shapes
    smol = SmolLM3(SmolLM3Config(**{**SHAPE, "n_layers": 4}), seed=0)
    save_gguf(smol, path, tokenizer=ByteTokenizer())
    same_shapes = {f.name: getattr(smol.config, f.name) for f in dataclasses.fields(LlamaConfig)}
    with pytest.raises(ValueError, match="architecture differs from the model's"):
        load_gguf(path, Llama(LlamaConfig(**same_shapes), seed=0))
    # a Gemma 3 without a window whose local layers compute as global ones (equal
    # bases, no scaling) reads back with every layer global: the same model
    gemma = Gemma3(Gemma3Config(**SHAPE, head_dim=8, query_pre_attn_scalar=8.0,
                                sliding_window=None, sliding_layers=(True, False, True),
                                rope_local_base=10000.0, rope_base=10000.0), seed=0)
    save_gguf(gemma, path, tokenizer=ByteTokenizer())
    into_gemma = Gemma3(gemma.config, seed=1)
    load_gguf(path, into_gemma)
    np.testing.assert_array_equal(into_gemma.forward(TOKENS), gemma.forward(TOKENS))
    # a Llama 3 scaling reads back as its frequency factors: the same model
    scaled = RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8)
    llama3 = Llama(LlamaConfig(**SHAPE, rope_scaling=scaled), seed=0)
    save_gguf(llama3, path, tokenizer=ByteTokenizer())
    into = Llama(LlamaConfig(**SHAPE, rope_scaling=scaled), seed=1)
    load_gguf(path, into)
    np.testing.assert_array_equal(into.forward(TOKENS), llama3.forward(TOKENS))


def _phi3_vocabulary(rule=True):
    """A SentencePiece vocabulary with Phi-3's whitespace rule on its special
    tokens (what load_gguf_tokenizer reads from a Phi-3 file)."""
    from ggmlopt.spm import SPMTokenizer
    pieces = ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>"] + \
        [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "h", "i", "\u2581hi"]
    scores = [0.0] * 261 + [-1.0, -2.0, -2.0, -1.0]
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * 4
    return SPMTokenizer(pieces, scores, types, bos_id=1, eos_id=2, unk_id=0,
                        rstrip_ids=(2, 3, 4) if rule else ())


def test_a_phi3_vocabulary_is_written_under_a_name_llamacpp_applies_its_rule_by(tmp_path):
    tok = _phi3_vocabulary()
    model = Phi3(Phi3Config(**{**SHAPE, "vocab_size": len(tok.tokens)}), seed=0)
    path = tmp_path / "p.gguf"
    save_gguf(model, path, tokenizer=tok)
    back = load_gguf_tokenizer(path)
    assert back.rstrip_ids == tok.rstrip_ids == {2, 3, 4}
    text = "<|user|> hi<|end|>  hi"
    assert list(back.encode(text)) == list(tok.encode(text)) \
        != list(_phi3_vocabulary(rule=False).encode(text))
    from ggmlopt.io.gguf_llama import save_llama_gguf
    save_llama_gguf(model, path, tokenizer=tok, name="My Phi-3 tune")   # a name keeping it
    assert load_gguf_tokenizer(path).rstrip_ids == {2, 3, 4}
    with pytest.raises(ValueError, match="name: 'my-tune'.*'phi3' or 'phi-3'"):
        save_llama_gguf(model, tmp_path / "q.gguf", tokenizer=tok, name="my-tune")
    with pytest.raises(TypeError, match="name: expected a str"):
        save_llama_gguf(model, tmp_path / "q.gguf", tokenizer=tok, name=3)
    assert not (tmp_path / "q.gguf").exists()


def test_a_name_given_as_metadata_keeps_the_phi3_rule_too(tmp_path):
    # metadata's general.name is the file's name (written after the writer's own):
    # one without "phi3" would silently drop the rule in llama.cpp's tokenizer
    tok = _phi3_vocabulary()
    model = Phi3(Phi3Config(**{**SHAPE, "vocab_size": len(tok.tokens)}), seed=0)
    save_gguf(model, tmp_path / "p.gguf", tokenizer=tok, metadata={"general.name": "a phi3 tune"})
    assert load_gguf_tokenizer(tmp_path / "p.gguf").rstrip_ids == {2, 3, 4}
    with pytest.raises(ValueError, match="name: 'my-tune'.*'phi3' or 'phi-3'"):
        save_gguf(model, tmp_path / "q.gguf", tokenizer=tok, metadata={"general.name": "my-tune"})
    with pytest.raises(TypeError, match="'general.name' must be a str"):
        save_gguf(model, tmp_path / "q.gguf", tokenizer=tok, metadata={"general.name": 3})
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "ggmlopt"])
def test_the_alignment_is_the_writers(tmp_path, arch):
    # the tensor offsets follow the writer's alignment: a general.alignment of the
    # caller's (an int64, or another value) would leave a file no reader can use
    from ggmlopt.models import GPT2, GPT2Config
    model = GPT2(GPT2Config(vocab_size=257, dim=32, n_layers=1, n_heads=4, max_seq_len=16)) \
        if arch == "gpt2" else Llama(LlamaConfig(**SHAPE), seed=0)
    kw = {"arch": "ggmlopt"} if arch == "ggmlopt" else {"tokenizer": ByteTokenizer()}
    with pytest.raises(ValueError, match="'general.alignment' is the file's tensor data"):
        save_gguf(model, tmp_path / "a.gguf", metadata={"general.alignment": 64}, **kw)
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "smollm3"])
def test_llama3_scaling_is_refused_where_llamacpp_reads_no_rope_freqs(tmp_path, family):
    # only llama.cpp's llama architecture reads the rope_freqs tensor; the others
    # refuse the file ("wrong number of tensors")
    from ggmlopt import models
    cls, cfg_cls = {"qwen2": (models.Qwen2, models.Qwen2Config),
                    "qwen3": (models.Qwen3, models.Qwen3Config),
                    "phi3": (Phi3, Phi3Config),
                    "smollm3": (SmolLM3, SmolLM3Config)}[family]
    scaled = RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8)
    model = cls(cfg_cls(**{**SHAPE, "n_layers": 4}, rope_scaling=scaled), seed=0)
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=f"rope_freqs tensor, which its {family} "
                                         "architecture does not read"):
        save_gguf(model, path, tokenizer=ByteTokenizer())
    assert not path.exists()
    llama = Llama(LlamaConfig(**SHAPE, rope_scaling=scaled), seed=0)
    save_gguf(llama, path, tokenizer=ByteTokenizer())   # llama's own: written
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}


def test_a_phi3_with_its_own_head_width_is_refused(tmp_path):
    # llama.cpp's phi3 takes dim / heads values a head and refuses the file otherwise
    model = Phi3(Phi3Config(**SHAPE, head_dim=12), seed=0)
    with pytest.raises(ValueError, match="phi3 takes heads of dim / heads = 8"):
        save_gguf(model, tmp_path / "p.gguf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "p.gguf").exists()


@pytest.mark.parametrize("keep_types", [False, True])
def test_a_llama_file_with_its_own_head_width_reads_as_a_mistral(tmp_path, keep_types):
    # llama.cpp's llama architecture takes key_length as the head width (Mistral
    # Nemo's files); transformers' Llama has no head_dim, its Mistral has
    from ggmlopt.models import Mistral, MistralConfig
    model = Mistral(MistralConfig(**SHAPE, head_dim=16), seed=0)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    back, _ = load_gguf(tmp_path / "m.gguf", keep_types=keep_types)
    assert type(back) is Mistral and back.config.head_dim == 16
    want = model.forward(TOKENS)
    np.testing.assert_allclose(back.forward(TOKENS), want, rtol=0,
                               atol=0 if not keep_types else 1e-6 * np.abs(want).max())
