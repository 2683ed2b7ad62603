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
