"""Generation audited against transformers' generate: the distribution each
sampling option leaves equals transformers' logits warpers applied in
generate's order; greedy decoding with the KV cache (a prompt longer than one
prefill chunk, sliding windows across chunks, LoRA over a base kept in a GGUF
block type) equals the full forward's argmax and transformers' greedy; the
stops are generation_config's (the stop token returned, as transformers
returns it); a prompt and reply past the context are refused; chat's prompt
ids are transformers' apply_chat_template(tokenize=True) ids (with llama.cpp's
one BOS where the vocabulary adds it and the template writes none)."""
import json
import os
import warnings

import numpy as np
import pytest
from hf_oracle import randomised
from test_lm_generate import Scripted

import ggmlopt as go
from ggmlopt import lm, lora
from ggmlopt.models import (
    Gemma3,
    Gemma3Config,
    Llama,
    LlamaConfig,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
    Qwen3,
    Qwen3Config,
)

# float32's rounding of a probability (transformers' softmax is float32, ggmlopt's
# float64), a few roundings deep (the division, the exponential, the sum)
PROB_TOL = 8 * float(np.finfo(np.float32).eps)


class _Taken:
    """A generator whose draw is always the index `at` (and which keeps p)."""

    def __init__(self, at=0):
        self.at = at

    def choice(self, n, p):
        self.p = np.asarray(p)
        return self.at


def _ours(logits, temperature, top_k, top_p, min_p, seen=(), penalty=None):
    """The distribution over ids that lm._pick draws from, as a (vocab,) array."""
    z = lm._penalized(logits, set(seen), penalty)
    first = _Taken()
    lm._pick(z, temperature, top_k, top_p, first, min_p)
    out = np.zeros(logits.size)
    for j, pj in enumerate(first.p):
        out[lm._pick(z, temperature, top_k, top_p, _Taken(j), min_p)] += pj
    return out


def _theirs(logits, temperature, top_k, top_p, min_p, seen=(), penalty=None):
    """softmax of the logits after transformers' processors, in generate's order."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    procs = lp.LogitsProcessorList()
    if penalty is not None:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(penalty))
    procs.append(lp.TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p is not None:
        procs.append(lp.TopPLogitsWarper(top_p))
    if min_p is not None:
        procs.append(lp.MinPLogitsWarper(min_p))
    ids = torch.tensor([list(seen) or [0]])
    scores = procs(ids, torch.tensor(logits)[None].clone())
    return torch.softmax(scores, -1)[0].double().numpy()


def _random_case(rng, ties):
    n = int(rng.integers(2, 60))
    logits = (rng.standard_normal(n) * rng.uniform(0.5, 5)).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)
    temperature = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
    top_k = None if ties or rng.random() < 0.4 else int(rng.integers(1, n + 3))
    top_p = None if rng.random() < 0.4 else float(rng.uniform(0.05, 1))
    min_p = None if rng.random() < 0.5 else float(rng.uniform(0, 1))
    seen = tuple(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist()) \
        if rng.random() < 0.5 else ()
    penalty = float(rng.choice([1.3, 0.8])) if seen else None
    return logits, (temperature, top_k, top_p, min_p, seen, penalty)


def test_the_sampled_distribution_is_transformers_warpers():
    """Every id transformers keeps and no other, each with its probability
    (logits without ties)."""
    rng = np.random.default_rng(0)
    for case in range(400):
        logits, args = _random_case(rng, ties=False)
        ours, theirs = _ours(logits, *args), _theirs(logits, *args)
        np.testing.assert_array_equal(ours > 0, theirs > 0, err_msg=f"case {case}: {args}")
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=PROB_TOL,
                                   err_msg=f"case {case}: {args}")


@pytest.mark.parametrize("logits, top_p, min_p, kept", [
    # probabilities 1/4 each, exact: the ids until the mass reaches top_p, not one more
    ([0, 0, 0, 0], 0.25, None, 1), ([0, 0, 0, 0], 0.5, None, 2), ([0, 0, 0, 0], 0.75, None, 3),
    # min_p 1: every id as likely as the likeliest, ties included
    ([3, 3, 1], None, 1.0, 2), ([0, 0, 0, 0], None, 1.0, 4), ([3, 3, 1, 3], 0.5, 1.0, 2)])
def test_the_top_p_and_min_p_boundaries_are_transformers(logits, top_p, min_p, kept):
    logits = np.array(logits, np.float32)
    ours, theirs = _ours(logits, 1.0, None, top_p, min_p), _theirs(logits, 1.0, None, top_p,
                                                                   min_p)
    assert np.count_nonzero(ours) == np.count_nonzero(theirs) == kept
    np.testing.assert_allclose(np.sort(ours), np.sort(theirs), rtol=0, atol=PROB_TOL)


def test_ties_at_a_top_p_or_min_p_cut_keep_transformers_mass_per_value():
    """Equal logits at the top_p cut: as many of them are kept as transformers
    keeps (the same probability for each value of the logits), the first ones
    in index order (transformers' sort keeps the last ones)."""
    rng = np.random.default_rng(1)
    for case in range(300):
        logits, args = _random_case(rng, ties=True)
        ours, theirs = _ours(logits, *args), _theirs(logits, *args)
        penalized = lm._penalized(logits, set(args[4]), args[5])
        for v in np.unique(penalized):
            at = penalized == v
            assert abs(ours[at].sum() - theirs[at].sum()) <= PROB_TOL, (case, args, v)
            kept = np.flatnonzero(at & (ours > 0))
            np.testing.assert_array_equal(kept, np.flatnonzero(at)[:kept.size])


def _hf_checkpoint(model, directory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from ggmlopt.io import save_hf
    save_hf(model, directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                             attn_implementation="eager")


def _hf_greedy(hf, prompt, n, **kw):
    """transformers' greedy ids after prompt (every prompt position attended: without
    an attention mask generate masks the ids equal to pad_token_id)."""
    import torch
    x = torch.tensor(np.asarray(prompt)[None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, pad_token_id=0, **kw)
    return out[0, x.shape[1]:].numpy()


V = 97
GREEDY = {
    "llama": lambda: Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                       ffn_dim=48, max_seq_len=400), seed=1),
    # windows that reach back across a prefill chunk of 16 (and of 256 below)
    "mistral": lambda: Mistral(MistralConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                             n_kv_heads=1, ffn_dim=48, max_seq_len=400,
                                             sliding_window=23), seed=1),
    "gemma3": lambda: Gemma3(Gemma3Config(vocab_size=V, dim=32, n_layers=3, n_heads=4,
                                          n_kv_heads=2, head_dim=12, ffn_dim=48,
                                          max_seq_len=400, query_pre_attn_scalar=20.0,
                                          sliding_window=21), seed=1),
}


