"""What uses a language model: generation with a key/value cache, and perplexity
as llama.cpp computes it.

A language model here is any model whose ``forward(tokens)`` takes int32 token
ids (batch, T) and returns float32 logits (batch, T, vocab), as the models of
ggmlopt.models do; generation also needs their ``make_cache(batch, max_len)``
and ``decode(tokens, cache)`` (logits of new positions, the cache extended).
"""
from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import kernels
from ._args import bool_arg, int_arg
from ._blas_threads import blas_threads_for_training
from .instruct import document_ids, takes_parse_special
from .nn.module import eval_mode

__all__ = ["Perplexity", "chat", "generate", "perplexity", "stream"]


class Perplexity(NamedTuple):
    """llama-perplexity's final estimate: ``PPL = ppl +/- unc``, with the
    negative log-likelihood it comes from (the mean over the scored tokens)
    and the running estimate after each chunk (the ``[i]ppl,`` list it prints)."""

    ppl: float
    unc: float
    nll: float
    scored: int
    per_chunk: tuple[float, ...]


def _token_ids(ids: npt.ArrayLike, name: str = "ids") -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # (NumPy before 1.24 makes an object array of ragged lists, with a warning)
            warnings.simplefilter("ignore")
            arr = np.asarray(ids)
    except ValueError:   # ragged nested lists
        raise ValueError(f"{name}: expected a flat sequence of token ids") from None
    if arr.dtype == object and any(isinstance(v, (list, tuple, np.ndarray)) for v in arr.flat):
        raise ValueError(f"{name}: expected a flat sequence of token ids")
    if arr.size == 0 and arr.ndim == 1:
        return arr.astype(np.int32)   # [] has dtype float64
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected shape (ntokens,), got {arr.shape}")
    if arr.min() < 0 or arr.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{name}: token ids must lie in [0, 2**31), got values from "
                         f"{arr.min()} to {arr.max()}")
    return arr


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row (float64), as llama-perplexity's
    log_softmax: max and exp in float, their sum in double.  The cross-entropy
    kernel of one row is that row's value (a vectorised exp: 5x NumPy's here)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    classes = np.ascontiguousarray(targets, dtype=np.int32)
    return np.array([kernels.cross_entropy(logits[i:i + 1], classes[i:i + 1])
                     for i in range(logits.shape[0])], dtype=np.float64)


