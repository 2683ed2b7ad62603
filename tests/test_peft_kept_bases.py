"""PEFT adapters over bases kept in their file's types (QLoRA), and the adapter
files PEFT writes around a bfloat16 fine-tune: save_peft and load_peft work on
them as on float32 models, and give PEFT's logits."""
import json

import numpy as np
import pytest

from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn.quantized import is_quantized

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V = 67
TOKENS = np.random.default_rng(3).integers(0, V, (2, 12))


def _bf16_checkpoint(directory, tied):
    """A small llama checkpoint stored in bfloat16, as most published ones are."""
    from ggmlopt.io import save_hf
    model = Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64, tie_embeddings=tied), seed=0)
    save_hf(model, directory / "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory / "f32")
    hf.to(torch.bfloat16).save_pretrained(directory / "base")
    return directory / "base"


def _randomise(named_parameters, seed):
    rng = np.random.default_rng(seed)
    for _, p in named_parameters:
        if p.requires_grad:
            p.data[...] = rng.normal(size=p.shape) * 0.2


def _peft_logits(base, adapter):
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    return model(torch.tensor(TOKENS)).logits.detach().numpy()


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_a_tied_kept_base_saves_and_loads_its_adapters(tmp_path):
    from ggmlopt.io import load_hf, load_peft, save_peft
    base = _bf16_checkpoint(tmp_path, tied=True)
    model = load_hf(base, keep_types=True)
    assert is_quantized(model.embed_tokens)   # the embedding is the tied head, in bf16
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "embed_tokens"), seed=1)
    _randomise(model.named_parameters(), 2)
    save_peft(model, tmp_path / "adapter")
    _close(model.forward(TOKENS), _peft_logits(base, tmp_path / "adapter"))
    again = load_hf(base, keep_types=True)
    load_peft(tmp_path / "adapter", again)
    np.testing.assert_array_equal(again.forward(TOKENS), model.forward(TOKENS))


def _peft_embedding_adapter(tmp_path, base):
    """PEFT's adapter on q_proj and embed_tokens, saved as save_pretrained does by
    default: with the embedding's base weight (embed_tokens.base_layer.weight)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "embed_tokens"]))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(tmp_path / "adapter")
    st = pytest.importorskip("safetensors.numpy")
    names = st.load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any(n.endswith("embed_tokens.base_layer.weight") for n in names)
    return tmp_path / "adapter"


def test_peft_s_embedding_adapter_loads_onto_a_kept_base(tmp_path):
    from ggmlopt.io import load_hf, load_peft
    base = _bf16_checkpoint(tmp_path, tied=False)
    adapter = _peft_embedding_adapter(tmp_path, base)
    want = _peft_logits(base, adapter)
    for keep_types in (False, True):
        model = load_hf(base, keep_types=keep_types)
        load_peft(adapter, model)
        _close(model.forward(TOKENS), want)


def _with_base_row(adapter, row, change):
    """Rewrite the adapter file's embedding base with change(rows) applied to one
    row; returns the file's tensors as PEFT saved them."""
    st = pytest.importorskip("safetensors.numpy")
    path = adapter / "adapter_model.safetensors"
    tensors = st.load_file(str(path))
    name = next(n for n in tensors if n.endswith("embed_tokens.base_layer.weight"))
    rows = tensors[name].copy()
    rows[row] = change(rows[row])
    st.save_file({**tensors, name: rows}, str(path))
    return tensors


def test_an_embedding_adapter_over_another_base_is_refused_on_a_kept_one(tmp_path):
    from ggmlopt.io import load_hf, load_peft
    base = _bf16_checkpoint(tmp_path, tied=False)
    adapter = _peft_embedding_adapter(tmp_path, base)
    # a row of another base
    _with_base_row(adapter, 5, lambda r: np.random.default_rng(9).normal(size=r.shape))
    model = load_hf(base, keep_types=True)
    before = model.forward(TOKENS).copy()
    with pytest.raises(ValueError, match="row 5 is not the model's.*another base"):
        load_peft(adapter, model)
    assert not lora.named_adapters(model)
    np.testing.assert_array_equal(model.forward(TOKENS), before)