@pytest.mark.parametrize("chunk", [16, lm._RECOMPUTE_CHUNK])
@pytest.mark.parametrize("arch", list(GREEDY))
def test_greedy_over_a_prompt_of_several_chunks_is_transformers(tmp_path, monkeypatch, arch,
                                                                 chunk):
    monkeypatch.setattr(lm, "_RECOMPUTE_CHUNK", chunk)
    model = randomised(GREEDY[arch](), 2)
    hf = _hf_checkpoint(model, tmp_path)
    prompt = np.random.default_rng(5).integers(0, V, chunk + 45)
    ours = go.generate(model, prompt, 12, temperature=0, stop_ids=())
    np.testing.assert_array_equal(ours, _hf_greedy(hf, prompt, 12, eos_token_id=None))


@pytest.mark.parametrize("penalty", [0.7, 1.5])
def test_greedy_with_a_repetition_penalty_is_transformers(tmp_path, penalty):
    model = randomised(GREEDY["llama"](), 2)
    hf = _hf_checkpoint(model, tmp_path)
    prompt = np.random.default_rng(5).integers(0, V, 20)
    ours = go.generate(model, prompt, 24, temperature=0, repetition_penalty=penalty,
                       stop_ids=())
    np.testing.assert_array_equal(ours, _hf_greedy(hf, prompt, 24, eos_token_id=None,
                                                   repetition_penalty=penalty))


@pytest.mark.parametrize("generation_config", [None, {"bos_token_id": 1},
                                               {"eos_token_id": "list"}])
def test_a_checkpoint_stops_where_transformers_generate_stops(tmp_path, generation_config):
    """No generation_config.json: config.json's eos; one without eos_token_id: no
    stop at all; its list: any of them.  The stop id is the reply's last."""
    from ggmlopt.io import load_hf
    model = randomised(Llama(LlamaConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2,
                                         max_seq_len=64), seed=0), 1)
    prompt = np.array([3, 4, 5])
    free = go.generate(model, prompt, 10, temperature=0, stop_ids=())
    _hf_checkpoint(model, tmp_path)
    stop = int(free[3])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    if generation_config is not None:
        if generation_config.get("eos_token_id") == "list":
            generation_config = {"eos_token_id": [7, stop]}
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    want = _hf_greedy(hf, prompt, 10)
    got = go.generate(load_hf(tmp_path), prompt, 10, temperature=0)
    np.testing.assert_array_equal(got, want)
    if generation_config == {"bos_token_id": 1}:
        assert got.size == 10
    else:
        assert got[-1] == stop and stop not in got[:-1]


