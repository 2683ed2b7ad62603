"""Phi-3: a Llama whose q, k, v projections are one matrix (qkv_proj) and whose
gate and up projections are one (gate_up_proj), optionally over a sliding
window.  Logits and every gradient equal transformers' Phi3ForCausalLM (eager
attention), the checkpoints go both ways, generation with the cache equals a
full recompute, LoRA adapts the fused projections, and what is not implemented
is refused."""
import json

import numpy as np
import pytest
from hf_oracle import assert_cache_equals_recompute, assert_equals_transformers, randomised

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig, Phi3, Phi3Config

CONFIGS = {
    "gqa-window-6": Phi3Config(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=48, max_seq_len=256, sliding_window=6),
    "no-window": Phi3Config(vocab_size=67, dim=32, n_layers=1, n_heads=2, ffn_dim=40,
                            max_seq_len=256),
}



def test_phi3_fuses_the_projections():
    model = Phi3(CONFIGS["gqa-window-6"], seed=0)
    params = dict(model.named_parameters())
    assert params["layers.0.self_attn.qkv_proj.weight"].shape == (32, 32 + 2 * 16)
    assert params["layers.0.mlp.gate_up_proj.weight"].shape == (32, 96)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in params)
    assert isinstance(model, Llama)
    with pytest.raises(TypeError, match="Phi3Config"):
        Phi3(LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2))


def fused_equals_llama(model):
    """A Llama with the Phi-3's weights split into q/k/v and gate/up."""
    cfg = model.config
    twin = Llama(LlamaConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                             n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_dim=cfg.ffn_dim,
                             max_seq_len=cfg.max_seq_len, norm_eps=cfg.norm_eps,
                             rope_base=cfg.rope_base))
    src = dict(model.named_parameters())
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    for name, p in twin.named_parameters():
        if ".self_attn." in name and name.split(".")[3] in ("q_proj", "k_proj", "v_proj"):
            w = src[name.rsplit(".", 2)[0] + ".qkv_proj.weight"].data
            part = {"q_proj": w[:, :q], "k_proj": w[:, q:q + kv], "v_proj": w[:, q + kv:]}
            p.data[...] = part[name.split(".")[3]]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = src[name.rsplit(".", 2)[0] + ".gate_up_proj.weight"].data
            p.data[...] = w[:, :f] if "gate" in name else w[:, f:]
        else:
            p.data[...] = src[name].data
    return twin


def test_without_a_window_it_computes_the_llama_of_its_split_weights():
    model = randomised(Phi3(CONFIGS["no-window"], seed=3), 3)
    tokens = np.random.default_rng(1).integers(0, 67, (2, 9))
    want = fused_equals_llama(model)(tokens)
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_logits_and_gradients_equal_transformers(tmp_path, kind, T):
    from ggmlopt.io import load_hf
    model = randomised(Phi3(CONFIGS[kind], seed=1), T)
    hf = assert_equals_transformers(model, "Phi3ForCausalLM", tmp_path, T, eager=True)
    assert hf.config.sliding_window == model.config.sliding_window
    back = load_hf(tmp_path)
    assert type(back) is Phi3 and back.config == model.config