def perplexity(model: Any, ids: npt.ArrayLike | str, n_ctx: int, *, tokenizer: Any = None,
               add_bos: bool | None = None, bos_id: int | None = None,
               batch_size: int = 1) -> Perplexity:
    """The perplexity of model on the token stream ids, by llama.cpp's
    ``llama-perplexity`` protocol, so a model scores the same in both programs.

    ids: int token ids (ntokens,) exactly as llama.cpp tokenizes the text (with
    the BOS it puts first when the vocabulary adds one), or, with a tokenizer,
    the text itself, which it then tokenizes as llama-perplexity does (its
    special tokens added as the vocabulary asks, BOS first and EOS last; special
    tokens written in the text read as text, where the tokenizer's encode takes
    parse_special); at least 2 * n_ctx tokens.
    tokenizer: gives add_bos and bos_id their defaults, the tokenizer's own
    (llama-perplexity reads both from the vocabulary), so
    ``perplexity(model, text, n_ctx, tokenizer=tok)`` is its protocol.
    The stream is cut into ntokens // n_ctx chunks of n_ctx tokens (the rest is
    dropped; n_ctx at most the model's config.max_seq_len); when add_bos
    (default: the tokenizer's add_bos, else whether bos_id is given) the first
    token of each chunk is replaced by bos_id for the forward pass; in each chunk only the positions n_ctx/2 .. n_ctx-2
    are scored (position j predicting token j+1, so every scored token has at
    least half a window of context).  batch_size: chunks per forward pass (the
    numbers do not depend on it beyond float32 rounding: a quantized base's
    products may sum in another order for another row count).  A model with
    ``logits_between(tokens, start, stop)`` (ggmlopt's language models) is asked
    only for the scored positions' logits; any other needs ``forward``.

    Returns Perplexity(ppl, unc, nll, scored, per_chunk): ``ppl = exp(nll)``, nll
    the mean negative log-likelihood over the scored tokens, and unc =
    ppl * sqrt((mean nll^2 - nll^2) / (count - 1)), llama.cpp's "Final
    estimate: PPL = ppl +/- unc".  The model runs in eval mode, with the BLAS
    threads an epoch would use (GGMLOPT_BLAS_THREADS).
    """
    add_bos = bool_arg(add_bos, "add_bos", allow_none=True)
    if tokenizer is not None:
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(f"tokenizer: expected a tokenizer with encode(text), got "
                            f"{type(tokenizer).__name__}")
        if bos_id is None:
            bos_id = getattr(tokenizer, "bos_id", None)
        if add_bos is None:
            add_bos = bool(getattr(tokenizer, "add_bos", False)) and bos_id is not None
    if isinstance(ids, str):
        if tokenizer is None:
            raise TypeError("ids: a text needs tokenizer= to tokenize it (or pass token ids)")
        tokens = _text_ids(tokenizer, ids)
    else:
        tokens = _token_ids(ids)
    n_ctx = int_arg(n_ctx, "n_ctx", 3)
    batch_size = int_arg(batch_size, "batch_size", 1)
    if add_bos is None:
        add_bos = bos_id is not None
    if add_bos:
        if bos_id is None:
            raise ValueError("bos_id: required with add_bos=True")
        bos_id = int_arg(bos_id, "bos_id", 0)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(vocab, (int, np.integer)) and bos_id >= vocab:
            raise IndexError(f"bos_id: {bos_id} is outside the vocabulary "
                             f"[0, {vocab})")
    # the model's own limit, refused by the argument that asks for more (its forward
    # would name its tokens' T instead)
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if isinstance(max_len, (int, np.integer)) and not isinstance(max_len, bool) \
            and n_ctx > max_len:
        raise ValueError(f"n_ctx: {n_ctx} is more than the model's max_seq_len={max_len}")
    if tokens.size < 2 * n_ctx:
        raise ValueError(f"ids: you need at least {2 * n_ctx} tokens to evaluate perplexity "
                         f"with a context of {n_ctx}; got {tokens.size}")
    n_chunk = tokens.size // n_ctx
    first = n_ctx // 2
    chunks = tokens[:n_chunk * n_ctx].astype(np.int32).reshape(n_chunk, n_ctx)
    nll = nll2 = 0.0
    count = 0
    per_chunk = []
    # a model that can compute only some positions' logits (ggmlopt's language models)
    scored_logits = getattr(model, "logits_between", None)
    scored_logits = scored_logits if callable(scored_logits) else None
    # BLAS threads as an epoch caps them: a busy core makes OpenBLAS's second thread
    # cost more than it brings (GGMLOPT_BLAS_THREADS, see show_config)
    with eval_mode(model), blas_threads_for_training(model):
        for start in range(0, n_chunk, batch_size):
            batch = chunks[start:start + batch_size].copy()
            targets = batch[:, first + 1:].copy()   # before the BOS replacement
            if bos_id is not None and add_bos:
                batch[:, 0] = bos_id
            if scored_logits is not None:   # only the scored positions' logits
                logits, at = scored_logits(batch, first, n_ctx - 1), 0
                want, what = (batch.shape[0], n_ctx - 1 - first), "model.logits_between"
            else:
                logits, at = model.forward(batch), first
                want, what = (batch.shape[0], n_ctx), "model.forward"
            if not isinstance(logits, np.ndarray) or logits.shape[:2] != want or logits.ndim != 3:
                raise ValueError(f"{what}: expected logits of shape {want + ('vocab',)}, "
                                 f"got {getattr(logits, 'shape', type(logits).__name__)}")
            for row in range(batch.shape[0]):
                v = _nll_rows(np.asarray(logits[row, at:at + n_ctx - 1 - first], np.float32),
                              targets[row])
                nll += float(v.sum())
                nll2 += float((v * v).sum())
                count += v.size
                per_chunk.append(math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else math.nan
    return Perplexity(ppl, unc, mean, count, tuple(per_chunk))


def _text_ids(tokenizer, text: str) -> np.ndarray:
    """text as llama-perplexity tokenizes it: common_tokenize(text, add_special=true),
    so BOS and EOS as the vocabulary adds them, and special tokens written in the
    text read as text (its parse_special is false) where the tokenizer's encode
    takes the flag; an encode(text) without it (the Tokenizer protocol's) reads
    them as it does."""
    return document_ids(tokenizer, text,
                        parse_special=False if takes_parse_special(tokenizer) else None)


def _real_arg(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:   # an int beyond any float
        raise ValueError(f"{name}: expected a finite value, got {value}") from None


def _penalty_args(repetition_penalty, min_p):
    if repetition_penalty is not None:
        repetition_penalty = _real_arg(repetition_penalty, "repetition_penalty")
        # (the logits are float32: a penalty that float32 rounds to 0 or inf is none)
        as_f32 = float(np.float32(repetition_penalty)) if abs(repetition_penalty) < 1e39 \
            else math.inf
        if not (math.isfinite(as_f32) and as_f32 > 0):
            raise ValueError(f"repetition_penalty: expected a value > 0 and finite in "
                             f"float32, got {repetition_penalty}")
    if min_p is not None:
        min_p = _real_arg(min_p, "min_p")
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p: expected 0 <= min_p <= 1, got {min_p}")
    return repetition_penalty, min_p


def _penalized(logits, seen, repetition_penalty):
    """Hugging Face's (and llama.cpp's) repetition penalty: each id already in the
    context has its logit divided by the penalty when positive, multiplied when
    negative."""
    if repetition_penalty is None or repetition_penalty == 1.0 or not seen:
        return logits
    out = logits.astype(np.float32, copy=True)
    ids = np.fromiter(seen, dtype=np.int64)
    z = out[ids]
    out[ids] = np.where(z > 0, z / np.float32(repetition_penalty),
                        z * np.float32(repetition_penalty))
    return out


def _sampling_args(temperature, top_k, top_p):
    temperature = _real_arg(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: expected a finite value >= 0, got {temperature}")
    if top_k is not None:
        top_k = int_arg(top_k, "top_k", 1)
    if top_p is not None:
        top_p = _real_arg(top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected 0 < top_p <= 1, got {top_p}")
    return temperature, top_k, top_p


def _scaled_past_range(logits, temperature):
    """logits / temperature where that overflows (a temperature of 1e-320, or a
    logit a tiny repetition penalty made infinite): its limit, the draw shared
    among the largest logits (the infinite ones, or the maxima), shifted so that
    the largest is 0 and the rest -inf or finite."""
    top = np.isposinf(logits)
    if top.any():
        return np.where(top, 0.0, -np.inf)
    return (logits - logits.max()) / temperature


def _pick(logits, temperature, top_k, top_p, rng, min_p=None):
    """The next id from one row of logits: greedy at temperature 0 (the first
    maximum, as argmax), else a draw from softmax(logits / temperature) cut to
    the top_k largest (exactly k: ids tied with the k-th are cut in index order;
    transformers' TopK keeps every tie, llama.cpp's partial sort keeps some of
    them, by its own order), then
    to the smallest set whose probability reaches
    top_p, then to the ids at least min_p times as likely as the likeliest (the
    order of transformers' logits warpers; llama.cpp's default chain applies
    the temperature after the cuts instead)."""
    if temperature == 0:
        return int(np.argmax(logits))
    if np.isnan(logits).any():
        # (greedy takes the first maximum as transformers' argmax does; a draw has
        # no distribution to draw from)
        raise ValueError(f"the model's logits hold NaN at {int(np.isnan(logits).sum())} ids: "
                         f"there is no distribution to sample from (has the model diverged?)")
    with np.errstate(over="ignore", invalid="ignore"):
        z = logits.astype(np.float64) / temperature
        # overflowed either way (every logit negative gives -inf everywhere); logits
        # that are all -inf are the model's to answer for
        if not math.isfinite(z.max()) and not np.isneginf(logits).all():
            z = _scaled_past_range(logits.astype(np.float64), temperature)
    cut = -math.inf if min_p is None or min_p <= 0 else math.log(min_p)
    if top_p is not None and top_p >= 1:
        top_p = None   # keeps every id (transformers and llama.cpp skip it): no rounded cut
    if top_k is None and top_p is None:
        if min_p:   # p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p)
            z = np.where(z >= z.max() + cut, z, -np.inf)
        # every id can be drawn: no order is needed (sorting a vocabulary of 32000
        # took longer than the model's whole step for the token)
        p = np.exp(z - z.max())
        p /= p.sum()
        return int(rng.choice(p.size, p=p))
    if top_k is None:   # top_p alone: sort only the ids its mass can reach
        order, p = _top_p_candidates(z, top_p)
        z = z[order]
    else:
        order = _largest_first(z, top_k)
        z = z[order]
        p = np.exp(z - z[0])
        p /= p.sum()
    if top_p is not None:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        p, z, order = p[:keep], z[:keep], order[:keep]
    # min_p on what top_p kept (z is largest first: the ids kept are a prefix)
    keep = int(np.count_nonzero(z >= z[0] + cut))
    p, order = p[:keep] / p[:keep].sum(), order[:keep]
    return int(order[rng.choice(p.size, p=p)])


def _largest_first(z, k):
    """The indices of z from its largest value down, equal values in index order
    (what a stable sort of -z gives), only the first k of them (all for None);
    with k, only the k candidates are sorted."""
    if k is None or k >= z.size:
        return np.argsort(-z, kind="stable")
    kth = np.partition(z, z.size - k)[z.size - k]  # the k-th largest value
    above = np.flatnonzero(z > kth)
    candidates = np.concatenate([above, np.flatnonzero(z == kth)[:k - above.size]])
    return candidates[np.argsort(-z[candidates], kind="stable")]


def _top_p_candidates(z, top_p):
    """(the largest-first indices of z, equal values in index order, as many as
    top_p's mass needs; their probabilities in softmax(z) over every id): the
    candidates grow eightfold from 64 until their mass reaches top_p, so a
    vocabulary of 150k ids is partitioned a few times, not sorted whole."""
    e = np.exp(z - z.max())
    total = e.sum()
    k = 64
    while True:
        order = _largest_first(z, k)   # (every id once k reaches the vocabulary)
        p = e[order] / total
        if k >= z.size or np.cumsum(p)[-1] >= top_p:
            return order, p
        k *= 8


def _stop_ids(stop_ids, tokenizer, model) -> set[int]:
    """The ids that end a generation: stop_ids as given, else the tokenizer's
    end-of-generation ids, else the model's (load_gguf sets them)."""
    if stop_ids is not None:
        if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
            raise TypeError(f"stop_ids: expected token ids (an iterable of int) or None, "
                            f"got {type(stop_ids).__name__}")
        ids = list(stop_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"stop_ids: expected int token ids, got {i!r}")
        return {int(i) for i in ids}
    model_eog = {int(i) for i in getattr(model, "eog_ids", ())}
    if tokenizer is not None:
        eog = getattr(tokenizer, "eog_ids", None)
        if eog is not None:
            return {int(i) for i in eog}
        # a tokenizer without them (transformers' names its eos eos_token_id): its eos
        # and the model's own, which a checkpoint's generation_config gives (without
        # these a reply ran on past its end of turn)
        eos = getattr(tokenizer, "eos_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)
        return model_eog | {int(i) for i in eos_ids}
    return model_eog


def stream(model: Any, prompt_ids: npt.ArrayLike, max_new_tokens: int, *,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           seed: int | np.random.Generator | None = None,
           stop_ids: Iterable[int] | None = None, tokenizer: Any = None,
           repetition_penalty: float | None = None,
           min_p: float | None = None) -> Iterator[int]:
    """generate's ids one by one, as they are made (for printing as they come).
    All arguments are checked before the first id is computed.  The model is
    in eval mode (no dropout) from the first id until the stream ends or is
    closed (``close()``; CPython closes one that only a ``for`` loop held when
    the loop is left): close a stream kept part-way before training the
    model."""
    prompt = _token_ids(prompt_ids, "prompt_ids")
    if prompt.size == 0:
        raise ValueError("prompt_ids: expected at least one token")
    max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 0)
    temperature, top_k, top_p = _sampling_args(temperature, top_k, top_p)
    repetition_penalty, min_p = _penalty_args(repetition_penalty, min_p)
    stops = _stop_ids(stop_ids, tokenizer, model)
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "max_seq_len", None)
    if limit is not None and prompt.size > limit:
        raise ValueError(f"prompt_ids: the prompt's {prompt.size} tokens exceed the model's "
                         f"max_seq_len={limit}")
    if limit is not None and prompt.size + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens: the prompt's {prompt.size} tokens and "
                         f"{max_new_tokens} new ones exceed the model's max_seq_len={limit} "
                         f"(at most {limit - prompt.size} new ones fit)")
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and stop_ids is not None and \
            any(not 0 <= i < vocab for i in stops):
        raise IndexError(f"stop_ids: {sorted(i for i in stops if not 0 <= i < vocab)[:5]} "
                         f"are outside the vocabulary [0, {vocab}): no token can "
                         f"stop there")
    if vocab is not None and prompt.max() >= vocab:
        raise IndexError(f"prompt_ids: id {int(prompt.max())} is outside the vocabulary "
                         f"[0, {vocab})")
    rng = seed if isinstance(seed, np.random.Generator) else \
        np.random.default_rng(int_arg(seed, "seed", 0, allow_none=True))
    return _stream(model, prompt, max_new_tokens, (temperature, top_k, top_p, min_p), rng,
                   stops, repetition_penalty)


# the parts of a prompt's pass (and of a recompute): a whole pass at once would hold a
# T x T score matrix a head (a 3000-token prompt over 32 heads: 3 GiB at its peak)
_RECOMPUTE_CHUNK = 256


def _recompute(model, ids, cache):
    """The cache of ids computed as one pass over them (LongRoPE's long factors
    for every position when they go past its pretraining length), a chunk at a
    time; the last position's logits."""
    from .nn.module import modules
    rotaries = [r for m in modules(model) if (r := getattr(m, "rotary", None)) is not None]
    cache.length = 0
    for r in rotaries:
        r.pass_positions = len(ids)
    try:
        for a in range(0, len(ids), _RECOMPUTE_CHUNK):
            logits = model.decode(np.array([ids[a:a + _RECOMPUTE_CHUNK]], np.int32), cache)
    finally:
        for r in rotaries:
            r.pass_positions = None
    return logits[0, -1]


def _stream(model, prompt, max_new_tokens, sampling, rng, stops, repetition_penalty):
    if max_new_tokens == 0:
        return
    temperature, top_k, top_p, min_p = sampling
    seen = set(prompt.tolist())
    ids = prompt.astype(np.int32).tolist()
    # LongRoPE: the step that takes the sequence past the pretraining length recomputes
    # the cache with the long factors (transformers' Phi-3 generate drops its cache there)
    recompute_at = getattr(model, "recompute_cache_at", None)
    with eval_mode(model):
        cache = model.make_cache(1, prompt.size + max_new_tokens)
        # the prompt a chunk at a time, as one pass (its memory grows with its length)
        logits = _recompute(model, ids, cache)
        for i in range(max_new_tokens):
            token = _pick(_penalized(logits, seen, repetition_penalty), temperature, top_k,
                          top_p, rng, min_p)
            seen.add(token)
            ids.append(token)
            yield token
            if token in stops or i + 1 == max_new_tokens:
                return
            if cache.length == recompute_at:
                logits = _recompute(model, ids, cache)
            else:
                logits = model.decode(np.array([[token]], np.int32), cache)[0, -1]


def generate(model: Any, prompt_ids: npt.ArrayLike, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | np.random.Generator | None = None,
             stop_ids: Iterable[int] | None = None, tokenizer: Any = None,
             repetition_penalty: float | None = None,
             min_p: float | None = None) -> npt.NDArray[np.int32]:
    """The ids a language model writes after prompt_ids: int32 (n,), n <=
    max_new_tokens.

    prompt_ids: integer ids (at least one).  Each new token costs one position
    of work: the keys and values of every position seen stay in the model's
    cache (``model.make_cache``, ``model.decode``).  temperature 0 is greedy
    (argmax); otherwise each id is drawn from softmax(logits / temperature),
    cut to the top_k most likely ids and to the smallest set whose probability
    reaches top_p and to the ids at least min_p times as likely as the
    likeliest (llama.cpp's min-p), with a generator from seed (the same seed
    gives the same ids).  repetition_penalty (> 0; 1 or None: off) divides the
    positive logits, and multiplies the negative ones, of every id already in
    the prompt or the reply (Hugging Face's and llama.cpp's penalty).  Generation stops after max_new_tokens, or after an id of stop_ids
    (which is returned).  stop_ids None (the default) stops at the end-of-generation
    ids (``eog_ids``, llama.cpp's EOG set: eos, eot, ``<|im_end|>``,
    ``<|eot_id|>`` ...) of tokenizer when one is given (one without ``eog_ids``:
    its eos, ``eos_id`` or transformers' ``eos_token_id``, and the model's), else
    of the model (``load_gguf`` gives a model its tokenizer's, ``load_hf`` its
    generation_config's eos_token_id); ``stop_ids=()`` never stops
    early.  The prompt and the new tokens must fit the model's
    max_seq_len (ValueError before any work); an id outside the vocabulary is an
    IndexError.  ``stream`` gives the same ids one by one.
    """
    return np.fromiter(stream(model, prompt_ids, max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids,
                              tokenizer=tokenizer, repetition_penalty=repetition_penalty,
                              min_p=min_p),
                       dtype=np.int32)


# chat's reply length when not given (within the model's context)
CHAT_MAX_NEW_TOKENS = 256


def chat(model: Any, tokenizer: Any, messages: Any, max_new_tokens: int | None = None, *,
         template_kwargs: dict[str, Any] | None = None, **sampling: Any) -> str:
    """The model's reply to a conversation, as text.

    messages: a list of dicts with ``role`` and ``content``.  They are rendered
    by the tokenizer's chat template with the generation prompt
    (``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``),
    the reply is generated until one of the tokenizer's end-of-generation ids
    (``eog_ids``) or max_new_tokens, and decoded without its special tokens
    (max_new_tokens None: 256, or as many as the model's context leaves after
    the prompt when fewer; a number that overruns the context is refused).
    sampling: generate's options (temperature, top_k, top_p, min_p,
    repetition_penalty, seed, stop_ids).  template_kwargs: further template
    variables, as transformers' apply_chat_template takes them (Qwen3's
    ``enable_thinking``; ``continue_final_message``: the reply goes on from the
    last message, an assistant's prefilled start, with no generation prompt).
    A BOS is put first when the tokenizer says so (add_bos) and the template
    did not write one.  A transformers tokenizer works too: its
    BatchEncoding's input_ids, its eos_token_id and the model's eog_ids as the
    stops, its decode(skip_special_tokens=True).
    """
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise TypeError(f"template_kwargs: expected a dict or None, got "
                        f"{type(template_kwargs).__name__}")
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer: expected a tokenizer with a chat template "
                        f"(apply_chat_template), got {type(tokenizer).__name__}")
    if "add_generation_prompt" in (template_kwargs or {}):
        raise ValueError("template_kwargs: add_generation_prompt is chat's own (a reply "
                         "always follows the generation prompt); pass "
                         "continue_final_message=True to go on from an assistant's message")
    # continue_final_message: the model goes on with the last (assistant) message
    continues = bool((template_kwargs or {}).get("continue_final_message"))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=not continues,
                                        **(template_kwargs or {}))
    if isinstance(ids, Mapping):   # transformers' tokenizers give a BatchEncoding
        ids = ids["input_ids"]
    ids = np.asarray(ids, np.int32)
    bos = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos", False) and bos is not None and (ids.size == 0
                                                                      or ids[0] != bos):
        ids = np.concatenate([[bos], ids]).astype(np.int32)
    sampling.setdefault("tokenizer", tokenizer)
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    if limit is not None and ids.size > limit:
        raise ValueError(f"messages: the conversation's {ids.size} tokens exceed the model's "
                         f"max_seq_len={limit}; shorten it")
    if max_new_tokens is None:
        if limit is not None and ids.size >= limit:
            raise ValueError(f"messages: the conversation's {ids.size} tokens fill the model's "
                             f"max_seq_len={limit}, leaving no room for a reply; shorten it")
        max_new_tokens = CHAT_MAX_NEW_TOKENS if limit is None else \
            min(CHAT_MAX_NEW_TOKENS, limit - ids.size)
    reply = generate(model, ids, max_new_tokens, **sampling)
    stops = _stop_ids(sampling.get("stop_ids"), sampling["tokenizer"], model)   # generate's
    if reply.size and int(reply[-1]) in stops:
        reply = reply[:-1]
    # transformers' decode takes any keyword and names its flag skip_special_tokens:
    # skip_special would pass unnoticed, the end-of-turn tokens left in the reply
    if "skip_special_tokens" in _parameters(tokenizer.decode):
        return tokenizer.decode(reply, skip_special_tokens=True)
    try:
        return tokenizer.decode(reply, skip_special=True)
    except TypeError:   # a tokenizer whose decode has no skip_special
        return tokenizer.decode(reply)


def _parameters(function) -> Mapping[str, Any]:
    """function's parameters by name (none when its signature cannot be read)."""
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
