"""ByteTokenizer: UTF-8 bytes as tokens, lossless on any text, invalid UTF-8
replaced on decode, the end-of-text token 256, clear errors."""
import numpy as np
import pytest

from ggmlopt.text import ByteTokenizer, Tokenizer

TEXTS = ["", "a", "hello, world\n", "café naïve Ærø", "日本語のテキスト", "emoji 🦙🚀 and 👩‍👩‍👧",
         "\x00\x01 control\tchars\r\n", "a" * 1000]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_lossless(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert tok.decode(ids) == text


def test_random_unicode_round_trips():
    rng = np.random.default_rng(0)
    tok = ByteTokenizer()
    for _ in range(50):
        cps = rng.integers(1, 0x10FFFF, size=rng.integers(0, 40))
        text = "".join(chr(c) for c in cps if not 0xD800 <= c < 0xE000)
        assert tok.decode(tok.encode(text)) == text


def test_invalid_utf8_is_replaced_and_eos_is_written():
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"          # a cut multi-byte character
    assert tok.decode([104, 105, 256, 104]) == "hi<|endoftext|>h"
    assert tok.decode(np.array([104, 256], np.int64), skip_special=True) == "h"
    assert tok.decode(np.array([], np.int32)) == ""


def test_the_protocol():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (257, 256, None)


def test_bad_input_is_refused():
    tok = ByteTokenizer()
    with pytest.raises(TypeError, match="text: expected a str"):
        tok.encode(b"bytes")
    with pytest.raises(IndexError, match="id 257 at position 1"):
        tok.decode([1, 257])
    with pytest.raises(IndexError, match="id -1 at position 0"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="ids: expected integer"):
        tok.decode([1.5])
    with pytest.raises(ValueError, match=r"ids: expected shape \(n,\)"):
        tok.decode([[1, 2]])
    # a lone surrogate has no UTF-8 bytes; an id past 64 bits is still an id
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at position 1"):
        tok.encode("a\ud800b")
    with pytest.raises(IndexError, match=f"id {2**64} at position 1"):
        tok.decode([1, 2**64])
    with pytest.raises(TypeError, match="skip_special: expected a bool"):
        tok.decode([1], skip_special="no")


# ---- BPETokenizer (the tokenizers extra) ----

def _byte_bpe(**kw):
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary()
    vocab[1] = "he"
    return BPETokenizer(vocab, ["h e"], **kw)


def test_bpe_tokenizer_needs_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"ggmlopt\[tokenizers\]"):
        _byte_bpe()


def test_bpe_tokenizer_encodes_and_decodes():
    pytest.importorskip("tokenizers")
    from ggmlopt.text import Tokenizer
    tok = _byte_bpe(eos_id=256)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.bos_id is None and not tok.add_bos
    ids = tok.encode("the hehe é")
    assert ids.dtype == np.int32
    assert ids.tolist() == [ord("t"), 1, ord(" "), 1, 1, ord(" "), 0xC3, 0xA9]
    assert tok.decode(ids) == "the hehe é"
    assert tok.encode("").shape == (0,)


def test_bpe_tokenizer_refusals():
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match="token_types"):
        _byte_bpe(token_types=[1, 1])
    with pytest.raises(IndexError, match="eos_id"):
        _byte_bpe(eos_id=257)
    with pytest.raises(ValueError, match="merges"):
        from ggmlopt.text import BPETokenizer
        BPETokenizer(["a", "b"], ["ab"])
    # a merge through a symbol the vocabulary lacks (a damaged file): llama.cpp
    # merges through it, the library cannot, so it is refused, not approximated
    with pytest.raises(ValueError, match="'ab c' joins 'ab', which is not in the vocabulary"):
        BPETokenizer(["a", "b", "c", "abc"], ["ab c"])
    with pytest.warns(UserWarning, match="pre-tokenizer 'made-up'"):
        _byte_bpe(pre="made-up")   # every name llama.cpp knows is reproduced
    tok = _byte_bpe()
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\udfffb")
    with pytest.raises(IndexError, match="id 300 at position 1"):
        tok.decode([1, 300])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([[1]])
    with pytest.raises(TypeError, match="ids"):
        tok.decode([1.5])