def test_a_base_that_differs_by_more_than_rounding_is_said_on_a_kept_one(tmp_path):
    # the file's base rounded to bf16 is not the kept one (another revision of
    # the model): the model keeps its own, and says so
    st = pytest.importorskip("safetensors.numpy")
    from ggmlopt.io import load_hf, load_peft
    base = _bf16_checkpoint(tmp_path, tied=False)
    adapter = _peft_embedding_adapter(tmp_path, base)
    tensors = _with_base_row(adapter, 7, lambda r: r * 1.1)
    path = adapter / "adapter_model.safetensors"
    with pytest.warns(UserWarning, match="differs from the model's .kept as BF16. by up to 9"):
        load_peft(adapter, load_hf(base, keep_types=True))
    import warnings
    st.save_file(tensors, str(path))   # the base as PEFT saved it: bf16's own values
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_peft(adapter, load_hf(base, keep_types=True))


def test_a_module_trained_whole_is_refused_on_a_kept_base_by_name(tmp_path):
    from ggmlopt.io import load_hf, load_peft, save_peft
    base = _bf16_checkpoint(tmp_path, tied=False)
    model = load_hf(base)
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj",), trainable=("lm_head",), seed=1)
    save_peft(model, tmp_path / "adapter")
    with pytest.raises(ValueError, match="trains lm_head whole.*keep_types=False"):
        load_peft(tmp_path / "adapter", load_hf(base, keep_types=True))


def test_bfloat16_modules_in_peft_s_file_are_widened(tmp_path):
    # a bf16 fine-tune: PEFT keeps its adapters in float32 but modules_to_save in
    # the base's bfloat16
    from ggmlopt.io import load_hf, load_peft
    base = _bf16_checkpoint(tmp_path, tied=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                    modules_to_save=["lm_head"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors import safe_open
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32", "BF16"}  # noqa: SIM118
    ours = load_hf(base)
    load_peft(tmp_path / "adapter", ours)
    _close(ours.forward(TOKENS), _peft_logits(base, tmp_path / "adapter"))


def test_an_embedding_adapter_beside_dropout_saves(tmp_path):
    # PEFT's embedding adapters have no dropout: the file's lora_dropout is the
    # Linear adapters'
    from ggmlopt.io import save_peft
    model = Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64), seed=0)
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "embed_tokens"), dropout=0.1, seed=1)
    save_peft(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["lora_dropout"] == pytest.approx(0.1)


def test_a_mica_adapter_trains_a_alone_as_in_peft(tmp_path):
    # PEFT's MiCA freezes B and trains A; the file keeps saying so
    import ggmlopt as go
    from ggmlopt.io import load_peft, save_peft
    model = Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=48, max_seq_len=64), seed=0)
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj"), seed=1)
    _randomise(model.named_parameters(), 2)
    save_peft(model, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    assert config["init_lora_weights"] is True
    path.write_text(json.dumps({**config, "init_lora_weights": "mica"}))
    again = Llama(model.config, seed=0)
    adapters = load_peft(tmp_path / "adapter", again)
    assert all(a.lora_a.requires_grad and not a.lora_b.requires_grad for _, a in adapters)
    b_before = [a.lora_b.data.copy() for _, a in adapters]
    a_before = [a.lora_a.data.copy() for _, a in adapters]
    ctx = go.OptContext(again, loss_type="cross_entropy", inputs_dtype=np.int32)
    ctx.alloc(True)
    ctx.eval(None, inputs=TOKENS[:1].astype(np.int32),
             labels=np.roll(TOKENS[:1], -1, axis=1).astype(np.int32))
    for (_, a), b0, a0 in zip(adapters, b_before, a_before):
        np.testing.assert_array_equal(a.lora_b.data, b0)
        assert not np.array_equal(a.lora_a.data, a0)
    save_peft(again, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())[
        "init_lora_weights"] == "mica"
