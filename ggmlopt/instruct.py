"""Instruction data as token windows: conversations and prompt/completion pairs
become int32 inputs and next-token labels, -1 on every position that is not
trained on (the prompt, the user's turns, the padding).

A conversation is rendered once by the tokenizer's chat template and tokenized
once.  The assistant turns are found exactly for any template: the text of the
conversation up to turn i with the generation prompt is where turn i starts,
the text with turn i is where it ends (transformers' way of telling prefixes
apart); a template with ``{% generation %}`` markers gives its spans directly,
as Hugging Face's ``return_assistant_tokens_mask`` does.  A token is trained on
when it lies in a span (the one holding a span's first character through the
one holding its last).  ``Dataset.from_chat`` and ``Dataset.from_completions``
call these.
"""
from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._args import bool_arg, int_arg
from .chat_template import check_messages
from .nn.positions import mark_document_starts
from .text import check_text

__all__ = ["TOO_LONG", "TRAIN_ON", "chat_windows", "completion_windows", "document_ids",
           "pack_examples", "read_jsonl", "sharegpt_messages", "text_windows", "token_offsets"]

TRAIN_ON = ("assistant", "last", "all")
TOO_LONG = ("error", "drop", "truncate")


def token_offsets(tokenizer, ids: np.ndarray) -> np.ndarray:
    """int64 (n + 1,): the byte offset of each token in the text's UTF-8 (the
    tokenizer's ``token_bytes``), and the total last."""
    lengths = [len(tokenizer.token_bytes(int(i))) for i in ids]
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def _byte_span(text: str, start: int, end: int) -> tuple[int, int]:
    return len(text[:start].encode("utf-8")), len(text[:end].encode("utf-8"))


def _spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]],
                   own_ends: np.ndarray | None = None) -> np.ndarray:
    """Which tokens are trained on: from the token holding a span's first byte to
    the one holding its last (transformers' char_to_token on both ends).  At the
    span's start, the tokens that spell nothing there come with it: a space
    prefix the text does not hold (Phi-3's '▁' before an answer's digit),
    the leading byte pieces of a character split in several tokens; they are the
    first the model must write.  own_ends (each token's offset plus its own
    spelling's length, where known): a token whose own text ends before the span
    and holds it only by whitespace it swallowed (a special token's rstrip) is
    the prompt's, not the answer's."""
    n = offsets.size - 1
    mask = np.zeros(n, bool)
    for start, end in spans:
        if end <= start:
            continue
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, end - 1, side="right")) - 1
        while 0 < first < n and offsets[first] == start and offsets[first - 1] == start:
            first -= 1
        if own_ends is not None and 0 <= first < last and offsets[first] < start \
                and own_ends[first] <= start:
            first += 1
        if 0 <= first < n:
            mask[first:min(last, n - 1) + 1] = True
    return mask


def _own_ends(tokenizer, ids, offsets) -> np.ndarray | None:
    """Each token's offset plus the length of its own spelling: token_bytes', or
    the vocabulary's text (a special token's exactly; an ordinary one's at least
    its bytes, U+2581 and GPT-2's byte letters being longer), None without either."""
    if callable(getattr(tokenizer, "token_bytes", None)):
        lengths = [len(tokenizer.token_bytes(int(i))) for i in ids]
    elif callable(getattr(tokenizer, "id_to_token", None)):
        lengths = [len(tokenizer.id_to_token(int(i)).encode("utf-8")) for i in ids]
    else:
        return None
    return offsets[:-1] + np.asarray(lengths, np.int64)


def _eog_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's end-of-generation tokens, longest first."""
    texts = set()
    for i in getattr(tokenizer, "eog_ids", ()):
        if callable(getattr(tokenizer, "id_to_token", None)):
            text = tokenizer.id_to_token(int(i))
        elif callable(getattr(tokenizer, "token_bytes", None)):
            text = tokenizer.token_bytes(int(i)).decode("utf-8", "replace")
        else:
            continue   # a tokenizer that cannot spell it: no end-of-turn rule
        if text:
            texts.add(text)
    return tuple(sorted(texts, key=lambda t: (-len(t), t)))


def _content_end(text: str, start: int, stop: int, message, eog_texts=(),
                 others=()) -> int:
    """Where message's content, as the template wrote it at the start of its turn
    (text[start:], after whitespace or a header of the template's own), ends
    before stop: its text, stripped, or its answer after a reasoning block; start
    where none is found there.  An end-of-generation token's text inside a reply
    is the reply's, not the end of its turn.  (The same words further on, a later
    turn's, are not this turn's end: a header holds no end-of-generation text
    and no later message's content.)"""
    content = message.get("content")
    if not isinstance(content, str):
        return start
    for piece in (content, content.strip(), content.rpartition("</think>")[2].strip()):
        at = text.find(piece, start, stop) if piece else -1
        if at >= 0 and _a_header(text[start:at], eog_texts, others):
            return at + len(piece)
    return start


def _a_header(text: str, eog_texts, others) -> bool:
    """Whether text, found between a turn's start and its content, is what the
    template writes there (whitespace, gpt-oss' <|channel|>final<|message|>, a
    closed think block) and not the end of the turn and the messages after it."""
    if not text.strip():
        return True
    return not any(e in text for e in eog_texts) and not any(o in text for o in others)


def _later_contents(messages, i) -> list[str]:
    """The stripped, non-empty contents of the messages after messages[i] (those
    before it are all in the text before its turn, never in its header)."""
    out = []
    for m in messages[i + 1:]:
        content = m.get("content")
        if isinstance(content, str) and content.strip():
            out.append(content.strip())
    return out