# ---- special tokens: parsed in text, skipped in decoding, ending generation ----------

def _chat_bpe():
    """GPT-2 bytes plus ChatML's control tokens and one user-defined token, as a
    chat model's GGUF vocabulary marks them (types 3 and 4)."""
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + ["<|im_start|>", "<|im_end|>", "<tool>"]
    vocab[1] = "he"
    types = [1] * 256 + [3, 3, 3, 4]
    return BPETokenizer(vocab, ["h e"], token_types=types, eos_id=258, bos_id=257)


def test_control_tokens_written_in_text_are_parsed_as_their_ids():
    pytest.importorskip("tokenizers")
    tok = _chat_bpe()
    ids = tok.encode("<|im_start|>user\nhe<|im_end|>")
    assert ids.tolist() == [257, *b"user\n", 1, 258]
    # llama.cpp's parse_special=false: control tokens are text, user-defined ones match
    plain = tok.encode("<|im_start|>he<tool>", parse_special=False)
    assert plain.tolist() == [*b"<|im_start|>", 1, 259]
    assert tok.encode("<|im_end|><|im_end|>").tolist() == [258, 258]
    assert tok.token_to_id("<|im_end|>") == 258 and tok.token_to_id("nope") is None
    assert tok.id_to_token(257) == "<|im_start|>"
    with pytest.raises(IndexError, match="token_id"):
        tok.id_to_token(260)


def test_decode_writes_or_skips_control_tokens():
    pytest.importorskip("tokenizers")
    tok = _chat_bpe()
    ids = tok.encode("<|im_start|>assistant\nhi é<|im_end|><tool>")
    assert tok.decode(ids) == "<|im_start|>assistant\nhi é<|im_end|><tool>"
    # skip_special drops control tokens, keeps user-defined ones (llama.cpp's rendering)
    assert tok.decode(ids, skip_special=True) == "assistant\nhi é<tool>"
    byte = ByteTokenizer()
    assert byte.decode([104, 256], skip_special=True) == "h"


def test_end_of_generation_ids_are_llama_cpp_s_set():
    pytest.importorskip("tokenizers")
    tok = _chat_bpe()
    # eos (<|im_end|>, 258) and <|endoftext|> (256, known by its text); not <|im_start|>
    assert tok.eog_ids == {256, 258}
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + ["<|eot_id|>", "<|begin_of_text|>"]
    llama3 = BPETokenizer(vocab, ["a 1"], token_types=[1] * 256 + [3, 3, 3], eos_id=256,
                          bos_id=258, eot_id=257)
    assert llama3.eog_ids == {256, 257}
    assert ByteTokenizer().eog_ids == {256}


# ---- SentencePiece (llama.cpp's llama type) ----------------------------------------------

