"""Bad input across the fine-tuning API (lora, io, QuantizedLinear, generate):
a clear exception naming the argument, never a crash or a silent wrong
number, and the model, its parameters and adapters, and files on disk left
as they were when a call is refused, also half way through."""
import hashlib
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from ggmlopt import lm, lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn.module import named_modules, named_parameters


def _llama(vocab=67, seed=0, **kw):
    config = {"vocab_size": vocab, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "ffn_dim": 64, "max_seq_len": 64}
    config.update(kw)
    return Llama(LlamaConfig(**config), seed=seed)


def _digest(model) -> str:
    """Every module's name and kind, every parameter's name, trainability and
    bytes, every kept weight's bytes."""
    h = hashlib.sha256()
    for name, m in named_modules(model):
        h.update(f"{name}:{type(m).__name__};".encode())
        q = getattr(m, "qweight", None)
        if q is not None:
            h.update(np.ascontiguousarray(q).tobytes())
    for name, p in named_parameters(model):
        h.update(f"{name}:{p.requires_grad}:{p.data.shape}:{p.data.dtype};".encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def _refused(exc, match, call, model):
    before = _digest(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(exc, match=match):
            call()
    assert _digest(model) == before
    assert lora.named_adapters(model) == []


TOKENS = np.arange(8, dtype=np.int32).reshape(1, 8)


# ---- lora.apply / merge -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, match", [
    ({"targets": ["q_proj", 3]}, TypeError, "^targets:"),
    ({"targets": ["q_proj", ""]}, ValueError, "^targets:"),
    ({"targets": ["zzz"]}, ValueError, "^targets:"),
    ({"targets": "q_proj("}, ValueError, "^targets:"),
    ({"rank": 0}, ValueError, "^rank:"),
    ({"rank": -2}, ValueError, "^rank:"),
    ({"rank": 2.0}, TypeError, "^rank:"),
    ({"rank": True}, TypeError, "^rank:"),
    ({"alpha": math.nan}, ValueError, "^alpha:"),
    ({"dropout": 1.0}, ValueError, "^dropout:"),
    ({"trainable": ("norm", "zzz")}, ValueError, "^trainable:"),
    ({"trainable": ("layers.0",)}, ValueError, "^trainable:"),
    ({"config": {"r": 2, "target_modules": ["q_proj"], "alpha_pattern": {"q_proj": math.nan}}},
     ValueError, "alpha_pattern"),
])
def test_a_refused_apply_leaves_the_model_as_it_was(kwargs, exc, match):
    model = _llama()
    _refused(exc, match, lambda: lora.apply(model, **kwargs), model)


def test_an_adapter_that_fails_half_way_leaves_no_adapter_and_no_frozen_weight():
    # a rank_pattern rank too big for memory on the last layer: the earlier
    # adapters were made, and used to stay in (their weights frozen) with the
    # rest of the model still training
    model = _llama()
    config = {"r": 2, "target_modules": ["q_proj", "v_proj"],
              "rank_pattern": {"model.layers.1.self_attn.v_proj": 10 ** 13}}
    _refused(MemoryError, None, lambda: lora.apply(model, config=config), model)
    assert lora.trainable_parameters(model)[0] == lora.trainable_parameters(_llama())[0]


def test_apply_failing_on_a_later_layer_gives_the_earlier_bases_back(monkeypatch):
    model = _llama()
    made = []

    class Failing(lora.LoRALinear):
        def __init__(self, *args, **kwargs):
            if len(made) == 3:
                raise MemoryError("the fourth adapter")
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(lora, "LoRALinear", Failing)
    _refused(MemoryError, "fourth", lambda: lora.apply(model, rank=2), model)
    assert len(made) == 3
    monkeypatch.undo()
    lora.apply(model, rank=2)   # and the model takes adapters afterwards
    assert len(lora.named_adapters(model)) == 8


def test_a_failed_apply_gives_a_shared_weight_back_its_training(monkeypatch):
    # two layers over one weight: the second adapter saw it frozen by the first,
    # so giving the bases back in the order they were made would leave it frozen
    import ggmlopt as go
    first, second = go.nn.Linear(4, 4), go.nn.Linear(4, 4)
    second.weight = first.weight
    model = go.nn.Sequential(first, go.nn.ReLU(), second, go.nn.ReLU(), go.nn.Linear(4, 4))
    made = []

    class Failing(lora.LoRALinear):
        def __init__(self, *args, **kwargs):
            if len(made) == 2:
                raise MemoryError("the third adapter")
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(lora, "LoRALinear", Failing)
    _refused(MemoryError, "third", lambda: lora.apply(model, rank=2, targets=("0", "2", "4")),
             model)
    assert first.weight.requires_grad and len(made) == 2