def _full_greedy(model, prompt, n):
    seq = np.asarray(prompt)[None]
    for _ in range(n):
        seq = np.concatenate([seq, [[int(np.argmax(model(seq)[0, -1]))]]], axis=1)
    return seq[0, len(prompt):]


KEPT = {
    # q/k norms; Phi-3's fused q|k|v and gate|up under adapters, a window; Gemma 3's
    # own blocks (layer by layer), windows across chunks
    "qwen3": lambda v: Qwen3(Qwen3Config(vocab_size=v, dim=64, n_layers=2, n_heads=4,
                                         n_kv_heads=2, head_dim=16, ffn_dim=96,
                                         max_seq_len=128), seed=1),
    "phi3": lambda v: Phi3(Phi3Config(vocab_size=v, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      ffn_dim=96, max_seq_len=128, sliding_window=19), seed=1),
    "gemma3": lambda v: Gemma3(Gemma3Config(vocab_size=v, dim=64, n_layers=3, n_heads=4,
                                            n_kv_heads=2, head_dim=16, ffn_dim=96,
                                            max_seq_len=128, sliding_window=21,
                                            query_pre_attn_scalar=16.0), seed=1),
}


@pytest.mark.parametrize("arch", list(KEPT))
def test_greedy_over_lora_on_a_quantized_base_is_the_full_forward_s_argmax(tmp_path,
                                                                           monkeypatch, arch):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.nn.quantized import QuantizedLinear
    from ggmlopt.text import ByteTokenizer
    monkeypatch.setattr(lm, "_RECOMPUTE_CHUNK", 16)
    tok = ByteTokenizer()
    with warnings.catch_warnings():   # llama.cpp's phi3 has no window: ggmlopt warns
        warnings.simplefilter("ignore", UserWarning)
        save_gguf(randomised(KEPT[arch](tok.vocab_size), 2), tmp_path / "m.gguf",
                  dtype="q8_0", tokenizer=tok)
        model, _ = load_gguf(tmp_path / "m.gguf", keep_types=True)
    lora.apply(model, rank=4, seed=1)
    assert any(type(a._base) is QuantizedLinear for _, a in lora.named_adapters(model)
               if hasattr(a, "_base"))
    rng = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:   # adapters that change the logits
            p.data[...] = rng.normal(0, 0.3, p.shape)
    prompt = rng.integers(0, 256, 60)
    ours = go.generate(model, prompt, 10, temperature=0, stop_ids=())
    np.testing.assert_array_equal(ours, _full_greedy(model, prompt, 10))


def test_a_prompt_and_reply_past_the_context_are_refused():
    model = Llama(LlamaConfig(vocab_size=V, dim=16, n_layers=1, n_heads=2, max_seq_len=32),
                  seed=0)
    assert go.generate(model, np.arange(30), 2, temperature=0, stop_ids=()).size == 2
    with pytest.raises(ValueError, match="max_new_tokens.*max_seq_len=32"):
        go.generate(model, np.arange(30), 3, temperature=0)


def _llama_cpp_models():
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    return None if not src else os.path.join(src, "models")


CHATS = [("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct"),
         ("qwen2", "Qwen-Qwen3-0.6B"),
         ("gemma-4", "google-gemma-4-31B-it"),
         ("phi-3", "microsoft-Phi-3.5-mini-instruct")]   # a BOS the template does not write


