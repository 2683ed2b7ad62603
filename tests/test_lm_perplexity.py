"""ggmlopt.lm.perplexity: llama-perplexity's protocol (chunks of n_ctx, the first
token of each chunk replaced by BOS, positions n_ctx/2 .. n_ctx-2 scored, the
final estimate and its uncertainty as it prints them), checked against a
transcription of its loop in float64."""
import math

import numpy as np
import pytest

from ggmlopt.lm import perplexity

V = 13


class FirstTokenBigram:
    """logits[b, t] = W[tokens[b, t]] + U[tokens[b, 0]]: every position sees the
    chunk's first token, so replacing it by BOS changes the scores."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.w = rng.normal(0, 2, (V, V)).astype(np.float32)
        self.u = rng.normal(0, 1, (V, V)).astype(np.float32)
        self.calls = []
        self.training = True

    def forward(self, tokens):
        assert tokens.dtype == np.int32 and not self.training
        self.calls.append(tokens.shape)
        return self.w[tokens] + self.u[tokens[:, :1]]


def llama_perplexity(model, tokens, n_ctx, bos):
    """tools/perplexity/perplexity.cpp's perplexity(), transcribed."""
    n_chunk = len(tokens) // n_ctx
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    for i in range(n_chunk):
        start = i * n_ctx
        chunk = np.array(tokens[start:start + n_ctx], np.int32)
        if bos is not None:
            chunk[0] = bos
        logits = model.forward(chunk[None])[0].astype(np.float64)
        for j in range(first, n_ctx - 1):
            row = logits[j]
            v = math.log(np.exp(row - row.max()).sum()) - (row[tokens[start + j + 1]] - row.max())
            nll += v
            nll2 += v * v
            count += 1
    nll2 /= count
    nll /= count
    ppl = math.exp(nll)
    return ppl, ppl * math.sqrt((nll2 - nll * nll) / (count - 1)), count


@pytest.mark.parametrize("ntokens,n_ctx", [(64, 8), (100, 7), (33, 16), (6, 3)])
@pytest.mark.parametrize("bos", [None, 1])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_equals_llama_perplexity(ntokens, n_ctx, bos, batch_size):
    tokens = np.random.default_rng(ntokens).integers(0, V, ntokens)
    model = FirstTokenBigram()
    got = perplexity(model, tokens, n_ctx, bos_id=bos, batch_size=batch_size)
    reference = FirstTokenBigram()
    reference.training = False
    ppl, unc, count = llama_perplexity(reference, tokens, n_ctx, bos)
    assert got.scored == count == (ntokens // n_ctx) * (n_ctx - n_ctx // 2 - 1)
    assert got.ppl == pytest.approx(ppl, rel=1e-6)
    assert got.unc == pytest.approx(unc, rel=1e-5)
    assert len(got.per_chunk) == ntokens // n_ctx and got.per_chunk[-1] == pytest.approx(ppl)
    assert model.training  # eval mode only while scoring


def test_bos_replacement_changes_the_scores():
    tokens = np.random.default_rng(0).integers(2, V, 64)
    plain = perplexity(FirstTokenBigram(), tokens, 8)
    with_bos = perplexity(FirstTokenBigram(), tokens, 8, bos_id=1)
    assert plain.ppl != with_bos.ppl


def test_a_perfect_model_has_perplexity_one():
    class Oracle:
        def forward(self, tokens):
            out = np.full(tokens.shape + (V,), -30.0, np.float32)
            nxt = (tokens + 1) % V
            np.put_along_axis(out, nxt[..., None], 30.0, -1)
            return out
    tokens = np.arange(64) % V
    got = perplexity(Oracle(), tokens, 16)
    assert got.ppl == pytest.approx(1.0) and math.isnan(got.unc)


@pytest.mark.parametrize("ids,n_ctx,kw,exc,match", [
    (np.arange(15), 8, {}, ValueError, "you need at least 16 tokens"),
    (np.arange(64.0), 8, {}, TypeError, "ids: expected integer token ids"),
    (np.zeros((2, 32), int), 8, {}, ValueError, r"expected shape \(ntokens,\)"),
    (np.arange(64) - 1, 8, {}, ValueError, "token ids must lie"),
    (np.arange(64), 2, {}, ValueError, "n_ctx"),
    (np.arange(64), 8, {"add_bos": True}, ValueError, "bos_id: required"),
    (np.arange(64), 8, {"add_bos": "no", "bos_id": 1}, TypeError, "add_bos: expected a bool"),
])
def test_bad_input(ids, n_ctx, kw, exc, match):
    with pytest.raises(exc, match=match):
        perplexity(FirstTokenBigram(), ids, n_ctx, **kw)


def test_a_model_s_scored_logits_give_its_forward_s_perplexity():
    from ggmlopt.models import Llama, LlamaConfig

    class ForwardOnly:   # the same model seen without logits_between
        def __init__(self, model):
            self.model, self.training = model, False

        def forward(self, tokens):
            return self.model.forward(tokens)

    model = Llama(LlamaConfig(vocab_size=V, dim=16, n_layers=1, n_heads=2, max_seq_len=64),
                  seed=4)
    tokens = np.random.default_rng(9).integers(0, V, 200)
    for n_ctx, bos, batch in ((16, None, 1), (33, 1, 2)):
        got = perplexity(model, tokens, n_ctx, bos_id=bos, batch_size=batch)
        want = perplexity(ForwardOnly(model), tokens, n_ctx, bos_id=bos, batch_size=batch)
        assert got.scored == want.scored
        assert got.ppl == pytest.approx(want.ppl, rel=1e-6)
        assert got.per_chunk == pytest.approx(want.per_chunk, rel=1e-6)