@pytest.mark.parametrize("where", ["replacing the third layer", "freezing the others"])
def test_apply_failing_after_the_adapters_are_made_puts_the_model_back(monkeypatch, where):
    # the layers already replaced go back, every flag is as it was, and a later
    # apply works
    model = _llama()
    model.layers[0].self_attn.q_proj.weight.requires_grad = False   # a flag that was not True
    replace = lora.replace_layer
    calls = []

    def failing_replace(parent, key, new):
        calls.append(key)
        if len(calls) == 3:
            raise TypeError("cannot put it there")
        replace(parent, key, new)

    def failing_freeze(*args, **kwargs):
        raise RuntimeError("cannot freeze")

    if where == "replacing the third layer":
        monkeypatch.setattr(lora, "replace_layer", failing_replace)
        _refused(TypeError, "cannot put it there", lambda: lora.apply(model, rank=2), model)
    else:
        monkeypatch.setattr(lora, "freeze_all_but_adapters", failing_freeze)
        _refused(RuntimeError, "cannot freeze", lambda: lora.apply(model, rank=2), model)
    monkeypatch.undo()
    assert len(lora.apply(model, rank=2)) == 8


def test_apply_on_an_adapted_model_and_merge_without_adapters_change_nothing():
    model = _llama()
    with pytest.raises(ValueError, match="^model: it has no LoRA adapters"):
        lora.merge(model)
    lora.apply(model, rank=2)
    before = _digest(model)
    with pytest.raises(ValueError, match="^model: it already has LoRA adapters"):
        lora.apply(model, rank=4, targets=("up_proj",))
    assert _digest(model) == before


# ---- GGUF files ---------------------------------------------------------------------------

def _gguf(tmp_path, name, dtype=np.float32, model=None):
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    model = model or _llama(vocab=257)
    path = tmp_path / name
    save_gguf(model, path, dtype=dtype, tokenizer=ByteTokenizer())
    return path


def _big_endian(path, tmp_path):
    """A big-endian copy of the GGUF file at path (gguf-py's converter)."""
    pytest.importorskip("gguf")
    out = tmp_path / ("be-" + path.name)
    out.write_bytes(path.read_bytes())
    run = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(out),
                          "big"], input="YES\n", capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.parametrize("keep_types", [False, True])
def test_a_big_endian_file_of_blocks_is_refused_not_read_as_garbage(tmp_path, keep_types):
    from ggmlopt.io import load_gguf
    path = _big_endian(_gguf(tmp_path, "q8.gguf", dtype="q8_0"), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="^path: .*big-endian"):
            load_gguf(path, keep_types=keep_types)


def test_a_big_endian_float32_file_kept_in_its_type_computes_as_the_little_endian_one(tmp_path):
    from ggmlopt.io import load_gguf
    path = _gguf(tmp_path, "f32.gguf")
    want = load_gguf(path, keep_types=True)[0].forward(TOKENS)
    model = load_gguf(_big_endian(path, tmp_path), keep_types=True)[0]
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    np.testing.assert_array_equal(model.forward(TOKENS), want)