def test_load_hf_reads_what_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=67, hidden_size=32, intermediate_size=40,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64,
                                  original_max_position_embeddings=64, sliding_window=9,
                                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf = transformers.Phi3ForCausalLM(cfg)
    hf.config._attn_implementation = "eager"
    hf.eval()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, Phi3) and model.config.sliding_window == 9
    tokens = np.random.default_rng(0).integers(0, 67, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(model(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_generation_with_the_cache_equals_a_full_recompute():
    model = randomised(Phi3(CONFIGS["gqa-window-6"], seed=2), 2)
    assert_cache_equals_recompute(model, [3, 14, 15, 9, 2, 6, 5], 8)


def test_lora_adapts_the_fused_projections_and_checkpointing_keeps_the_bits():
    import copy
    plain = randomised(Phi3(CONFIGS["gqa-window-6"], seed=4), 4)
    lora.apply(plain, rank=2, targets="all-linear", seed=1)
    names = {n for n, _ in lora.named_adapters(plain)}
    assert "layers.0.self_attn.qkv_proj" in names and "layers.1.mlp.gate_up_proj" in names
    for _, layer in lora.named_adapters(plain):
        layer.lora_b.data[...] = 0.01
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    trained = []
    for model in (plain, checkpointed):
        ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32, seed=1)
        rng = np.random.default_rng(0)
        for _ in range(3):
            tokens = rng.integers(0, 67, (2, 13)).astype(np.int32)
            ctx.alloc(True)
            ctx.eval(None, inputs=tokens[:, :-1].copy(), labels=tokens[:, 1:].copy())
        trained.append({n: p.data.copy() for n, p in model.named_parameters()})
    assert not np.all(trained[0]["layers.0.self_attn.qkv_proj.lora_b"] == 0.01)
    for n in trained[0]:
        np.testing.assert_array_equal(trained[0][n], trained[1][n], err_msg=n)


def test_what_is_not_implemented_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    model = Phi3(Phi3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2), seed=0)
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit, match in [({"partial_rotary_factor": 0.1}, "rotates 0 features"),
                        # transformers reads a Phi-3's "yarn" as LongRoPE, refuses "linear"
                        ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
                         r"'longrope' scaling needs \['long_factor', 'short_factor'\]"),
                        ({"rope_scaling": {"type": "linear", "factor": 2.0}},
                         "with LongRoPE only"),
                        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3,
                                           "long_factor": [1.0] * 3}},
                         "3 LongRoPE factors for head_dim 8"),
                        # both dicts: transformers reads rope_scaling and the top level
                        ({"rope_parameters": {"rope_type": "default",
                                              "partial_rotary_factor": 0.5},
                          "rope_scaling": {"rope_type": "default"}},
                         r"top-level partial_rotary_factor \(1.0\), not rope_parameters' 0.5")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=match):
            load_hf(tmp_path)
    # what published Phi-3 configs carry and transformers' Phi3 reads nowhere: loaded
    real = {"auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                         "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
            "attention_bias": False}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **real}))
    tokens = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(load_hf(tmp_path)(tokens), model(tokens))