def _spm():
    from ggmlopt.spm import SPMTokenizer
    pieces = ["<unk>", "<s>", "</s>", "<|im_end|>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "h", "e", "l", "o", "he", "ll", "hell", "\u2581hello", "\u2581h", "w", "hello"]
    scores = [0.0] * 260 + [-1, -2, -2, -2, -2, -3, -4, -5, -1, -6, -2, -0.5]
    types = [2, 3, 3, 3] + [6] * 256 + [1] * 12
    return SPMTokenizer(pieces, scores, types, bos_id=1, eos_id=2, unk_id=0)


def test_spm_merges_by_score_with_byte_fallback_and_the_space_prefix():
    tok = _spm()
    # "▁hello": the space prefix, then the best-scoring pairs: he, ll, hell, hello, ▁hello
    ids = tok.encode("hello")
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello"]
    ids = tok.encode("hello w!")
    # "!" is in no piece: its byte; "▁w" is not a piece: "▁" then "w"
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581", "w", "<0x21>"]
    assert tok.decode(ids) == "hello w!"
    ids = tok.encode("hell</s>he")   # after a special token the space prefix comes again
    # (▁hell is no piece: ▁ and hell; ▁h scores below he)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581", "hell", "</s>", "\u2581", "he"]
    assert tok.decode(ids, skip_special=True) == "hell he"
    assert tok.eog_ids == {2, 3}
    é = tok.encode("é")
    assert [tok.id_to_token(i) for i in é] == ["\u2581", "<0xC3>", "<0xA9>"]
    assert tok.decode(é) == "é"


def test_spm_byte_tokens_that_are_no_character_give_one_replacement_each():
    # transformers' ByteFallback decoder: a reply cut inside a character (F0 9F of
    # an emoji) keeps one U+FFFD a byte, where Python's decode would give one
    tok = _spm()
    smile = tok.encode("he\U0001F600")
    cut = smile[:-2]   # the emoji's last two bytes missing
    assert [tok.id_to_token(i) for i in cut[-2:]] == ["<0xF0>", "<0x9F>"]
    assert tok.decode(cut) == "he\ufffd\ufffd"
    assert tok.decode(smile) == "he\U0001F600"
    # a run of byte tokens is read whole, as that decoder reads it: a character's
    # bytes right after the broken ones are in the run too
    assert tok.decode(np.concatenate([cut, tok.encode("é")[1:]])) == "he" + "\ufffd" * 4
    assert tok.decode(np.concatenate([cut, tok.encode("hello")])) == "he\ufffd\ufffd hello"
    # the first token's space goes after the run is read: a <0x20> in a broken run
    # is one of its U+FFFD (transformers strips after ByteFallback), in a whole one it goes
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in (0x20, 0x61, 0xD3)}
    assert tok.decode([byte[0x20], byte[0xD3]]) == "\ufffd\ufffd"
    assert tok.decode([byte[0x20], byte[0x61]]) == "a"


# ---- llama.cpp's special tokens beyond the types: unknown ones, fill-in-the-middle ---------

def test_an_unknown_type_token_is_matched_and_skipped_as_a_control_one():
    # llama.cpp's special partition and token_to_piece treat <unk> (and Phi-3's
    # [PAD...] tokens, type 2) as control tokens
    tok = _spm()
    ids = tok.encode("hello<unk>hello", parse_special=True)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "<unk>", "\u2581hello"]
    assert tok.decode(ids, skip_special=True) == "hello hello"
    assert 0 not in tok.encode("hello<unk>hello", parse_special=False)


def test_fill_in_the_middle_tokens_are_control_tokens_that_end_nothing():
    pytest.importorskip("tokenizers")   # BPETokenizer runs on the library
    # DeepSeek Coder's file types them user-defined: llama.cpp finds them by their
    # text and makes them control (matched only with parse_special, skipped in text)
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    fim = ["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"]
    vocab = byte_vocabulary() + fim
    tok = BPETokenizer(vocab, ["a 1"], token_types=[1] * 256 + [3, 4, 4, 4], eos_id=256)
    text = fim[0] + "def" + fim[1] + "x" + fim[2]
    ids = tok.encode(text, parse_special=True).tolist()
    assert ids[0] == 257 and 258 in ids and ids[-1] == 259
    assert not {257, 258, 259} & set(tok.encode(text, parse_special=False).tolist())
    assert tok.decode(ids, skip_special=True) == "defx"
    assert tok.eog_ids == {256}


