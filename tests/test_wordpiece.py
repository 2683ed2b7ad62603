"""WordPieceTokenizer (llama.cpp's bert vocabulary type) on a small vocabulary: the
word rules of llama.cpp's WPM preprocess, the greedy longest pieces, the unknown
token, special tokens, decode's clean-up of spaces, and the GGUF keys.
(llama.cpp's own test vectors and texts of every kind: tests/test_tokenizer_vectors.py.)"""
import pytest

from ggmlopt.text import TOKEN_CONTROL, TOKEN_NORMAL
from ggmlopt.wordpiece import WordPieceTokenizer

S = "\u2581"
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", S + "play", "ing", "s", S + "playing",
          S + "the", S + "cafe", S + ",", S + ".", S + "!", S + "'", S + "s", S + "中",
          S + "文", S + "a", "b", S + "\u110b", S + "hello", S + "$", S + "\u00e9t\u00e9",
          S + "ete", S + "x"]
TYPES = [TOKEN_CONTROL] * 4 + [TOKEN_NORMAL] * (len(TOKENS) - 4)


def tok(**kw):
    return WordPieceTokenizer(TOKENS, TYPES, unk_id=1, cls_id=2, sep_id=3, **kw)


def ids(*names):
    return [TOKENS.index(n) for n in names]


@pytest.mark.parametrize("text, words", [
    ("Hello,  World!", ["hello", ",", "world", "!"]),
    ("a\u3000b\u2028c\u00a0d", ["a", "b", "c", "d"]),            # llama.cpp's whitespace
    ("ab\u200bcd\x00e\ufffd", ["abcde"]),                          # dropped inside a word
    ("x$y", ["x", "$", "y"]),                                      # an ASCII symbol alone
    ("x\u20acy", ["x\u20acy"]),                                    # a non-ASCII one is not
    ("\u4e2d\u6587ok", ["\u4e2d", "\u6587", "ok"]),                  # CJK ideographs alone
    ("Caf\u00e9 \u00c9T\u00c9", ["cafe", "ete"]),                    # accents stripped
    ("\uc5b4", ["\u110b"]),          # a Hangul syllable: its first jamo, as llama.cpp's NFD
    ("\u0130", ["i"]),               # U+0130's simple lowercase mapping, one character
])
def test_words_follow_llama_cpp_preprocess(text, words):
    assert tok(lowercase=True).words(text) == words


def test_without_lowercase_nothing_is_folded():
    t = tok(lowercase=False)
    assert t.words("Caf\u00e9 \u00c9T\u00c9!") == ["Caf\u00e9", "\u00c9T\u00c9", "!"]
    assert not t.strip_accents
    assert tok(lowercase=False, strip_accents=True).words("\u00e9t\u00e9") == ["ete"]


def test_the_longest_piece_first_and_unknown_words():
    t = tok(lowercase=True)
    assert t.encode("playing plays", parse_special=False).tolist() == \
        ids(S + "playing", S + "play", "s")
    # no piece starts at "c": the whole word is one [UNK]; the words around it are not
    assert t.encode("the abc the").tolist() == ids(S + "the", "[UNK]", S + "the")
    assert t.encode("ab").tolist() == ids(S + "a", "b")
    assert t.encode("").tolist() == []
    assert t.encode("\u00c9t\u00e9").tolist() == ids(S + "ete")


def test_special_tokens_in_text():
    t = tok(lowercase=True)
    assert t.encode("[CLS] hello[SEP]").tolist() == ids("[CLS]", S + "hello", "[SEP]")
    plain = t.encode("[CLS]", parse_special=False).tolist()
    assert TOKENS.index("[CLS]") not in plain


def test_decode_cleans_spaces_as_llama_cpp():
    t = tok(lowercase=True)
    assert t.decode(ids(S + "hello", S + ",", S + "the", S + "!")) == " hello, the!"
    assert t.decode(ids(S + "play", "ing", S + "'", S + "s")) == " playing's"
    assert t.decode(ids("[CLS]", S + "hello", "[SEP]")) == "[CLS] hello[SEP]"
    assert t.decode(ids("[CLS]", S + "hello", "[SEP]"), skip_special=True) == " hello"
    with pytest.raises(IndexError):
        t.decode([len(TOKENS)])


def test_bad_arguments():
    with pytest.raises(TypeError, match="text"):
        tok().encode(b"bytes")
    with pytest.raises(ValueError, match="token_types"):
        WordPieceTokenizer(TOKENS, TYPES[:-1], unk_id=1)
    with pytest.raises(IndexError, match="unk_id"):
        WordPieceTokenizer(TOKENS, TYPES, unk_id=len(TOKENS))


def test_read_from_a_gguf_as_llama_cpp_reads_it(tmp_path):
    """tokenizer.ggml.model 'bert': the normalizer keys absent mean lowercase and
    strip accents (llama.cpp's defaults); pre 'whitespace' or the key say otherwise."""
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf_tokenizer

    def write(name, **keys):
        w = gguf.GGUFWriter(str(tmp_path / name), "bert")
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre(keys.pop("pre", "bert-bge"))
        w.add_token_list(TOKENS)
        w.add_token_types(TYPES)
        w.add_unk_token_id(1)
        w.add_uint32("tokenizer.ggml.cls_token_id", 0)   # llama.cpp ignores it ...
        w.add_bos_token_id(2)                            # ... and takes CLS from here
        w.add_uint32("tokenizer.ggml.seperator_token_id", 3)   # llama.cpp's spelling
        for key, value in keys.items():
            w.add_bool(f"tokenizer.ggml.normalizer.{key}", value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return load_gguf_tokenizer(tmp_path / name)

    t = write("default.gguf")
    assert isinstance(t, WordPieceTokenizer)
    assert (t.lowercase, t.strip_accents, t.cls_id, t.sep_id, t.unk_id) == (True, True, 2, 3, 1)
    assert t.encode("Playing").tolist() == ids(S + "playing")
    cased = write("cased.gguf", lowercase=False)
    assert (cased.lowercase, cased.strip_accents) == (False, False)
    assert write("ws.gguf", pre="whitespace").lowercase is False


def test_a_document_ends_with_sep_as_llama_cpp_adds_its_special_tokens():
    # llama.cpp's WPM tokenize(add_special) writes CLS first and SEP last; SEP is
    # not an EOS (add_eos stays False), and eos=False leaves it out
    from ggmlopt.instruct import document_ids
    t = tok()
    assert t.add_sep and not t.add_eos
    assert document_ids(t, "the cafe").tolist() == ids("[CLS]", S + "the", S + "cafe", "[SEP]")
    assert document_ids(t, "the cafe", eos=False).tolist() == ids("[CLS]", S + "the", S + "cafe")