def test_a_gguf_round_trip_keeps_the_fused_weights_and_the_window(tmp_path):
    """llama.cpp's phi3 layout (attn_qkv, ffn_up = gate | up, no q/k permutation),
    read back bit for bit, the window in phi3.attention.sliding_window (which
    llama.cpp ignores: saving warns when it is active)."""
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.text import ByteTokenizer
    for window in (None, 6):
        model = Phi3(Phi3Config(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=40, max_seq_len=64, sliding_window=window,
                                original_max_seq_len=32), seed=2)
        path = tmp_path / f"phi3-{window}.gguf"
        if window is None:
            save_gguf(model, path, tokenizer=ByteTokenizer())
        else:
            with pytest.warns(UserWarning, match="llama.cpp's phi3 ignores the sliding window"):
                save_gguf(model, path, tokenizer=ByteTokenizer())
        f = GgufFile(str(path))
        assert f.fields["general.architecture"] == "phi3"
        # 0 without a window, as llama.cpp's converter writes it
        assert f.fields["phi3.attention.sliding_window"] == (window or 0)
        assert "blk.0.attn_qkv.weight" in f.tensors and "blk.1.ffn_up.weight" in f.tensors
        assert "blk.0.attn_q.weight" not in f.tensors
        back, _ = load_gguf(path)
        assert isinstance(back, Phi3) and back.config == model.config
        for (name, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
            np.testing.assert_array_equal(p.data, q.data, err_msg=name)


def _longrope_checkpoint(directory, rope_type="longrope", partial=1.0):
    """A transformers Phi-3 with LongRoPE (the 128k and 3.5 models' scaling) over a
    pretraining length of 16 of its 64 positions (rope_type None: none), heads of
    8 features of which partial rotate, weights scaled up so greedy decoding is
    decided."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    half = int(8 * partial) // 2
    scaling = None if rope_type is None else {
        "type": rope_type, "short_factor": list(1 + rng.random(half)),
        "long_factor": list(2 + 3 * rng.random(half))}
    hc = transformers.Phi3Config(
        vocab_size=67, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        original_max_position_embeddings=16, rope_scaling=scaling, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, sliding_window=None, partial_rotary_factor=partial)
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("rope_type, partial", [("longrope", 1.0), ("su", 1.0),
                                               ("longrope", 0.75), (None, 0.5)])
def test_longrope_equals_transformers_within_and_past_the_pretraining_length(tmp_path,
                                                                             rope_type,
                                                                             partial):
    # a pass whose positions stay within original_max_position_embeddings rotates by
    # the short factors, a longer one by the long factors, every position of it; a
    # partial_rotary_factor rotates the first features of each head (Phi-4-mini's)
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf, save_hf
    hf = _longrope_checkpoint(tmp_path / "hf", rope_type, partial)
    model = load_hf(tmp_path / "hf")
    assert (model.config.rope_scaling is None) == (rope_type is None)
    assert model.config.rotary_dim == int(8 * partial)
    rng = np.random.default_rng(1)
    for T in (12, 16, 17, 40):
        tokens = rng.integers(0, 67, (2, T))
        logits = hf(torch.tensor(tokens)).logits
        want = logits.detach().numpy()
        np.testing.assert_allclose(model.forward(tokens), want, rtol=0,
                                   atol=1e-4 * np.abs(want).max(), err_msg=str(T))
        g = rng.normal(size=want.shape).astype(np.float32)
        hf.zero_grad()
        (logits * torch.tensor(g)).sum().backward()
        model.zero_grad()
        model.backward(g)
        theirs = hf.model.layers[0].self_attn.qkv_proj.weight.grad.numpy().T
        ours = dict(model.named_parameters())["layers.0.self_attn.qkv_proj.weight"].grad
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
    # and back: transformers reads save_hf's config as the same model
    save_hf(model, tmp_path / "back")
    import transformers
    again = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = rng.integers(0, 67, (1, 40))
    np.testing.assert_allclose(again(torch.tensor(tokens)).logits.detach().numpy(),
                               model.forward(tokens), rtol=0, atol=1e-5 * 40)


@pytest.mark.parametrize("partial, chunk", [(1.0, 256), (0.75, 5)])
def test_longrope_generation_recomputes_its_cache_where_transformers_does(tmp_path, partial,
                                                                          chunk, monkeypatch):
    # transformers' Phi-3 generate drops its cache at the step that goes past the
    # pretraining length and recomputes it with the long factors (ggmlopt: a chunk
    # at a time, every chunk with the long factors)
    torch = pytest.importorskip("torch")
    from ggmlopt import lm
    from ggmlopt.io import load_hf
    monkeypatch.setattr(lm, "_RECOMPUTE_CHUNK", chunk)
    hf = _longrope_checkpoint(tmp_path, partial=partial)
    model = load_hf(tmp_path)
    assert model.recompute_cache_at == 16
    rng = np.random.default_rng(2)
    for n in (10, 16, 20):   # crossing while generating, at the prompt's end, before it
        prompt = rng.integers(3, 67, n)
        want = hf.generate(torch.tensor(prompt[None]), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0).numpy()[0, n:]
        got = go.generate(model, prompt, 16, temperature=0, stop_ids=())
        assert np.asarray(got).tolist() == want.tolist(), n


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_packed_documents_rotate_as_each_alone(partial):
    # a packed window longer than the pretraining length: each document by its own
    # length (the short factors for the short ones, the long for the one past 16),
    # as it alone is rotated; padding (a document of its own) moves no other
    from ggmlopt.nn import RopeScaling
    from ggmlopt.nn.positions import mark_document_starts
    half = int(8 * partial) // 2
    scaling = RopeScaling("longrope", original_max_position_embeddings=16,
                          short_factor=(1.5, 1.2, 1.1, 1.05)[:half],
                          long_factor=(4.0, 3.0, 2.5, 2.2)[:half])
    model = Phi3(Phi3Config(vocab_size=67, dim=16, n_layers=1, n_heads=2, ffn_dim=24,
                            max_seq_len=64, rope_scaling=scaling, original_max_seq_len=16,
                            partial_rotary_factor=partial), seed=0)
    docs = [np.arange(3, 15), np.arange(20, 40), np.arange(40, 50)]
    starts = np.zeros((1, 42), bool)
    starts[0, [0, 12, 32]] = True
    packed = mark_document_starts(np.concatenate(docs)[None], starts)
    out = model.forward(packed)
    at = 0
    for d in docs:
        np.testing.assert_allclose(out[0, at:at + d.size], model.forward(d[None])[0],
                                   rtol=0, atol=1e-5)
        at += d.size


def test_longrope_goes_to_gguf_as_llama_cpp_reads_it(tmp_path):
    # rope_factors_long/short and phi3.rope.scaling.attn_factor, as llama.cpp's
    # converter writes a Phi-3.5 (the logits against llama.cpp: tests/llamacpp)
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.nn import RopeScaling
    from ggmlopt.text import ByteTokenizer
    scaling = RopeScaling("longrope", 4.0, original_max_position_embeddings=16,
                          short_factor=(1.5, 1.25, 1.125), long_factor=(4.0, 3.0, 2.5))
    model = Phi3(Phi3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                            original_max_seq_len=16, rope_scaling=scaling,
                            partial_rotary_factor=0.75), seed=0)
    with pytest.warns(UserWarning, match="llama.cpp takes LongRoPE's long factors"):
        save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    f = GgufFile(str(tmp_path / "m.gguf"))
    assert f.fields["phi3.rope.scaling.attn_factor"] == pytest.approx(
        np.sqrt(1 + np.log(4) / np.log(16)), rel=1e-7)
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(f.tensors)
    assert f.fields["phi3.rope.dimension_count"] == 6   # 0.75 of the head's 8 rotate
    back, _ = load_gguf(tmp_path / "m.gguf")
    assert back.config.partial_rotary_factor == 0.75
    tokens = np.random.default_rng(0).integers(0, 257, (1, 40))
    for T in (12, 40):
        np.testing.assert_array_equal(back(tokens[:, :T]), model(tokens[:, :T]))
    load_gguf(tmp_path / "m.gguf", model)   # the same model: nothing differs
    # into a model that rotates the whole head: refused naming the rotary share (the
    # message said the two rope_scaling, which were equal)
    four = RopeScaling("longrope", 4.0, original_max_position_embeddings=16,
                       short_factor=(1.5, 1.25, 1.125, 1.0), long_factor=(4.0, 3.0, 2.5, 2.0))
    whole = Phi3(Phi3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                            original_max_seq_len=16, rope_scaling=four,
                            partial_rotary_factor=1.0), seed=0)
    with pytest.raises(ValueError, match=r"a head rotates 3 pairs \(the model's: 4; "
                                         "partial_rotary_factor"):
        load_gguf(tmp_path / "m.gguf", whole)
    # a switch length other than the config's (where transformers switches) is refused
    with pytest.raises(ValueError, match="original_max_position_embeddings 16 is not "
                                         "original_max_seq_len 32"):
        Phi3Config(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                   original_max_seq_len=32, rope_scaling=scaling, partial_rotary_factor=0.75)
    # a share of the head that is no whole number of features reads back as the one
    # it rotates, and loads into its model
    odd = Phi3(Phi3Config(vocab_size=257, dim=32, n_layers=1, n_heads=2,
                          partial_rotary_factor=0.4), seed=0)
    save_gguf(odd, tmp_path / "odd.gguf", tokenizer=ByteTokenizer())
    assert load_gguf(tmp_path / "odd.gguf")[0].config.rotary_dim == odd.config.rotary_dim == 6
    load_gguf(tmp_path / "odd.gguf", odd)


def test_the_switch_length_is_the_configs_as_transformers_reads_it(tmp_path):
    # transformers' standardize_rope_params puts the top-level
    # original_max_position_embeddings into the rope parameters, whatever they said
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf, save_hf
    save_hf(Phi3(Phi3Config(vocab_size=67, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                            original_max_seq_len=32), seed=0), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 4,
                           "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_hf(tmp_path)
    assert model.config.rope_scaling.original_max_position_embeddings == 32
    assert model.recompute_cache_at == 32


def test_decoding_past_the_switch_grows_the_long_table_once():
    from ggmlopt.nn import RopeScaling
    from ggmlopt.nn.attention import RotaryEmbedding
    rope = RotaryEmbedding(8, 10000.0, RopeScaling("longrope", original_max_position_embeddings=16,
                                                   short_factor=(1.0,) * 4,
                                                   long_factor=(2.0,) * 4))
    first = rope.tables(17)[0]
    assert all(rope.tables(n)[0] is first for n in range(18, first.shape[0] + 1))
    assert rope.tables(10)[0] is not first   # within the original length: the short table