"""Packing: several documents a window, marked in the token ids, attended and
positioned per document by every model family, so each document's logits, loss
and gradients are those it has alone; instruction datasets packed best-fit."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.instruct import pack_examples
from ggmlopt.models import (
    GPT2,
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
from ggmlopt.nn.positions import (
    DocumentPositions,
    document_ids,
    mark_document_starts,
    split_documents,
)
from ggmlopt.text import ByteTokenizer

V = 67
COMMON = {"vocab_size": V, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}
MODELS = {
    "llama": lambda: Llama(LlamaConfig(**COMMON, n_kv_heads=2, ffn_dim=48), seed=1),
    "llama3-rope-tied": lambda: Llama(LlamaConfig(
        **COMMON, ffn_dim=40, tie_embeddings=True, rope_base=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16)), seed=2),
    "qwen2": lambda: Qwen2(Qwen2Config(**COMMON, n_kv_heads=2, ffn_dim=48), seed=3),
    "qwen3": lambda: Qwen3(Qwen3Config(**COMMON, n_kv_heads=2, head_dim=12, ffn_dim=48),
                           seed=4),
    "smollm3": lambda: SmolLM3(SmolLM3Config(**{**COMMON, "n_layers": 4}, n_kv_heads=2,
                                             ffn_dim=48), seed=5),
    "mistral-window-4": lambda: Mistral(MistralConfig(**COMMON, n_kv_heads=1, ffn_dim=40,
                                                      sliding_window=4), seed=6),
    "phi3-window-5": lambda: Phi3(Phi3Config(**COMMON, n_kv_heads=2, ffn_dim=48,
                                             sliding_window=5), seed=7),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=64), seed=8),
}
LENGTHS = (5, 11, 1, 8)     # one window of 25 with a padded tail of 4
T = 29


def _randomised(model):
    rng = np.random.default_rng(0)
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    return model


def _documents(seed=0):
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(0, V, n).astype(np.int32) for n in LENGTHS]
    labels = [rng.integers(0, V, n).astype(np.int32) for n in LENGTHS]
    for y in labels:
        y[rng.random(y.size) < 0.3] = -1     # masked positions, as a prompt's
    return inputs, labels


def _packed(inputs, labels):
    x = np.zeros((1, T), np.int32)
    y = np.full((1, T), -1, np.int32)
    starts = np.zeros((1, T), bool)
    at = 0
    for a, b in zip(inputs, labels):
        x[0, at:at + a.size], y[0, at:at + a.size] = a, b
        starts[0, at] = True
        at += a.size
    starts[0, at] = True    # the padding, a document of its own
    return mark_document_starts(x, starts), y


def _alone(inputs, labels):
    x = np.zeros((len(inputs), T), np.int32)
    y = np.full((len(inputs), T), -1, np.int32)
    for r, (a, b) in enumerate(zip(inputs, labels)):
        x[r, :a.size], y[r, :b.size] = a, b
    return x, y


def _loss_and_grads(model, x, y):
    """Masked cross-entropy, the mean over the labelled positions (the
    OptContext's loss), in float64 from the logits; every parameter's gradient."""
    logits = model.forward(x).astype(np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lab = y >= 0
    n = lab.sum()
    loss = -logp[lab, y[lab]].sum() / n
    g = np.exp(logp)
    g[lab, y[lab]] -= 1.0
    g[~lab] = 0.0
    model.zero_grad()
    model.backward((g / n).astype(np.float32))
    return loss, {k: p.grad.copy() for k, p in model.named_parameters()
                  if p.requires_grad}, logits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_documents_have_the_loss_and_gradients_they_have_alone(name):
    model = _randomised(MODELS[name]())
    inputs, labels = _documents()
    xp, yp = _packed(inputs, labels)
    xa, ya = _alone(inputs, labels)
    loss_p, grads_p, logits_p = _loss_and_grads(model, xp, yp)
    loss_a, grads_a, logits_a = _loss_and_grads(model, xa, ya)
    at = 0
    for r, a in enumerate(inputs):   # each document's logits, as it has them alone
        want = logits_a[r, :a.size]
        np.testing.assert_allclose(logits_p[0, at:at + a.size], want, rtol=0,
                                   atol=1e-6 * np.abs(logits_a).max())
        at += a.size
    assert abs(loss_p - loss_a) <= 1e-6 * abs(loss_a)
    scale = max(np.abs(g).max() for g in grads_a.values())
    for k, g in grads_a.items():
        np.testing.assert_allclose(grads_p[k], g, rtol=0, atol=1e-6 * scale, err_msg=k)
    # without the marks the window is one document: different logits (the test can fail)
    plain = model.forward(split_documents(xp)[0])
    assert np.abs(plain[0, 5:16] - logits_p[0, 5:16]).max() > 1e-3


def test_packed_documents_train_as_they_do_alone_with_checkpointing_and_lora():
    from ggmlopt import lora
    inputs, labels = _documents(1)
    xp, yp = _packed(inputs, labels)
    xa, ya = _alone(inputs, labels)
    results = []
    for x, y, ckpt in ((xa, ya, False), (xp, yp, False), (xp, yp, True)):
        model = _randomised(MODELS["llama"]())
        lora.apply(model, rank=4, seed=0)
        for _, p in model.named_parameters():   # B non-zero: the adapters count
            if p.requires_grad and p.data.ndim == 2 and not p.data.any():
                p.data[...] = 0.05
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        results.append(_loss_and_grads(model, x, y)[1])
    scale = max(np.abs(g).max() for g in results[0].values())
    for k in results[0]:
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=0, atol=1e-6 * scale)
        np.testing.assert_array_equal(results[2][k], results[1][k])   # checkpointing: same bits


def test_marks_split_into_ids_positions_and_document_ids():
    ids = np.array([[4, 5, 6, 7, 8, 9], [1, 2, 3, 0, 0, 0]], np.int32)
    starts = np.array([[1, 0, 1, 0, 0, 1], [1, 0, 0, 1, 0, 0]], bool)
    x = mark_document_starts(ids, starts)
    assert x[0, 0] == -5 and x[1, 3] == -1 and x[0, 1] == 5
    back, pos = split_documents(x)
    np.testing.assert_array_equal(back, ids)
    np.testing.assert_array_equal(pos.positions, [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2]])
    np.testing.assert_array_equal(pos.starts, [[0, 0, 2, 2, 2, 5], [0, 0, 0, 3, 3, 3]])
    np.testing.assert_array_equal(document_ids(x), [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]])
    # an unmarked window is one document a row: nothing to split
    same, none = split_documents(ids)
    assert none is None and same is ids
    # column 0 starts a document whether marked or not
    np.testing.assert_array_equal(split_documents(x[:, 1:])[1].positions[0], [0, 0, 1, 2, 0])
    with pytest.raises(ValueError, match="start at 0"):
        DocumentPositions(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="previous token's position"):
        DocumentPositions(np.array([[0, 2]]))


def test_a_model_refuses_marks_where_documents_cannot_be_kept_apart():
    model = MODELS["llama"]()
    x = mark_document_starts(np.array([[3, 4, 5, 6]]), np.array([[1, 0, 1, 0]], bool))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        model.decode(x, model.make_cache(1, 8))     # the cache holds one document
    bad = x.copy()
    bad[0, 2] = -1 - V                             # a mark of an id outside the vocabulary
    with pytest.raises(IndexError, match=f"id {V} at position"):
        model.forward(bad)


def test_pack_examples_is_best_fit_decreasing():
    lengths = [7, 3, 5, 2, 4, 1, 6]
    windows = pack_examples(lengths, 8)
    assert sorted(k for w in windows for k in w) == list(range(len(lengths)))
    assert all(sum(lengths[k] for k in w) <= 8 for w in windows)
    # longest first, each into the fullest window it fits: 7+1, 6+2, 5+3, 4
    assert windows == [[0, 5], [3, 6], [1, 2], [4]]
    assert len(pack_examples([8] * 3, 8)) == 3
    with pytest.raises(ValueError, match=r"lengths\[1\]: expected 1 .. n_ctx=8"):
        pack_examples([3, 9], 8)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "Quimby", "Zorblax", "capital"]
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(words, rng.integers(1, 6)))
        a = " ".join(rng.choice(words, rng.integers(1, 9)))
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def test_from_chat_packs_every_conversation_once_with_its_own_labels():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    chats = _conversations(23)
    plain = go.Dataset.from_chat(chats, tok, 256)
    packed = go.Dataset.from_chat(chats, tok, 256, packing=True)
    tokens = sum(tok.apply_chat_template(c).size - 1 for c in chats)
    assert packed.ndata <= -(-tokens // 256) + 1 < plain.ndata / 2   # nearly no padding
    ids, pos = split_documents(np.asarray(packed.data))
    docs = document_ids(np.asarray(packed.data))
    # every conversation's inputs and labels appear whole, once, as a document
    x, y = np.asarray(plain.data), np.asarray(plain.labels)
    want = sorted((tuple(x[r, :n]), tuple(y[r, :n]))
                  for r, n in enumerate([tok.apply_chat_template(c).size - 1 for c in chats]))
    got = []
    yp = np.asarray(packed.labels)
    for r in range(packed.ndata):
        for d in np.unique(docs[r]):
            cols = np.flatnonzero(docs[r] == d)
            if (yp[r, cols] >= 0).any():
                got.append((tuple(ids[r, cols]), tuple(yp[r, cols])))
                np.testing.assert_array_equal(pos.positions[r, cols], np.arange(cols.size))
            else:   # the padded tail: eos, masked
                assert (ids[r, cols] == tok.eos_id).all() and cols[-1] == 255
    assert sorted(got) == want
    # the dataset says it: each token's document and its position there
    np.testing.assert_array_equal(packed.document_ids, docs)
    np.testing.assert_array_equal(packed.positions, pos.positions)
    np.testing.assert_array_equal(plain.positions[3], np.arange(256))
    assert not plain.document_ids.any()
    assert go.Dataset.from_arrays(np.ones((2, 3), np.float32)).positions is None
    comp = go.Dataset.from_completions([("a", "b"), ("cc", "dd")], tok, 16, packing=True)
    assert comp.ndata == 1 and document_ids(np.asarray(comp.data))[0].max() == 2
    with pytest.raises(TypeError, match="packing: expected a bool"):
        go.Dataset.from_chat(chats, tok, 256, packing="yes")
    # a string is not taken as true ("no" appended the EOS)
    for make in (go.Dataset.from_completions, go.Dataset.from_texts):
        rows = [("a", "b")] if make is go.Dataset.from_completions else ["ab"]
        with pytest.raises(TypeError, match="add_eos: expected a bool"):
            make(rows, tok, 16, add_eos="no")
    with pytest.raises(TypeError, match="conversations: expected a list of conversations"):
        go.Dataset.from_chat(None, tok, 256)
    # a lone surrogate named where it is, not at an offset of the rendered chat
    bad = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a\ud800"}]]
    with pytest.raises(ValueError, match=r"conversations\[0\]\[1\]\['content'\]: a lone "
                                         r"surrogate U\+D800 at position 1"):
        go.Dataset.from_chat(bad, tok, 256)
    with pytest.raises(ValueError, match=r"pairs\[1\] completion: a lone surrogate"):
        go.Dataset.from_completions([("a", "b"), ("c", "\udfff")], tok, 16)
    with pytest.raises(ValueError, match=r"texts\[0\]: a lone surrogate"):
        go.Dataset.from_texts(["\ud800"], tok, 16)


def test_fit_on_packed_chats_follows_the_unpacked_run():
    """One logical batch holding every conversation, packed or one a row: the
    same labelled positions, so the same loss and the same trained weights."""
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    chats = _conversations(12, seed=3)
    runs = []
    for packing in (False, True):
        ds = go.Dataset.from_chat(chats, tok, 200, packing=packing)
        model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  ffn_dim=48, max_seq_len=200), seed=0)
        hist = go.fit(model, ds, "cross_entropy", nepoch=3, nbatch_logical=ds.ndata,
                      silent=True, seed=0)
        runs.append((hist, [p.data.copy() for _, p in model.named_parameters()]))
    (h0, w0), (h1, w1) = runs
    np.testing.assert_allclose([e.train_loss for e in h1], [e.train_loss for e in h0],
                               rtol=1e-5)
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())


def test_text_rows_are_documents_trained_whole():
    # TRL's and MLX-LM's {"text"} rows: each its own document, every token and the
    # eos trained, a window each or packed, never attending to another row
    tok = ByteTokenizer()
    rows = [{"text": "the first row"}, "a second, longer row of text", {"text": "x"}]
    ds = go.Dataset.from_texts(rows, tok, 32)
    x, y = np.asarray(ds.data), np.asarray(ds.labels)
    assert ds.ndata == 3
    for r, row in enumerate(rows):
        text = row["text"] if isinstance(row, dict) else row
        ids = np.concatenate([tok.encode(text), [tok.eos_id]])
        np.testing.assert_array_equal(x[r, :ids.size - 1], ids[:-1])
        np.testing.assert_array_equal(y[r, :ids.size - 1], ids[1:])
        assert (y[r, ids.size - 1:] == -1).all()
    packed = go.Dataset.from_texts(rows, tok, 64, packing=True)
    assert packed.ndata == 1 and packed.document_ids[0].max() == 3
    assert np.asarray(packed.labels)[0][np.asarray(packed.labels)[0] >= 0].size == \
        sum(int((y[r] >= 0).sum()) for r in range(3))
    with pytest.raises(ValueError, match=r"texts\[0\]: 14 tokens, more than n_ctx \+ 1"):
        go.Dataset.from_texts(rows, tok, 8)
    with pytest.warns(UserWarning, match="2 of 3 examples are longer.*cut to that length"):
        assert go.Dataset.from_texts(rows, tok, 8, too_long="truncate").ndata == 3
    with pytest.raises(TypeError, match=r"texts\[0\]"):
        go.Dataset.from_texts([3], tok, 8)