@pytest.mark.skipif(_llama_cpp_models() is None,
                    reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("vocab, template", CHATS)
def test_chat_reads_transformers_chat_template_ids_and_stops_at_its_eos(tmp_path, monkeypatch,
                                                                       vocab, template):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from ggmlopt.io import hf_tokenizer_files, load_gguf_tokenizer
    models = _llama_cpp_models()
    path = os.path.join(models, f"ggml-vocab-{vocab}.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is absent")
    tok = load_gguf_tokenizer(path)
    with open(os.path.join(models, "templates", template + ".jinja"), encoding="utf-8") as f:
        tok.chat_template = f.read()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (tmp_path / "tokenizer.json").write_text(hf_tokenizer_files.tokenizer_json(tok))
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps(hf_tokenizer_files.tokenizer_config(tok, 4096)))
        (tmp_path / "generation_config.json").write_text(
            json.dumps(hf_tokenizer_files.generation_config(tok)))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    stops = transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id
    stops = stops if isinstance(stops, list) else [stops]
    assert set(stops) == set(tok.eog_ids)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    want = list(theirs.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
    if tok.add_bos and want[0] != tok.bos_id:   # llama.cpp's tokenize adds it
        want = [tok.bos_id] + want
    seen = {}
    generate = lm.generate

    def recorded(model, ids, n, **kw):
        seen["ids"] = [int(i) for i in ids]
        return generate(model, ids, n, **kw)

    monkeypatch.setattr(lm, "generate", recorded)
    hello = [int(i) for i in tok.encode("Hello")]
    for stop in stops:
        model = Scripted(hello + [stop] + hello, tok.vocab_size)
        assert go.chat(model, tok, messages, 12, temperature=0) == tok.decode(hello)
        assert seen["ids"] == want
        assert model.step == len(hello) + 1


def _top_p_reference(logits, temperature, top_p):
    """top_p alone in float64 over a full stable sort: the ids from the likeliest
    down (ties in index order) until their mass reaches top_p, renormalized."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    out = np.zeros(z.size)
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


@pytest.mark.parametrize("ties", [False, True])
def test_top_p_over_a_large_vocabulary_keeps_the_full_sorts_ids(ties):
    """top_p alone sorts only the candidates its mass can reach (a vocabulary is
    not sorted whole each token): the ids kept and their probabilities are those
    of a full sort, for masses reached within 64 ids and far beyond."""
    rng = np.random.default_rng(3)
    for case in range(40):
        n = int(rng.integers(300, 3000))
        scale = float(rng.choice([0.3, 2.0, 8.0]))
        logits = (rng.standard_normal(n) * scale).astype(np.float32)
        if ties:
            logits = np.round(logits).astype(np.float32)
        temperature = float(rng.choice([0.5, 1.0, 2.0]))
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.999]))
        want = _top_p_reference(logits, temperature, top_p)
        got = _ours(logits, temperature, None, top_p, None)
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"case {case}")
        np.testing.assert_allclose(got, want, rtol=0, atol=PROB_TOL, err_msg=f"case {case}")


def test_nan_logits_are_refused_by_name_when_sampling():
    logits = np.zeros(50, np.float32)
    logits[7] = np.nan
    for top_k, top_p in ((None, None), (5, None), (None, 0.9)):
        with pytest.raises(ValueError, match="logits hold NaN"):
            lm._pick(logits, 1.0, top_k, top_p, np.random.default_rng(0))


def _tiny_llama():
    from ggmlopt.models import Llama, LlamaConfig
    return Llama(LlamaConfig(vocab_size=41, dim=16, n_layers=1, n_heads=2, max_seq_len=12),
                 seed=0)


def test_the_context_limit_is_said_by_the_argument_that_passes_it():
    import ggmlopt as go
    model = _tiny_llama()
    with pytest.raises(ValueError, match=r"prompt_ids: the prompt's 13 tokens exceed"):
        go.generate(model, np.arange(13) % 41, 0)
    with pytest.raises(ValueError, match=r"max_new_tokens: .*\(at most 2 new ones fit\)"):
        go.generate(model, np.arange(10), 3)


def test_stop_ids_outside_the_vocabulary_are_refused():
    import ggmlopt as go
    model = _tiny_llama()
    for bad in ([-1], [41], [3, 10**12]):
        with pytest.raises(IndexError, match="stop_ids: .*outside the vocabulary"):
            go.generate(model, [1, 2], 2, stop_ids=bad)


def test_perplexity_names_a_bos_id_outside_the_vocabulary():
    import ggmlopt as go
    with pytest.raises(IndexError, match=r"bos_id: 41 is outside the vocabulary"):
        go.lm.perplexity(_tiny_llama(), np.arange(24) % 41, 8, bos_id=41)


def test_chat_at_the_context_limit_says_so_without_max_new_tokens():
    import ggmlopt as go
    from ggmlopt.text import ByteTokenizer
    model = go.models.Llama(go.models.LlamaConfig(vocab_size=257, dim=16, n_layers=1,
                                                  n_heads=2, max_seq_len=24), seed=0)
    tok = ByteTokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="messages: the conversation's 24 tokens fill .* "
                                         "leaving no room"):
        go.chat(model, tok, [{"role": "user", "content": "x" * 24}])


def test_chat_names_messages_for_a_conversation_past_the_context():
    import ggmlopt as go
    from ggmlopt.text import ByteTokenizer
    model = go.models.Llama(go.models.LlamaConfig(vocab_size=257, dim=16, n_layers=1,
                                                  n_heads=2, max_seq_len=24), seed=0)
    tok = ByteTokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="messages: the conversation's 30 tokens exceed"):
        go.chat(model, tok, [{"role": "user", "content": "x" * 30}], max_new_tokens=4)
