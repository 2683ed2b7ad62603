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


class WaveModel:
    """A vocabulary of any size without a (vocab, vocab) table: the logits of a
    position are waves of its token and of its chunk's first token, so a BOS put
    first changes every score."""

    def __init__(self, vocab):
        self.cols = np.arange(vocab, dtype=np.float64)
        self.training = True

    def forward(self, tokens):
        t = tokens.astype(np.float64)[..., None]
        first = tokens[:, :1].astype(np.float64)[..., None]
        return (np.sin(0.37 * t + 0.011 * self.cols) +
                np.cos(0.13 * first + 0.007 * self.cols)).astype(np.float32)


class BosByteTokenizer:
    """The tokenizer protocol with a BOS it adds and an EOS it appends, as a
    SentencePiece vocabulary's add_bos_token / add_eos_token ask for."""

    vocab_size, bos_id, eos_id, add_bos, add_eos = 258, 256, 257, True, True

    def encode(self, text, *, parse_special=False):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)


TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.mark.parametrize("n_ctx", [8, 13])
def test_a_text_with_its_tokenizer_is_llama_perplexitys_protocol(n_ctx):
    # llama-perplexity: common_tokenize(text, add_special=true) puts BOS first and
    # EOS last as the vocabulary says, and each chunk's first token becomes BOS
    tok, model = BosByteTokenizer(), WaveModel(258)
    tokens = np.r_[256, np.frombuffer(TEXT.encode(), np.uint8).astype(np.int32), 257]
    want = llama_perplexity(model, tokens, n_ctx, 256)
    for got in (perplexity(model, TEXT, n_ctx, tokenizer=tok),
                perplexity(model, tokens, n_ctx, tokenizer=tok),   # ids: add_bos from it
                perplexity(model, tokens, n_ctx, add_bos=True, bos_id=256)):
        assert got.ppl == pytest.approx(want[0], rel=1e-6)
        assert got.scored == want[2]
    # the ids alone score without the chunks' BOS: another number
    plain = perplexity(model, tokens, n_ctx)
    assert abs(plain.ppl - want[0]) > 1e-3 * want[0]
    # add_bos=False over the tokenizer's default, as llama-perplexity of a
    # vocabulary that adds none
    off = perplexity(model, TEXT, n_ctx, tokenizer=tok, add_bos=False)
    assert off.ppl == pytest.approx(llama_perplexity(model, tokens, n_ctx, None)[0], rel=1e-6)


def test_a_text_needs_a_tokenizer_and_a_byte_tokenizer_adds_no_bos():
    from ggmlopt.text import ByteTokenizer
    model = WaveModel(257)
    with pytest.raises(TypeError, match="tokenizer="):
        perplexity(model, TEXT, 8)
    with pytest.raises(TypeError, match="tokenizer: expected"):
        perplexity(model, TEXT, 8, tokenizer=object())
    tok = ByteTokenizer()
    got = perplexity(model, TEXT, 8, tokenizer=tok)
    want = llama_perplexity(model, np.frombuffer(TEXT.encode(), np.uint8), 8, None)
    assert got.ppl == pytest.approx(want[0], rel=1e-6)


def test_special_tokens_written_in_the_text_read_as_text():
    # llama-perplexity tokenizes with parse_special false
    from ggmlopt.text import ByteTokenizer
    tok, model = ByteTokenizer(), WaveModel(257)
    text = "<|endoftext|>" + TEXT
    got = perplexity(model, text, 8, tokenizer=tok)
    want = llama_perplexity(model, np.frombuffer(text.encode(), np.uint8), 8, None)
    assert got.ppl == pytest.approx(want[0], rel=1e-6)


def test_a_tokenizer_without_the_flag_reads_the_text_its_own_way():
    # an encode(text) of the Tokenizer protocol: its own reading, no retry that
    # would hide a TypeError of its own
    class Plain:
        bos_id, eos_id, add_bos = None, None, False

        def encode(self, text):
            return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    class Broken(Plain):
        def encode(self, text, *, parse_special=False):
            raise TypeError("a bug of its own")

    model = WaveModel(256)
    got = perplexity(model, TEXT, 8, tokenizer=Plain())
    want = llama_perplexity(model, np.frombuffer(TEXT.encode(), np.uint8), 8, None)
    assert got.ppl == pytest.approx(want[0], rel=1e-6)
    with pytest.raises(TypeError, match="a bug of its own"):
        perplexity(model, TEXT, 8, tokenizer=Broken())