def test_a_vocabulary_naming_no_pre_tokenizer_cuts_words_as_llamacpp_default():
    pytest.importorskip("tokenizers")   # BPETokenizer runs on the library
    # llama.cpp's 'default': punctuation runs, GPT-2's words, digit runs, then ASCII
    # digit triples ('1234567' -> 123 456 7, where GPT-2's pattern keeps one word)
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + ["12", "123", "1234"]
    merges = ["1 2", "12 3", "123 4"]
    gpt2 = BPETokenizer(vocab, merges, pre="gpt-2")
    default = BPETokenizer(vocab, merges, pre="default")
    pieces = [default.id_to_token(i) for i in default.encode("1234567")]
    assert pieces == ["123", "4", "5", "6", "7"]
    assert [gpt2.id_to_token(i) for i in gpt2.encode("1234567")] == ["1234", "5", "6", "7"]
    assert [default.id_to_token(i) for i in default.encode("I'm")] == ["I", "'", "m"]


def test_spm_decode_strips_the_first_token_only():
    # llama.cpp and transformers: after a leading BOS the next piece keeps its space
    tok = _spm()
    hello = tok.token_to_id("\u2581hello")
    assert tok.decode([1, hello, hello]) == "<s> hello hello"
    assert tok.decode([hello, hello]) == "hello hello"
    assert tok.decode([1, hello], skip_special=True) == "hello"


def test_bpe_decode_joins_a_character_around_a_skipped_control_token():
    pytest.importorskip("tokenizers")   # BPETokenizer runs on the library
    from ggmlopt.io.gguf_llama import byte_vocabulary
    from ggmlopt.text import BPETokenizer
    tok = BPETokenizer(byte_vocabulary() + ["<|x|>"], ["a 1"], token_types=[1] * 256 + [3, 3],
                       eos_id=256)
    e_acute = list(tok.encode("\u00e9"))
    assert len(e_acute) == 2
    ids = [e_acute[0], 257, e_acute[1]]
    assert tok.decode(ids, skip_special=True) == "\u00e9"
    assert tok.decode(ids) == "\ufffd<|x|>\ufffd"


# ---- special ids, flags and templates: checked as they are set --------------------------

def _settable_tokenizers():
    made = [ByteTokenizer(), _spm()]
    try:
        made.append(_byte_bpe())
    except ImportError:   # the tokenizers extra
        pass
    return made


def test_special_ids_flags_and_templates_are_checked_as_they_are_set():
    # set late (TRL's eos_token=, a pad token), read much later: a bad value is refused
    # where it is set, and the tokenizer keeps what it had
    for tok in _settable_tokenizers():
        n = tok.vocab_size
        before = (tok.eos_id, tok.add_eos, tok.chat_template)
        tok.named_chat_templates = {"tool_use": "{{ tools }}"}
        for value, error in [(n, IndexError), (-1, IndexError), ("27", TypeError),
                             (True, TypeError), (2.0, TypeError)]:
            with pytest.raises(error, match="eos_id"):
                tok.eos_id = value
        with pytest.raises(TypeError, match="add_eos"):
            tok.add_eos = "no"
        with pytest.raises(TypeError, match="chat_template"):
            tok.chat_template = 3
        assert (tok.eos_id, tok.add_eos, tok.chat_template) == before
        assert tok.named_chat_templates == {"tool_use": "{{ tools }}"}
        tok.pad_id = np.int64(n - 1)           # a NumPy integer is an id
        assert tok.pad_id == n - 1 and type(tok.pad_id) is int
        if tok.eos_id is not None:
            tok.add_eos = True
            with pytest.raises(ValueError, match="eos_id: None, but add_eos"):
                tok.eos_id = None
            tok.add_eos = False
        tok.eos_id = None
        assert tok.eos_id is None
        with pytest.raises(ValueError, match="add_eos: True needs an eos_id"):
            tok.add_eos = True
    with pytest.raises(TypeError, match="chat_template"):
        ByteTokenizer(chat_template=b"{{ x }}")
    with pytest.raises(TypeError, match="add_eos"):
        ByteTokenizer(add_eos="no")
