"""Bad input to the fine-tuning API (lora, the adapter and model files, the
instruction datasets, QuantizedLinear, memory_report): a Python exception of
the right kind naming the argument, and every object left unchanged."""
import numpy as np
import pytest
from finetune_files import CHATML

import ggmlopt as go
from ggmlopt import io, lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn import QuantizedLinear, named_modules, named_parameters
from ggmlopt.text import ByteTokenizer

CFG = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                  max_seq_len=16)


def _state(model):
    """The parameters' values, flags and identities, and the module tree."""
    return ([(name, p.data.copy(), p.requires_grad, id(p)) for name, p in named_parameters(model)],
            [(name, type(m).__name__, id(m)) for name, m in named_modules(model)])


def _assert_unchanged(model, before):
    params, tree = _state(model)
    assert tree == before[1]
    assert [(n, g, i) for n, _, g, i in params] == [(n, g, i) for n, _, g, i in before[0]]
    for (_, a, *_), (_, b, *_) in zip(params, before[0]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("call", [lora.apply, lora.merge, lora.trainable_parameters,
                                  lora.print_trainable_parameters])
@pytest.mark.parametrize("model", [None, 3, "llama"])
def test_lora_functions_name_a_model_that_is_no_model(call, model):
    with pytest.raises(TypeError, match=r"^model: expected a model"):
        call(model)


@pytest.mark.parametrize("arg", ["targets", "trainable"])
def test_bytes_names_are_refused_as_bytes(arg):
    model = Llama(CFG, seed=0)
    before = _state(model)
    with pytest.raises(TypeError, match=rf"^{arg}: expected names .* got bytes"):
        lora.apply(model, rank=2, **{arg: b"q_proj"})
    _assert_unchanged(model, before)


@pytest.mark.parametrize("make", [lambda: go.nn.Linear(4, 5, rng=0),
                                  lambda: go.nn.Embedding(6, 4, rng=0)])
def test_an_adapter_names_an_rng_that_is_no_generator_or_seed(make):
    base = make()
    adapter = lora.LoRALinear if isinstance(base, go.nn.Linear) else lora.LoRAEmbedding
    with pytest.raises(TypeError, match=r"^rng: expected None, an int seed or a numpy "
                                        r"Generator, got str"):
        adapter(base, 2, 4.0, rng="seed")
    assert base.weight.requires_grad


def test_from_chat_with_a_str_for_the_tokenizer_is_a_type_error():
    chat = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    with pytest.raises(TypeError, match=r"^tokenizer: expected a ggmlopt tokenizer, got str"):
        go.Dataset.from_chat(chat, "HuggingFaceTB/SmolLM2-135M-Instruct", 32)


@pytest.mark.parametrize("pairs", [5, {"prompt": "a", "completion": "b"}, "ab"])
def test_from_completions_names_pairs_that_are_no_list(pairs):
    tok = ByteTokenizer(chat_template=CHATML)
    with pytest.raises(TypeError, match=r"^pairs: expected a list of \(prompt, completion\)"):
        go.Dataset.from_completions(pairs, tok, 32)


@pytest.mark.parametrize("texts", ["one text, not a list", {"text": "x"}, 5])
def test_from_texts_refuses_texts_that_are_no_list(texts):
    # a str was read as one text per character
    with pytest.raises(TypeError, match=r"^texts: expected a list of texts"):
        go.Dataset.from_texts(texts, ByteTokenizer(), 32)


@pytest.mark.parametrize("add_eos", [True, False])
@pytest.mark.parametrize("text", ["", {"text": ""}])
def test_an_empty_text_is_refused_by_its_row_whatever_add_eos_says(add_eos, text):
    # with the EOS appended it was dropped with another reason (ByteTokenizer) or
    # kept as a BOS -> EOS example (a vocabulary with a BOS)
    with pytest.raises(ValueError, match=r"^texts\[1\]: the text is empty"):
        go.Dataset.from_texts(["hello", text], ByteTokenizer(), 32, add_eos=add_eos)


def test_quantized_layers_name_in_features_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match=r"^in_features: Q4_K rows hold whole blocks of 256 "
                                         r"values; got 96"):
        QuantizedLinear(np.zeros((8, 54), np.uint8), "Q4_K", 96, 8)
    with pytest.raises(ValueError, match=r"^embedding_dim: Q4_K rows"):
        go.nn.QuantizedEmbedding(np.zeros((8, 54), np.uint8), "Q4_K", 8, 96)


@pytest.mark.parametrize("bad,kind,match", [
    # (the optimizer as OptContext takes it: an OptimizerType's value too)
    ({"optimizer": 5}, ValueError, "optimizer"), ({"optimizer": 2.5}, TypeError, "optimizer"),
    ({"labelled": "1"}, TypeError, "labelled"),
    ({"labelled": float("nan")}, ValueError, "labelled")])
def test_memory_report_argument_kinds(bad, kind, match):
    with pytest.raises(kind, match=f"^{match}: "):
        go.memory_report(Llama(CFG, seed=0), 2, 8, **bad)


# ---- files -----------------------------------------------------------------------------

@pytest.fixture
def safetensors():
    return pytest.importorskip("safetensors")


def _adapted():
    model = Llama(CFG, seed=0)
    lora.apply(model, rank=2)
    return model


@pytest.mark.parametrize("call", [
    lambda m: io.save_peft(_adapted(), None), lambda m: io.load_peft(None, m),
    lambda m: io.save_hf(m, None), lambda m: io.load_hf(None)])
def test_directory_none_is_named(call, safetensors):
    model = Llama(CFG, seed=0)
    before = _state(model)
    with pytest.raises(TypeError, match=r"^directory: expected a str or os.PathLike, got "
                                        r"NoneType"):
        call(model)
    _assert_unchanged(model, before)


def test_save_peft_refuses_a_base_model_name_that_is_no_str(tmp_path, safetensors):
    with pytest.raises(TypeError, match="^base_model_name_or_path: expected a str"):
        io.save_peft(_adapted(), tmp_path / "adapter", base_model_name_or_path=3)
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("text,match", [("{", "not a valid JSON file"),
                                        ("[1]", "expected a JSON object, got a JSON list")])
def test_a_broken_adapter_config_is_a_value_error_naming_the_file(tmp_path, text, match,
                                                                 safetensors):
    io.save_peft(_adapted(), tmp_path)
    (tmp_path / "adapter_config.json").write_text(text)
    model = Llama(CFG, seed=0)
    before = _state(model)
    with pytest.raises(ValueError, match=f"adapter_config.json: {match}"):
        io.load_peft(tmp_path, model)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("text,match", [("{", "not a valid JSON file"),
                                        ("[1]", "expected a JSON object, got a JSON list")])
def test_a_broken_hf_config_is_a_value_error_naming_the_file(tmp_path, text, match,
                                                            safetensors):
    io.save_hf(Llama(CFG, seed=0), tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"config.json: {match}"):
        io.load_hf(tmp_path)