def test_a_big_endian_bf16_adapter_is_refused_and_the_model_unchanged(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf_lora, save_gguf_lora
    adapted = _llama(vocab=257)
    lora.apply(adapted, rank=4, targets=("q_proj", "v_proj"))
    save_gguf_lora(adapted, tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(tmp_path / "f32.gguf")
    path = tmp_path / "bf16-be.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 16.0)
    for t in reader.tensors:
        values = np.array(t.data, np.float32) + 0.25
        words = (values.view(np.uint32) >> 16).astype(np.uint16)
        writer.add_tensor(t.name, words, raw_shape=values.shape,
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del reader
    model = _llama(vocab=257)
    _refused(ValueError, "^path: .*big-endian", lambda: load_gguf_lora(path, model), model)


@pytest.mark.parametrize("cut", [0, 7, 24, 1000, "half", -1])
def test_a_truncated_file_is_a_value_error_not_a_crash(tmp_path, cut):
    data = _gguf(tmp_path, "m.gguf", dtype="q8_0").read_bytes()
    cut = len(data) // 2 if cut == "half" else cut % len(data)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from ggmlopt.io import load_gguf\n"
            "try:\n"
            f"    load_gguf({str(short)!r}, keep_types=True)\n"
            "except ValueError as e:\n"
            "    assert str(e).startswith('path:'), e\n"
            "    raise SystemExit(7)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 7, run.stderr


def test_saving_over_the_file_a_kept_model_maps_leaves_it_and_the_file_sound(tmp_path):
    path = _gguf(tmp_path, "m.gguf", dtype="q8_0")
    code = ("import warnings, numpy as np; warnings.simplefilter('ignore')\n"
            "from ggmlopt.io import load_gguf, save_gguf\n"
            f"path = {str(path)!r}\n"
            "x = np.arange(8, dtype=np.int32).reshape(1, 8)\n"
            "model, tok = load_gguf(path, keep_types=True)\n"
            "want = model.forward(x).copy()\n"
            "for dtype in ('q8_0', np.float32, 'q4_0'):\n"
            "    save_gguf(model, path, tokenizer=tok, dtype=dtype)\n"
            "    assert np.array_equal(model.forward(x), want)\n"
            "assert np.array_equal(load_gguf(path, keep_types=True)[0].forward(x), want)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("dtype, where, exc", [
    ("q3_x", "m.gguf", TypeError), (np.int32, "m.gguf", TypeError),
    (np.float32, os.path.join("missing", "m.gguf"), FileNotFoundError)])
def test_a_refused_save_gguf_writes_no_file(tmp_path, dtype, where, exc):
    from ggmlopt.io import save_gguf
    from ggmlopt.text import ByteTokenizer
    with pytest.raises(exc, match="^(dtype|path):"):
        save_gguf(_llama(vocab=257), tmp_path / where, dtype=dtype, tokenizer=ByteTokenizer())
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("other, match", [
    ({"dim": 64}, "needs"), ({"ffn_dim": 96}, "needs"), ({"n_kv_heads": 4}, "needs"),
    ({"n_layers": 1}, "does not have")])
def test_an_adapter_of_another_shape_is_refused_and_the_model_unchanged(tmp_path, other, match):
    from ggmlopt.io import load_gguf_lora, save_gguf_lora
    adapted = _llama(vocab=257)
    lora.apply(adapted, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    save_gguf_lora(adapted, tmp_path / "a.gguf")
    model = _llama(vocab=257, **other)
    _refused(ValueError, match, lambda: load_gguf_lora(tmp_path / "a.gguf", model), model)


def test_an_adapter_given_as_a_model_and_a_model_as_an_adapter_are_refused(tmp_path):
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf_lora
    adapted = _llama(vocab=257)
    lora.apply(adapted, rank=4)
    save_gguf_lora(adapted, tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="^path: .*LoRA adapter"):
        load_gguf(tmp_path / "a.gguf")
    model = _llama(vocab=257)
    path = _gguf(tmp_path, "m.gguf")
    _refused(ValueError, "^path: .*model file", lambda: load_gguf_lora(path, model), model)


@pytest.mark.parametrize("change, match", [({"r": 8}, "rank 4, the config says 8"),
                                           ({"rank_pattern": {"down_proj": 2}}, "rank"),
                                           ({"lora_alpha": math.nan}, "lora_alpha")])
def test_a_peft_config_that_disagrees_with_its_tensors_is_refused(tmp_path, change, match):
    pytest.importorskip("safetensors")
    import json

    from ggmlopt.io import load_peft, save_peft
    adapted = _llama()
    lora.apply(adapted, rank=4, targets=("q_proj", "down_proj"))
    save_peft(adapted, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config.update(change)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    model = _llama()
    _refused(ValueError, match, lambda: load_peft(tmp_path / "a", model), model)


# ---- QuantizedLinear ----------------------------------------------------------------------

def test_quantized_linear_refuses_words_of_the_other_byte_order():
    from ggmlopt.nn import QuantizedLinear
    w = np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32)
    with pytest.raises(ValueError, match="^qweight: expected the native byte order"):
        QuantizedLinear(w.astype(">f4"), "F32", 32, 4)
    with pytest.raises(ValueError, match="^qweight: expected the native byte order"):
        QuantizedLinear(w.astype(">f2"), "F16", 32, 4)
    layer = QuantizedLinear(w, "F32", 32, 4)   # the native words as they are
    np.testing.assert_allclose(layer.forward(np.ones((1, 32), np.float32))[0], w.sum(1),
                               rtol=1e-5)


@pytest.mark.parametrize("args, exc, match", [
    (("Q3_X", 64, 48), ValueError, "^qtype:"), ((8, 64, 48), TypeError, "^qtype:"),
    (("Q8_0", 48, 64), ValueError, "^in_features:"), (("Q4_K", 64, 48), ValueError,
                                                      "^in_features:"),
    (("Q8_0", 64, 47), ValueError, "^qweight:"), (("Q8_0", 64.0, 48), TypeError,
                                                  "^in_features:")])
def test_quantized_linear_refuses_a_wrong_block_size_type_or_shape(args, exc, match):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.nn import QuantizedLinear
    w = np.random.default_rng(0).normal(size=(48, 64)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(exc, match=match):
        QuantizedLinear(q, *args)


# ---- generation ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, kwargs, exc, match", [
    ([1, 67], {}, IndexError, "^prompt_ids:"), ([], {}, ValueError, "^prompt_ids:"),
    ([-1, 2], {}, ValueError, "^prompt_ids:"), ([1], {"temperature": math.nan}, ValueError,
                                                "^temperature:"),
    ([1], {"repetition_penalty": 0.0}, ValueError, "^repetition_penalty:"),
    ([1], {"top_p": 0.0}, ValueError, "^top_p:"), ([1], {"min_p": -1.0}, ValueError,
                                                    "^min_p:"),
    ([1], {"top_k": 0}, ValueError, "^top_k:")])
def test_generate_refuses_bad_sampling_and_prompts_leaving_the_model(prompt, kwargs, exc, match):
    model = _llama()
    model.train()
    _refused(exc, match, lambda: lm.generate(model, prompt, 2, **kwargs), model)
    assert model.training