def _turn_end(text: str, start: int, end: int, last: bool, eog_texts,
              content_end: int | None = None) -> int:
    """Where an assistant turn rendered as text[start:end] ends in the whole text:
    with the end-of-generation token a template writes only when another message
    follows (Apertus' <|assistant_end|>), and, for the conversation's last turn,
    without what a template appends after the last message whatever it is (Command
    R7B's next turn header after the final end-of-turn token), looked for after
    the message's content (content_end, default start)."""
    if not last:
        for eog in eog_texts:
            if text.startswith(eog, end):
                return end + len(eog)
        return end
    best = -1
    after = start if content_end is None else max(start, content_end)
    for eog in eog_texts:
        at = text.rfind(eog, after, end)
        if at >= 0 and at + len(eog) > best:
            best = at + len(eog)
    if best > 0 and text[best:end].strip():
        return best
    return end


def _assistant_spans(template, messages, train_on, kwargs,
                     eog_texts: tuple[str, ...] = (), tokenizer=None
                     ) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of the turns trained on); tokenizer (as
    _turn_start's) places a turn that does not begin with the generation prompt."""
    if train_on == "all":
        text = template.render(messages, False, **kwargs)
        _check_system_written(messages, text)
        return text, [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("has no assistant message to train on")
    if train_on == "last":
        turns = turns[-1:]
    # a turn's "weight" (OpenAI's fine-tuning files, axolotl's ShareGPT): 0 keeps it
    # out of the loss, as those trainers do; read, not passed over silently
    turns = [i for i in turns if _turn_weight(messages[i], i)]
    if not turns:
        raise ValueError("has no assistant message to train on: every one it would train "
                         "on has 'weight' 0")
    if template.has_generation_markers:
        text, spans = template.render_spans(messages, False, **kwargs)
        _check_system_written(messages, text)
        marked = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(spans) > len(marked):
            spans = _joined(spans)
        if len(spans) != len(marked):
            raise ValueError(f"the template's {{% generation %}} blocks ({len(spans)}) are not "
                             f"one per assistant message ({len(marked)})")
        return text, [spans[marked.index(i)] for i in turns]
    text = template.render(messages, False, **kwargs)
    _check_system_written(messages, text)
    spans = []
    moved = None   # _turns_in_order's finds, made when a turn needs them
    for i in turns:
        before = _before_turn(template, messages, i, kwargs, text)
        through = template.render(messages[:i + 1], False, **kwargs)
        others = _later_contents(messages, i)
        if through.startswith(before) and text.startswith(through):
            content_end = _content_end(text, len(before), len(through), messages[i],
                                       eog_texts, others)
            spans.append((len(before), _turn_end(text, len(before), len(through),
                                                 i == len(messages) - 1, eog_texts,
                                                 content_end)))
            continue
        # a turn rendered otherwise when another message follows it (Qwen3 drops an
        # earlier turn's reasoning, Phi-3.5 ends the conversation with its EOS): in
        # the whole text it runs from the generation prompt through its end-of-turn
        # token and the line break after it (what a turn renders when it is last)
        start = _turn_start(template, messages, i, kwargs, before, text, tokenizer)
        content_end = _content_end(text, start, len(text), messages[i], eog_texts, others)
        end = _first_eog(text, content_end, eog_texts) if start >= 0 else -1
        after = messages[i + 1].get("content") if i + 1 < len(messages) else None
        if isinstance(after, str) and after.strip() and end >= 0:
            # the next message found before that end-of-turn token: the token is
            # the next message's, this turn has none of its own (the same words
            # inside this turn's own content are its own)
            at = text.find(after.strip(), content_end, end)
            if at >= 0 and at + len(after.strip()) <= end:
                end = -1
        while 0 <= end < len(text) and text[end] in "\r\n":
            end += 1
        if start < 0:
            # the messages before the turn render otherwise once more follow (Mistral
            # Nemo writes the system prompt and the tools into the last user message
            # only): the turn is found as it renders last, in the order of the messages
            moved = _turns_in_order(template, messages, text, kwargs) if moved is None \
                else moved
            if i in moved:
                start, stop = moved[i]
                content_end = _content_end(text, start, stop, messages[i], eog_texts, others)
                end = _turn_end(text, start, stop, i == len(messages) - 1, eog_texts,
                                content_end)
        if end < 0:
            raise ValueError(f"the chat template renders message {i} differently depending on "
                             "what follows it, so its assistant text cannot be told apart; use "
                             "a template with {% generation %} markers or train_on='all'")
        spans.append((start, end))
    return text, spans


def _before_turn(template, messages, i: int, kwargs, text: str) -> str:
    """The text before assistant turn i: the messages before it rendered with the
    generation prompt.  A conversation that opens with the assistant (a greeting)
    has no messages before its first turn, and most templates refuse an empty
    conversation (Qwen2.5's and Llama 3's read messages[0]): there it is the text
    of that turn alone up to where its content begins (the last place it is
    found: a default system prompt before it may hold the same words)."""
    try:
        return template.render(messages[:i], True, **kwargs)
    except ValueError:
        if i != 0:
            raise
        alone = template.render(messages[:1], False, **kwargs)
        content = messages[0].get("content")
        for piece in ((content, content.strip()) if isinstance(content, str) else ()):
            at = alone.rfind(piece) if piece else -1
            if at >= 0 and text.startswith(alone[:at]):
                return alone[:at]
        raise ValueError("opens with an assistant message whose text the chat template "
                         "does not write as given, and the template refuses the empty "
                         "conversation before it: its span cannot be found; start the "
                         "conversation with a system or user message") from None


def _check_system_written(messages, text: str) -> None:
    """ValueError when the template leaves a system message's text out of the
    conversation's: nothing would train with it."""
    content = messages[0].get("content") if messages[0]["role"] == "system" else None
    if isinstance(content, str) and content.strip() and content.strip() not in text:
        raise ValueError("the chat template leaves the system message out of this "
                         "conversation (Mistral Nemo's writes it into the last message only "
                         "when that is the user's, so never into a conversation that ends "
                         "with an answer): nothing would train with it; give its text in "
                         "the first user message, or leave it out")


def _turns_in_order(template, messages, text: str, kwargs) -> dict[int, tuple[int, int]]:
    """{i: (start, end)} of assistant turns i in text, each where the text it
    renders after the generation prompt as the last message is found after the
    turns and the contents of the user and tool messages before it (not the
    system message's: a template may write it elsewhere); the first turn not so
    found and those after it are left out."""
    found: dict[int, tuple[int, int]] = {}
    at = 0
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            before = template.render(messages[:k], True, **kwargs)
            through = template.render(messages[:k + 1], False, **kwargs)
            piece = through[len(before):] if through.startswith(before) else ""
        elif m["role"] != "system" and isinstance(m.get("content"), str):
            piece = m["content"].strip()
        else:
            continue
        start = text.find(piece, at) if piece or m["role"] != "assistant" else -1
        if start < 0:
            break
        at = start + len(piece)
        if m["role"] == "assistant":
            found[k] = (start, at)
    return found


def _turn_weight(message, i: int) -> int:
    """An assistant message's 'weight': 1 (trained, also when absent) or 0."""
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise ValueError(f"message {i}: 'weight' must be 0 (not trained on) or 1, "
                         f"got {weight!r}")
    return int(weight)


def _turn_start(template, messages, i, kwargs, before: str, text: str, tokenizer=None) -> int:
    """Where assistant turn i starts in text: after the generation prompt
    (before ends with it), or, for a template whose rendered turns do not begin
    with its whole generation prompt (DeepSeek-R1's and QwQ's open a reasoning
    block there, '<think>\\n', that a finished turn does not hold), where the
    two part, once the messages before the turn are all behind (or where the
    turn's content begins, when they part inside it); -1 when they part before
    that (the template renders the earlier messages otherwise).  With a
    tokenizer that spells its tokens, where they part is taken back to the end
    of the last token both tokenizations share: Qwen3's generation prompt
    without thinking ends in '<think>\\n\\n</think>\\n\\n', and a finished
    tool call or empty reply begins with a '<' too, of '<tool_call>' or
    '<|im_end|>', that is the reply's."""
    if text.startswith(before):
        return len(before)
    history = template.render(messages[:i], False, **kwargs)
    if not (text.startswith(history) and before.startswith(history)):
        return -1
    start = len(history)
    while start < min(len(before), len(text)) and before[start] == text[start]:
        start += 1
    if start > len(history) and tokenizer is not None and _spells_its_tokens(tokenizer):
        # parting inside a token (the '<' of the prompt's '<think>' and of a reply's
        # '<tool_call>'): the reply starts after the last token the two share
        start = max(len(history), _token_start(tokenizer, before, text, start))
    # the two may part a few characters into the reply, where it begins as the rest
    # of the generation prompt does ('<' of Gemma 4's '<|channel>' and of a reply's
    # '<think>'): the reply is the turn's from its first character
    content = messages[i].get("content")
    if isinstance(content, str):
        for piece in (content, content.strip()):
            at = text.find(piece, len(history)) if piece else -1
            if 0 <= at < start and at + len(piece) > start:
                start = at
                break
    warnings.warn(f"the chat template's generation prompt ends in "
                  f"{before[start:][:40]!r}, which its rendering of a finished assistant "
                  f"turn does not hold: the turns are trained from where the two part, "
                  f"after {before[max(len(history), start - 40):start]!r}, as the template "
                  f"writes them (at inference the generation prompt adds that text)",
                  UserWarning, stacklevel=5)
    return start


def _token_start(tokenizer, before: str, text: str, at: int) -> int:
    """Where the tokens of before and of text stop being the same, as a
    character offset (at most at, which is where their characters part): the
    end of the last token both begin with, at itself where the tokens cannot
    be placed."""
    try:
        a_ids, a_offsets = _ids_and_offsets(tokenizer, before, "text")
        b_ids, b_offsets = _ids_and_offsets(tokenizer, text, "text")
    except ValueError:
        return at
    n = min(a_ids.size, b_ids.size)
    same = (a_ids[:n] == b_ids[:n]) & (a_offsets[1:n + 1] == b_offsets[1:n + 1])
    k = int(np.argmin(np.append(same, False)))   # the tokens before k are the same
    byte_end = min(int(a_offsets[k]), len(before[:at].encode("utf-8")))
    # back to the character holding that byte
    chars = np.cumsum([0] + [len(c.encode("utf-8")) for c in before[:at]])
    return int(np.searchsorted(chars, byte_end, side="right")) - 1


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """spans with those that touch joined: one turn's text marked in two blocks
    (TRL's Phi-3.5 training template marks the final EOS in a block of its own)."""
    out = [spans[0]]
    for start, end in spans[1:]:
        if start == out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _first_eog(text: str, start: int, eog_texts) -> int:
    """The end of the first end-of-generation text in text from start on, -1
    without one."""
    found = [(at, -len(eog)) for eog in eog_texts if (at := text.find(eog, start)) >= 0]
    if not found:
        return -1
    at, negative_length = min(found)
    return at - negative_length


def _windows(examples: list[tuple[np.ndarray, np.ndarray]], n_ctx: int, pad_id: int,
             too_long: str, what: str, packing: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int32 (n, n_ctx) from (ids, trained mask) examples: inputs
    ids[:-1], labels ids[1:] where the next token is trained on, -1 elsewhere;
    one example a row, or several with packing (see pack_examples)."""
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    long = []
    for k, (ids, mask) in enumerate(examples):
        if ids.size - 1 > n_ctx:
            long.append((k, ids.size))
            if too_long == "drop":
                continue
            if too_long == "truncate":
                ids, mask = ids[:n_ctx + 1], mask[:n_ctx + 1]
        kept.append((ids, mask))
    if long and too_long == "error":
        k, size = long[0]
        raise ValueError(f"{what}[{k}]: {size} tokens, more than n_ctx + 1 = {n_ctx + 1} "
                         f"({len(long)} of {len(examples)} examples are too long); raise n_ctx, "
                         "or pass too_long='drop' or 'truncate'")
    if long:
        warnings.warn(f"{what}: {len(long)} of {len(examples)} examples are longer than n_ctx "
                      f"+ 1 = {n_ctx + 1} tokens and were "
                      f"{'dropped' if too_long == 'drop' else 'cut to that length'}",
                      UserWarning, stacklevel=4)
    pairs = [(ids[:-1].astype(np.int32), np.where(mask[1:], ids[1:], -1).astype(np.int32))
             for ids, mask in kept]
    trained = [bool((y >= 0).any()) for _, y in pairs]
    if not all(trained):
        # a cut can leave an example's trained turns beyond n_ctx: it would teach nothing
        warnings.warn(f"{what}: {trained.count(False)} examples have no trained token within "
                      f"n_ctx = {n_ctx} and were left out", UserWarning, stacklevel=4)
        pairs = [p for p, t in zip(pairs, trained) if t]
    if not pairs:
        raise ValueError(f"{what}: no example left to train on")
    rows = pack_examples([x.size for x, _ in pairs], n_ctx) if packing else \
        [[k] for k in range(len(pairs))]
    x = np.full((len(rows), n_ctx), pad_id, np.int32)
    y = np.full((len(rows), n_ctx), -1, np.int32)
    starts = np.zeros((len(rows), n_ctx), bool)
    for r, members in enumerate(rows):
        at = 0
        for k in members:
            inputs, labels = pairs[k]
            x[r, at:at + inputs.size] = inputs
            y[r, at:at + inputs.size] = labels
            starts[r, at] = True
            at += inputs.size
        if packing and at < n_ctx:
            starts[r, at] = True   # the padding is a document of its own
    if packing:
        x = mark_document_starts(x, starts)
    return x, y


def pack_examples(lengths: Sequence[int], n_ctx: int) -> list[list[int]]:
    """Which examples share a window: best-fit decreasing (the longest first,
    each into the fullest window it still fits, among equally full ones the one
    that came to that room first: TRL's "bfd"), every length <= n_ctx.  Returns
    the windows' example indices, each in the examples' order."""
    import bisect
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    # (room left, when it was left with that room, window), sorted: of the windows
    # with the least room that fits, the one that came to it first, as TRL's
    # per-room queues take them (so the same examples share a window as there)
    free: list[tuple[int, int, int]] = []
    windows: list[list[int]] = []
    for step, k in enumerate(order):
        n = int(lengths[k])
        if not 0 < n <= n_ctx:
            raise ValueError(f"lengths[{k}]: expected 1 .. n_ctx={n_ctx} tokens, got {n}")
        i = bisect.bisect_left(free, (n, -1, -1))
        if i == len(free):
            windows.append([k])
            room, w = n_ctx - n, len(windows) - 1
        else:
            room, _, w = free.pop(i)
            windows[w].append(k)
            room -= n
        if room:
            bisect.insort(free, (room, step, w))
    return [sorted(w) for w in windows]


def _wants_bos(tokenizer, ids) -> bool:
    """Whether ids (a document's first tokens) need the tokenizer's BOS before
    them: its add_bos says so (llama.cpp's tokenizer.ggml.add_bos_token, or the
    Hugging Face tokenizer's) and they do not start with it already."""
    bos = getattr(tokenizer, "bos_id", None)
    return bool(getattr(tokenizer, "add_bos", False)) and bos is not None \
        and (len(ids) == 0 or int(ids[0]) != bos)


def document_ids(tokenizer, text: str, *, eos: bool | None = None,
                 parse_special: bool | None = None) -> np.ndarray:
    """text's ids as a document the model reads whole: BOS first when the
    tokenizer's add_bos says so, EOS last when its add_eos does (SEP when a
    WordPiece tokenizer's add_sep does), as llama.cpp tokenizes a text with its
    special tokens and llama-finetune its text file; eos=True or False asks for
    the EOS or not (nor SEP) whatever add_eos says; int32.
    Special tokens written in the text are read as the tokenizer's encode reads
    them by default (a BOS written first is that one BOS); parse_special=False
    reads them as text, as llama-finetune reads its file (common_tokenize's
    default), True as control tokens."""
    if parse_special is None:
        ids = np.asarray(tokenizer.encode(text), np.int32)
    elif not takes_parse_special(tokenizer):   # the Tokenizer protocol's encode(text)
        raise TypeError(f"parse_special: {type(tokenizer).__name__}.encode takes no "
                        f"parse_special flag")
    else:
        ids = np.asarray(tokenizer.encode(text, parse_special=bool(parse_special)), np.int32)
    if _wants_bos(tokenizer, ids):
        ids = np.concatenate([[tokenizer.bos_id], ids])
    asked = eos
    if eos is None:
        eos = bool(getattr(tokenizer, "add_eos", False))
    if eos and tokenizer.eos_id is not None:
        ids = np.concatenate([ids, [tokenizer.eos_id]])
    elif asked is None and getattr(tokenizer, "add_sep", False):
        # WordPiece: llama.cpp closes a text with SEP whenever it adds its special tokens
        ids = np.concatenate([ids, [tokenizer.sep_id]])
    return ids.astype(np.int32)


def _spells_its_tokens(tokenizer) -> bool:
    """Whether tokens can be placed in the text by their bytes (ggmlopt's tokenizers)."""
    return callable(getattr(tokenizer, "encode_with_offsets", None)) or \
        callable(getattr(tokenizer, "token_bytes", None))


def takes_parse_special(tokenizer) -> bool:
    """Whether tokenizer.encode takes a parse_special flag (ggmlopt's tokenizers;
    the ggmlopt.text.Tokenizer protocol's encode(text) need not).  Asked of the
    signature, not by catching a TypeError, which would hide the encoder's own."""
    try:
        return "parse_special" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):   # a callable without a signature
        return False


def _encode(tokenizer, text: str) -> np.ndarray:
    """text's int32 ids, special tokens parsed where the tokenizer takes the flag."""
    if takes_parse_special(tokenizer):
        return np.asarray(tokenizer.encode(text, parse_special=True), np.int32)
    return np.asarray(tokenizer.encode(text), np.int32)


def _ids_and_offsets(tokenizer, text: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """text's ids (special tokens parsed, as transformers tokenizes a rendered
    chat) and each token's byte offset, the text's length last."""
    if callable(getattr(tokenizer, "encode_with_offsets", None)):
        # SentencePiece: a space prefix the text does not hold
        ids, offsets = tokenizer.encode_with_offsets(text, parse_special=True)
    else:
        ids = _encode(tokenizer, text)
        offsets = token_offsets(tokenizer, ids)
    if offsets[-1] != len(text.encode("utf-8")):
        raise ValueError(f"{where}: the tokenizer's tokens do not spell the text byte for "
                         "byte; its masks cannot be placed")
    return np.asarray(ids, np.int32), offsets


def _common_args(tokenizer, n_ctx, too_long, packing):
    if isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None)):
        # (a str has an encode method too: a model name given for the tokenizer)
        raise TypeError(f"tokenizer: expected a ggmlopt tokenizer, got {type(tokenizer).__name__}")
    if not isinstance(packing, bool):
        raise TypeError(f"packing: expected a bool, got {type(packing).__name__}")
    n_ctx = int_arg(n_ctx, "n_ctx", 1)
    if too_long not in TOO_LONG:
        raise ValueError(f"too_long: expected one of {TOO_LONG}, got {too_long!r}")
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    return n_ctx, int(pad)


def _row_template_kwargs(row: Mapping, template_kwargs: dict[str, Any], where: str
                         ) -> dict[str, Any]:
    """The template variables for one row: the call's, then the row's ``tools``
    and ``chat_template_kwargs`` over them, as TRL's SFTTrainer passes a dataset's
    columns to apply_chat_template."""
    kwargs = dict(template_kwargs)
    tools = row.get("tools")
    if isinstance(tools, str):
        # a JSON string, as TRL's datasets may store the column (SFTTrainer decodes it)
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ValueError(f"{where}: 'tools' is a string that is not JSON ({e})") from None
    if tools is not None:
        if not isinstance(tools, list):
            raise TypeError(f"{where}: 'tools' must be a list of tool definitions (or its "
                            f"JSON text), got {type(tools).__name__}")
        kwargs["tools"] = tools
    extra = row.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"{where}: 'chat_template_kwargs' must be a dict, got "
                            f"{type(extra).__name__}")
        kwargs.update(extra)
    return kwargs


def chat_windows(conversations: Iterable, tokenizer, n_ctx: int, *, train_on: str = "assistant",
                 too_long: str = "error", packing: bool = False, **template_kwargs: Any
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int32 (n, n_ctx) of conversations (lists of messages, or
    dicts with ``messages`` (or ShareGPT's ``conversations``: sharegpt_messages)
    and, as TRL's datasets have them, the row's own
    ``tools`` and ``chat_template_kwargs``, which take precedence over the
    call's template_kwargs), labels on the trained turns: train_on "assistant"
    (every assistant turn), "last" (the last one) or "all" (every token); an
    assistant message with "weight" 0 (OpenAI's files) is left out of the first two.
    packing: several conversations a window, marked as ggmlopt.nn.positions
    says."""
    n_ctx, pad = _common_args(tokenizer, n_ctx, too_long, packing)
    for name in ("template_kwargs", "chat_template_kwargs"):
        # (ggmlopt.chat's and a row's spelling: as a variable the template would not
        # read it, and the data would render otherwise than chat renders the prompt)
        if name in template_kwargs:
            raise TypeError(f"{name}: the template variables are keywords here "
                            f"(from_chat(..., enable_thinking=False)), or a row's "
                            f"'chat_template_kwargs'; not a dict named {name}")
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on: expected one of {TRAIN_ON}, got {train_on!r}")
    eog_texts = _eog_texts(tokenizer)
    examples = []
    unwritten = []   # conversations with tool calls their template leaves out
    unstopped = []   # conversations whose last trained answer is followed by no stop token
    if isinstance(conversations, (str, Mapping)) or not isinstance(conversations, Iterable):
        raise TypeError(f"conversations: expected a list of conversations, got "
                        f"{type(conversations).__name__}")
    for k, conversation in enumerate(conversations):
        kwargs = template_kwargs
        if isinstance(conversation, Mapping):
            # a row's own tools and template variables (TRL's dataset columns)
            kwargs = _row_template_kwargs(conversation, template_kwargs, f"conversations[{k}]")
            if "messages" not in conversation and "conversations" in conversation:
                conversation = sharegpt_messages(conversation["conversations"],
                                                 f"conversations[{k}]")
            else:
                conversation = conversation.get("messages")
        tools = kwargs.get("tools")
        template = tokenizer.compiled_chat_template(tools=tools) if tools is not None else \
            tokenizer.compiled_chat_template()
        try:
            messages = check_messages(conversation, f"conversations[{k}]")
            for j, message in enumerate(messages):   # before the template moves them
                if isinstance(message.get("content"), str):
                    check_text(message["content"], f"conversations[{k}][{j}]['content']")
            text, spans = _assistant_spans(template, messages, train_on, kwargs, eog_texts,
                                           tokenizer)
        except (ValueError, TypeError) as e:
            # (a TypeError: the template met a content it cannot render, e.g. None)
            msg = str(e)
            if isinstance(e, TypeError) and not msg.startswith("conversations["):
                msg = f"the chat template failed on it ({msg}): is every 'content' a str?"
            raise type(e)(msg if msg.startswith("conversations[")
                          else f"conversations[{k}]: {msg}") from None
        if train_on != "all" and _drops_tool_calls(messages, train_on, text, spans):
            unwritten.append(k)
        if _teaches_no_stop(text, spans, messages, train_on, eog_texts):
            unstopped.append(k)
        ids, offsets = _ids_and_offsets(tokenizer, text, f"conversations[{k}]")
        byte_spans = [_byte_span(text, a, b) for a, b in spans]
        mask = _spans_to_mask(offsets, byte_spans, _own_ends(tokenizer, ids, offsets))
        # BOS first when the tokenizer's add_bos says so and the template did not
        # write it: what ggmlopt.chat and llama.cpp feed the model at inference
        if _wants_bos(tokenizer, ids):
            ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
            mask = np.concatenate([[False], mask])
        examples.append((ids, mask))
    if not examples:
        raise ValueError("conversations: expected at least one conversation")
    if unwritten:
        # SmolLM3's template writes no tool call: such a turn would teach an empty reply
        warnings.warn(f"conversations: in {len(unwritten)} conversation(s) (the first: "
                      f"conversations[{unwritten[0]}]) an assistant turn's tool_calls are not "
                      "in what the chat template writes for it, so they are not trained on; "
                      "the template does not render tool calls (its own, or the row's "
                      "'tools', may be needed)", UserWarning, stacklevel=2)
    if unstopped:
        # Apertus, GLM-4: the end-of-turn token is written only when another message follows
        warnings.warn(f"conversations: in {len(unstopped)} conversation(s) (the first: "
                      f"conversations[{unstopped[0]}]) the last message, an assistant answer "
                      "trained on, is followed by no end-of-generation token "
                      f"({', '.join(eog_texts[:4])}): the chat template writes none after the "
                      "last message, so the model is not taught to stop; end those answers' "
                      "content with one (its text is read as the token)", UserWarning,
                      stacklevel=2)
    return _windows(examples, n_ctx, pad, too_long, "conversations", packing)


def _teaches_no_stop(text: str, spans, messages, train_on: str, eog_texts) -> bool:
    """Whether the conversation's last message is an assistant answer trained on
    (the last span) with no end-of-generation token after its content in that
    span: the template writes one only when another message follows."""
    last = messages[-1]
    content = last.get("content")
    if not eog_texts or not spans or last.get("role") != "assistant" or \
            not isinstance(content, str) or \
            (train_on != "all" and not _turn_weight(last, len(messages) - 1)):
        return False
    a, b = spans[-1]
    piece = content.strip()
    # the first place: a short answer ("end") is in the end-of-turn token's text too
    at = text.find(piece, a, b) if piece else -1
    after = at + len(piece) if at >= 0 else a
    return not any(e in text[after:b] or piece.endswith(e) for e in eog_texts)


def _drops_tool_calls(messages, train_on, text: str, spans) -> bool:
    """Whether a trained assistant turn has tool calls whose function names are
    not in its span of text (the template leaves them out)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    turns = [i for i in turns if messages[i].get("weight", 1)]   # as _assistant_spans
    for i, (start, end) in zip(turns, spans):
        calls = messages[i].get("tool_calls")
        if not isinstance(calls, (list, tuple)):
            continue
        for call in calls:
            function = call.get("function", call) if isinstance(call, Mapping) else None
            name = function.get("name") if isinstance(function, Mapping) else None
            if isinstance(name, str) and name and name not in text[start:end]:
                return True
    return False


def completion_windows(pairs: Iterable, tokenizer, n_ctx: int, *, too_long: str = "error",
                       add_eos: bool = True, packing: bool = False
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int32 (n, n_ctx) of (prompt, completion) pairs (tuples, or
    dicts with ``prompt`` and ``completion``), tokenized as one text, prompt +
    completion, as TRL's SFTTrainer does (a SentencePiece space prefix or a merge
    is what the whole text gives, not what the completion alone would), with the
    loss on the tokens that spell the completion, which ends with the tokenizer's
    eos (unless add_eos is False or it already does); BOS first when the
    tokenizer's add_bos says so and the text does not start with it.  A token
    holding the prompt's last bytes and the completion's first (``"A: " +
    "Paris"`` as ``"ĠParis"``) is trained on, and counted in a UserWarning (TRL
    warns of the same mismatch).  packing: as chat_windows'.

    A pair whose prompt and completion are lists of messages (TRL's conversational
    prompt/completion rows, with the row's ``tools`` and ``chat_template_kwargs``)
    is rendered by the tokenizer's chat template as TRL's SFTTrainer tokenizes it:
    the ids of prompt + completion, the loss on those after the prompt's own ids
    rendered with the generation prompt (its completion_mask); the template writes
    the turn's end, so add_eos adds nothing to it.  Where the prompt's ids are not
    the first ids of the whole, TRL warns and trains from where the two part (TRL
    1.16; older versions masked by position, training the wrong tokens): such a
    row is refused.  Rows of both kinds may be mixed."""
    n_ctx, pad = _common_args(tokenizer, n_ctx, too_long, packing)
    add_eos = bool_arg(add_eos, "add_eos")
    if isinstance(pairs, (str, bytes, Mapping)) or not isinstance(pairs, Iterable):
        raise TypeError(f"pairs: expected a list of (prompt, completion) pairs, got "
                        f"{type(pairs).__name__}")
    examples = []
    straddling = 0
    for k, pair in enumerate(pairs):
        if isinstance(pair, Mapping):
            prompt, completion = pair.get("prompt"), pair.get("completion")
        elif isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2:
            prompt, completion = pair
        else:
            raise TypeError(f"pairs[{k}]: expected (prompt, completion) or a dict with "
                            f"'prompt' and 'completion', got {type(pair).__name__}")
        if _a_message_list(prompt) and _a_message_list(completion):
            examples.append(_conversational_pair(pair, prompt, completion, tokenizer,
                                                 f"pairs[{k}]"))
            continue
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise TypeError(f"pairs[{k}]: prompt and completion must both be str, or both "
                            f"lists of messages (TRL's conversational form), got "
                            f"{type(prompt).__name__} and {type(completion).__name__}")
        check_text(prompt, f"pairs[{k}] prompt")
        check_text(completion, f"pairs[{k}] completion")
        text = prompt + completion
        if _spells_its_tokens(tokenizer):
            ids, offsets = _ids_and_offsets(tokenizer, text, f"pairs[{k}]")
            start, end = _byte_span(text, len(prompt), len(text))
            mask = _spans_to_mask(offsets, [(start, end)], _own_ends(tokenizer, ids, offsets))
            trained = np.flatnonzero(mask)
            straddles = bool(trained.size) and offsets[trained[0]] < start
        else:   # a tokenizer of encode alone: the prompt's ids as a prefix (TRL's test)
            ids, head = _encode(tokenizer, text), _encode(tokenizer, prompt)
            same = int(np.argmin(np.append(ids[:head.size] == head[:ids.size], False)))
            mask = np.arange(ids.size) >= same
            straddles = same < head.size
        straddling += straddles
        if _wants_bos(tokenizer, ids):
            ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
            mask = np.concatenate([[False], mask])
        eos = tokenizer.eos_id
        if add_eos and eos is not None and (not mask.any() or int(ids[-1]) != eos):
            ids = np.concatenate([ids, [eos]]).astype(np.int32)
            mask = np.concatenate([mask, [True]])
        if not mask.any():
            raise ValueError(f"pairs[{k}]: the completion is empty")
        examples.append((ids, mask))
    if straddling:
        warnings.warn(f"pairs: in {straddling} example(s) a token holds the end of the prompt "
                      "and the start of the completion (tokenized together, they merge); it "
                      "is trained on with the completion", UserWarning, stacklevel=3)
    if not examples:
        raise ValueError("pairs: expected at least one (prompt, completion) pair")
    return _windows(examples, n_ctx, pad, too_long, "pairs", packing)


def _a_message_list(value) -> bool:
    """Whether value is a conversational prompt or completion: a list (not a text)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _conversational_pair(row, prompt, completion, tokenizer, where: str
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained mask) of a pair of message lists, as TRL's SFTTrainer tokenizes
    it: apply_chat_template(prompt + completion) and, trained on, the ids after
    those of apply_chat_template(prompt, add_generation_prompt=True), each with
    the row's tools and chat_template_kwargs."""
    kwargs = _row_template_kwargs(row, {}, where) if isinstance(row, Mapping) else {}
    messages = {}
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not value:
            raise ValueError(f"{where}: the {name} is an empty list of messages")
        messages[name] = check_messages(value, f"{where} {name}")
        for j, message in enumerate(messages[name]):
            if isinstance(message.get("content"), str):
                check_text(message["content"], f"{where} {name}[{j}]['content']")
    try:
        tools = kwargs.get("tools")
        template = tokenizer.compiled_chat_template(tools=tools) if tools is not None else \
            tokenizer.compiled_chat_template()
    except (AttributeError, ValueError):
        raise ValueError(f"{where}: a prompt and completion of messages are rendered by "
                         "the tokenizer's chat template, and it has none (give one: "
                         "tokenizer.chat_template = '...jinja...')") from None
    try:
        head_text = template.render(messages["prompt"], True, **kwargs)
        text = template.render(messages["prompt"] + messages["completion"], False, **kwargs)
    except (ValueError, TypeError) as e:
        # (a TypeError: the template met a content it cannot render, e.g. None)
        raise type(e)(f"{where}: the chat template failed on it ({e})") from None
    head, ids = _encode(tokenizer, head_text), _encode(tokenizer, text)
    if head.size > ids.size or not np.array_equal(ids[:head.size], head):
        # TRL warns and masks the first len(head) ids all the same: here that would
        # train on the prompt's tokens or leave the completion's out
        same = int(np.argmin(np.append(ids[:head.size] == head[:ids.size], False)))
        raise ValueError(f"{where}: the prompt's ids rendered with the generation prompt "
                         f"are not the first ids of prompt + completion (they part at id "
                         f"{same}: the template renders the prompt's end {head_text[-40:]!r} "
                         f"otherwise once the completion follows), so the completion's "
                         "tokens cannot be told apart; give the row as "
                         "{'messages': prompt + completion} (Dataset.from_chat)")
    mask = np.arange(ids.size) >= head.size
    if not mask.any():
        raise ValueError(f"{where}: the completion is empty (the chat template writes "
                         "nothing for it)")
    if _wants_bos(tokenizer, ids):   # as chat_windows: one BOS, never trained on
        ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
        mask = np.concatenate([[False], mask])
    return ids, mask


def text_windows(texts: Iterable, tokenizer, n_ctx: int, *, too_long: str = "error",
                 add_eos: bool = True, packing: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int32 (n, n_ctx) of texts (str, or dicts with ``text``: TRL's
    and MLX-LM's language-modelling rows), each its own document, trained on
    whole: BOS first where the tokenizer adds it (never a target), the text's
    tokens (special tokens parsed, as transformers tokenizes a row), then the eos
    unless add_eos is False.  A text longer than n_ctx + 1 tokens is too_long's
    (as chat_windows'); packing: as chat_windows'.  An empty text (no token) is
    a ValueError naming its row, whatever add_eos says."""
    n_ctx, pad = _common_args(tokenizer, n_ctx, too_long, packing)
    add_eos = bool_arg(add_eos, "add_eos")
    if isinstance(texts, (str, bytes, Mapping)) or not isinstance(texts, Iterable):
        raise TypeError(f"texts: expected a list of texts, got {type(texts).__name__}")
    examples = []
    for k, row in enumerate(texts):
        text = row.get("text") if isinstance(row, Mapping) else row
        if not isinstance(text, str):
            raise TypeError(f"texts[{k}]: expected a str or a dict with a str 'text', got "
                            f"{type(text).__name__}")
        check_text(text, f"texts[{k}]")
        ids = _encode(tokenizer, text)
        if ids.size == 0:
            # before the BOS and EOS: a row of them alone would teach "stop at once"
            raise ValueError(f"texts[{k}]: the text is empty (it has no token)")
        mask = np.ones(ids.size, bool)
        if _wants_bos(tokenizer, ids):
            ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
            mask = np.concatenate([[False], mask])
        eos = tokenizer.eos_id
        if add_eos and eos is not None and (ids.size == 0 or int(ids[-1]) != eos):
            ids = np.concatenate([ids, [eos]]).astype(np.int32)
            mask = np.concatenate([mask, [True]])
        examples.append((ids, mask))
    if not examples:
        raise ValueError("texts: expected at least one text")
    return _windows(examples, n_ctx, pad, too_long, "texts", packing)


# ---- JSONL files as TRL and MLX-LM write them ----------------------------------------

_FORMATS = {"messages": "chat", "conversations": "chat", "prompt": "completions",
            "text": "text"}
# ShareGPT's speakers ("from") as the chat template's roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant", "tool": "tool",
                  "function_response": "tool", "observation": "tool"}


def sharegpt_messages(turns, where: str = "conversations") -> list[dict[str, Any]]:
    """ShareGPT's turns (``[{"from": "human", "value": ...}, ...]``) as chat
    messages (``{"role": "user", "content": ...}``; SHAREGPT_ROLES maps the
    speakers).  ValueError naming the turn for another form or speaker."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of "
                         "{'from', 'value'} turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("value"), str) \
                or not isinstance(turn.get("from"), str):
            raise ValueError(f"{where}: turn {i} must be an object with a str 'from' and a "  # noqa: TRY004
                             f"str 'value' (ShareGPT's form), got {turn!r}")
        role = SHAREGPT_ROLES.get(turn["from"].strip().lower())
        if role is None:
            raise ValueError(f"{where}: turn {i} is from {turn['from']!r}; ShareGPT's "
                             f"speakers read are {sorted(SHAREGPT_ROLES)}")
        message = {"role": role, "content": turn["value"]}
        if "weight" in turn:   # axolotl's ShareGPT: 0 leaves the turn out of the loss
            message["weight"] = turn["weight"]
        messages.append(message)
    return messages


def read_jsonl(path) -> list[dict[str, Any]]:
    """The examples of a JSON Lines file, one JSON object a line (blank lines
    skipped), in the forms TRL and MLX-LM read: ``{"messages": [{"role": ...,
    "content": ...}, ...]}`` (chat; ShareGPT's ``{"conversations": [{"from":
    "human", "value": ...}, ...]}`` too, read as messages: sharegpt_messages),
    ``{"prompt": ..., "completion": ...}`` (completions: two strings, or two lists of
    messages, TRL's conversational form) or ``{"text": ...}``;
    every line of one form.  Returns the objects as dicts.  ValueError naming the line (1-based) for invalid JSON, an
    object of none of the forms, a malformed message or a mix of forms;
    FileNotFoundError for a missing file."""
    import json
    import os
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such file {path!r}")
    examples: list[dict[str, Any]] = []
    form = None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                # (a byte-order mark before the first line, as some editors save UTF-8)
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of "
                                 "the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            kind = _example_form(obj, where)
            if "conversations" in obj:   # ShareGPT's rows, as the messages they are
                rest = {k: v for k, v in obj.items() if k != "conversations"}
                obj = {**rest, "messages": sharegpt_messages(obj["conversations"], where)}
            if form is None:
                form = kind
            elif kind != form:
                raise ValueError(f"{where}: a {kind} example in a file of {form} examples")
            examples.append(obj)
    if not examples:
        raise ValueError(f"path: {path!r} holds no example")
    return examples


def _example_form(obj, where: str) -> str:
    if not isinstance(obj, dict):
        # a line of the file, not an argument
        raise ValueError(f"{where}: expected a JSON object, got "  # noqa: TRY004
                         f"{type(obj).__name__}")
    kinds = [k for k in _FORMATS if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: expected one of the keys 'messages' (or ShareGPT's "
                         f"'conversations'), 'prompt' (with 'completion') or 'text', got "
                         f"{sorted(obj)}")
    key = kinds[0]
    if key == "conversations":
        sharegpt_messages(obj["conversations"], where)
    elif key == "messages":
        _check_jsonl_messages(obj["messages"], where, "messages")
    elif key == "prompt":
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if isinstance(prompt, list) and isinstance(completion, list):
            # TRL's conversational prompt/completion: both lists of messages
            _check_jsonl_messages(prompt, where, "prompt")
            _check_jsonl_messages(completion, where, "completion")
        elif not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings, or "
                             "both non-empty lists of messages (TRL's conversational form), "
                             f"got {type(prompt).__name__} and {type(completion).__name__}")
    elif not isinstance(obj["text"], str):
        raise ValueError(f"{where}: 'text' must be a string")
    return _FORMATS[key]


def _check_jsonl_messages(messages, where: str, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: '{key}' must be a non-empty list")
    for i, m in enumerate(messages):
        # an assistant's tool calls may stand without a content (OpenAI's form)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or ("content" not in m and "tool_calls" not in m):
            what = "message" if key == "messages" else f"{key} message"
            raise ValueError(f"{where}: {what} {i} must be an object with a str 'role' "
                             f"and a 'content' (or 'tool_calls'), got {m!r}")
