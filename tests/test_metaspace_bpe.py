"""MetaspaceBPETokenizer (llama.cpp's gemma4 vocabulary type) on a small vocabulary
built here: the ids equal a plain implementation of llama.cpp's algorithm (spaces
as U+2581, lines and newline runs as words, merges by rank over characters, byte
fallback), the word-at-a-time path equals the library on whole texts (a token that
joins a character to a following U+2581 included), decode gives the text back,
and a GGUF file keeps the type.  llama.cpp's own vectors for Gemma 4's vocabulary
are checked in test_tokenizer_vectors.py."""
import random
import re

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from ggmlopt.metaspace_bpe import SPACE, MetaspaceBPETokenizer, word_pattern

BYTES = [f"<0x{b:02X}>" for b in range(256)]
MERGES = [f"{SPACE} t", "h e", f"{SPACE}t he", "> " + SPACE, "< /", f">{SPACE} </",
          f"{SPACE} {SPACE}", "l l", "he ll", "\n \n"]
CHARS = list("abcdehlorstwxy<>/.,!?\n") + [SPACE]
SPECIAL = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|\"|>"]


def _vocabulary():
    """(tokens, merges, types): specials, the byte tokens, characters, merge results."""
    merged = [left + right for left, right in (m.split(" ") for m in MERGES)]
    tokens = SPECIAL + BYTES + CHARS + merged
    types = [3, 3, 3, 3, 4] + [6] * 256 + [1] * (len(CHARS) + len(merged))
    return tokens, MERGES, types


def _tokenizer():
    tokens, merges, types = _vocabulary()
    return MetaspaceBPETokenizer(tokens, merges, token_types=types, bos_id=0, eos_id=1)


def _reference(tokens, merges, text):
    """llama.cpp's gemma4 BPE (llm_tokenizer_bpe_session), written plainly: spaces
    escaped, words by [^\\n]+|[\\n]+, the lowest-ranked adjacent pair merged first
    (leftmost on a tie), a final symbol the vocabulary lacks as its bytes' tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    out = []
    for word in re.findall(r"[^\n]+|[\n]+", text.replace(" ", SPACE)):
        if not word.strip("\n") and word in ids:
            out.append(ids[word])
            continue
        symbols = list(word)
        while len(symbols) > 1:
            pairs = [(rank.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            pairs = [p for p in pairs if p[0] is not None]
            if not pairs:
                break
            _, i = min(pairs)
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            if s in ids:
                out.append(ids[s])
            else:
                out += [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def _texts(count, seed):
    rng = random.Random(seed)
    alphabet = list("the hello world  \n\n<>/ .,!? x") + [
        "> </", ">  </", SPACE, "é", "中", "🙂", "\t", "<|turn>", "<turn|>", "<|\"|>", "<eos>"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 120)))
            for _ in range(count)] + ["", " ", "\n", "a> </b", "x>" + SPACE + "</y", " the  the"]


def test_equals_llama_cpps_algorithm_written_plainly():
    tok = _tokenizer()
    tokens, merges, _ = _vocabulary()
    user = tokens.index('<|"|>')
    for text in _texts(300, 0):
        # control tokens stay text; a user-defined one is matched all the same
        want = []
        for i, part in enumerate(text.split('<|"|>')):
            want += ([user] if i else []) + _reference(tokens, merges, part)
        assert tok.encode(text, parse_special=False).tolist() == want, repr(text)


def test_special_tokens_in_the_text_become_their_ids():
    tok = _tokenizer()
    tokens, merges, _ = _vocabulary()
    got = tok.encode("<|turn>user\nhello<turn|>", parse_special=True).tolist()
    want = [2] + _reference(tokens, merges, "user\nhello") + [3]
    assert got == want
    # user-defined ones always, control ones only with parse_special
    assert tok.encode('<|"|>', parse_special=False).tolist() == [4]
    assert tok.encode("<eos>", parse_special=False).tolist() != [1]


def test_a_token_across_a_space_is_kept_by_the_word_cuts():
    tok = _tokenizer()
    assert tok._words is not None
    joined = tok.token_to_id(f">{SPACE}</")
    assert joined in tok.encode("a> </b").tolist()
    # the words: a run of spaces after '>' stays with it
    assert re.findall(word_pattern(">"), "a> </b c") == ["a> </b", " c"]
    assert re.findall(word_pattern(""), "a> </b c") == ["a>", " </b", " c"]


def test_word_by_word_equals_the_library_on_whole_texts():
    tok = _tokenizer()
    for parse in (True, False):
        for text in _texts(300, 1 + parse):
            assert tok.encode(text, parse_special=parse).tolist() == \
                tok._library_encode(tok._tk, text, parse).ids, repr(text)


def test_decode_gives_the_text_back():
    tok = _tokenizer()
    for text in _texts(200, 5):
        ids = tok.encode(text, parse_special=True)
        assert tok.decode(ids) == text.replace(SPACE, " ")
    ids = tok.encode("é")
    assert ids.tolist() == [tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    assert b"".join(tok.token_bytes(i) for i in ids) == "é".encode()
    assert tok.token_bytes(tok.token_to_id(f"{SPACE}the")) == b" the"


def test_a_gguf_file_keeps_the_vocabulary_type(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf
    from ggmlopt.io.gguf_reader import GgufFile
    from ggmlopt.models import Llama, LlamaConfig
    tok = _tokenizer()
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2,
                              ffn_dim=32, max_seq_len=16), seed=0)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    assert GgufFile(tmp_path / "m.gguf").fields["tokenizer.ggml.model"] == "gemma4"
    back = load_gguf_tokenizer(tmp_path / "m.gguf")
    _, again = load_gguf(tmp_path / "m.gguf")
    for t in (back, again):
        assert isinstance(t, MetaspaceBPETokenizer) and t.add_bos
        assert t.tokens == tok.tokens and t.merges == tok.merges
        text = "<|turn>the hello> </world\n\n"
        np.testing.assert_array_equal(t.encode(text), tok.encode(text))
