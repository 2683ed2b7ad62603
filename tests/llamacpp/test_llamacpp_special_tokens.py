"""Special tokens as llama.cpp tokenizes them, on every vocabulary llama.cpp ships
(GGMLOPT_LLAMA_CPP_SRC): chat-formatted text with the vocabulary's own control
and user-defined tokens and the end-of-generation texts llama.cpp makes control
tokens whatever the file says ("</s>", "<|endoftext|>"...), whitespace around
them (Phi-3's special tokens drop the whitespace after them), parsed as special
and not: ggmlopt's ids are llama.cpp's."""
import warnings

import pytest
from llama_cpp_source import SRC, vocabulary

from ggmlopt.text import EOG_TEXTS, TOKEN_CONTROL, TOKEN_USER_DEFINED

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")
# WordPiece (bert types) has no special-token partition of this kind in llama.cpp's tests
VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "qwen35", "gemma-4", "command-r",
          "deepseek-llm", "gpt-2", "starcoder", "falcon", "mpt"]


def _specials(tok, most=6):
    """A few of the vocabulary's control and user-defined tokens and every
    end-of-generation text it holds."""
    control = [t for t, k in zip(tok.tokens, tok.token_types) if k == TOKEN_CONTROL]
    user = [t for t, k in zip(tok.tokens, tok.token_types) if k == TOKEN_USER_DEFINED]
    eog = [t for t in sorted(EOG_TEXTS) if tok.token_to_id(t) is not None]
    return [t for t in dict.fromkeys(control[:most] + user[:most] + eog) if t.strip()]


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_and_the_whitespace_beside_them(name):
    path, tok = vocabulary(name)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    specials = _specials(tok)
    assert specials
    texts = []
    for i, s in enumerate(specials):
        t = specials[(i + 1) % len(specials)]
        texts += [f"{s}\nHi there{t}\n", f"a{s} b  {t}\t\nc", f"{s}{t}  x", f"x {s}"]
    for text in texts:
        for special in (True, False):
            want = llm.tokenize(text.encode(), add_bos=False, special=special)
            got = tok.encode(text, parse_special=special).tolist()
            assert got == want, (name, text, special)


EOG_VOCABS = ["aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon",
              "gemma-4", "gpt-2", "gpt-neox", "llama-bpe", "llama-spm", "mpt", "phi-3",
              "qwen2", "qwen35", "refact", "starcoder"]


@pytest.mark.parametrize("name", EOG_VOCABS)
def test_end_of_generation_ids_are_llama_cpp_s(name):
    """eog_ids, where generate and chat stop, equal llama.cpp's end-of-generation
    set: eos, eot, the texts it knows, and its fill-in-the-middle pad, repository
    and file-separator tokens (starcoder's <|fim_pad|>, command-r's <PAD> ...)."""
    path, tok = vocabulary(name)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        theirs = {i for i in range(llama_cpp.llama_vocab_n_tokens(vocab))
                  if llama_cpp.llama_vocab_is_eog(vocab, i)}
    finally:
        llama_cpp.llama_model_free(model)
    assert set(tok.eog_ids) == theirs, [tok.id_to_token(i) for i in set(tok.eog_ids) ^ theirs]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2"])
@pytest.mark.parametrize("add_eos", [True, False])
def test_a_document_is_tokenized_with_llama_cpps_bos_and_eos(name, add_eos):
    """document_ids (llama-finetune's text file, a text JSONL row) puts the BOS and
    the EOS where llama.cpp's tokenize with its special tokens does, the file's
    tokenizer.ggml.add_eos_token deciding the EOS."""
    from ggmlopt.instruct import document_ids
    from ggmlopt.io.gguf_llama import tokenizer_from_fields
    from ggmlopt.io.gguf_reader import GgufFile
    path, _ = vocabulary(name)
    fields = dict(GgufFile(path).fields)
    fields["tokenizer.ggml.add_eos_token"] = add_eos
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = tokenizer_from_fields(fields, path)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False,
                          kv_overrides={"tokenizer.ggml.add_eos_token": add_eos})
    for text in ["Hello world", " leading space", "two\nlines"]:
        want = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert document_ids(tok, text).tolist() == want, (name, text)


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_that_overlap_are_cut_longest_first(name):
    # llama.cpp's partition cuts the longest special token out first, wherever it
    # is: where a shorter one ends inside it (falcon's ">>TITLE<<" then
    # "<|endoftext|>"), the leftmost match would take the shorter one
    from ggmlopt.text import _leftmost_can_differ
    path, tok = vocabulary(name)
    texts = [tok.tokens[i] for i in tok._control + tok._user if tok.tokens[i]]
    pairs = [(a, b, i) for a in texts for b in texts for i in range(1, len(a))
             if _leftmost_can_differ([a, b]) and b.startswith(a[i:])][:40]
    if not pairs:
        pytest.skip(f"{name}: no special tokens overlap")
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    for a, b, i in pairs:
        for text in (a[:i] + b, f"x {a[:i]}{b} {a}"):
            want = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert tok.encode(text, parse_special=True).tolist() == want, (name, text)


def test_non_ascii_spaces_before_deepseek_llm_punctuation():
    # llama.cpp matches deepseek-llm's patterns without a \p class with every
    # non-ASCII space turned into \v: an ideographic space is not in the CJK
    # punctuation class there
    path, tok = vocabulary("deepseek-llm")
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    for text in ("  \u3000", "\t \u3000", "a\u3000\u3001!", "\u3000\u3000x", "\xa0\u3000。",
                 "x \u3000 y\u2003\u3000"):
        want = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert tok.encode(text, parse_special=False).tolist() == want, repr(text)


def _made_vocabulary(tmp_path, tok, name):
    """tok written into a GGUF (a one-layer model of its size), read back, and
    llama.cpp's tokenizer of the same file."""
    from ggmlopt.io import load_gguf_tokenizer, save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    path = str(tmp_path / f"{name}.gguf")
    save_gguf(Llama(LlamaConfig(vocab_size=len(tok.tokens), dim=32, n_layers=1, n_heads=2,
                                max_seq_len=64)), path, tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = load_gguf_tokenizer(path)
    return back, llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


@pytest.mark.parametrize("specials", [["ééé<", "<abcde"], ["xyz<", "‹éé"], ["<cd", "ab<"]])
def test_the_partition_orders_special_tokens_by_bytes_then_ids(tmp_path, specials):
    # llama.cpp sorts its special tokens by text.size(), UTF-8 bytes, ties keeping
    # their id order: "ééé<" (7 bytes) goes before "<abcde" (6)
    from ggmlopt.io._gguf_tokenizer import BYTE_MERGES, byte_vocabulary
    from ggmlopt.text import BPETokenizer
    vocab = byte_vocabulary() + specials
    types = [1] * 256 + [3] * (1 + len(specials))   # the bytes, then <|endoftext|> and ours
    tok = BPETokenizer(vocab, list(BYTE_MERGES), token_types=types, eos_id=256)
    back, llm = _made_vocabulary(tmp_path, tok, "bytes")
    a, b = specials
    for text in (a + b[1:], a[:-1] + b, f"x {a}{b} y", a + b, b + a):
        want = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert back.encode(text, parse_special=True).tolist() == want, (specials, text)


def test_a_sentencepiece_vocabulary_cuts_overlapping_specials_longest_first(tmp_path):
    # a piece with a space inside ("x▁y") sends SentencePiece through the tokenizers
    # library's whole-text path, whose added tokens match leftmost
    from ggmlopt.spm import SPMTokenizer
    space = "\u2581"
    chars = [space] + list("abcdefghijklmnopqrstuvwxyzT<>|")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + \
        ["x" + space + "y", ">>T<<", "<|endoftext|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(chars) + [1, 3, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(chars))] + [-100.0, 0.0, 0.0]
    tok = SPMTokenizer(tokens, scores, types, bos_id=1, eos_id=2, unk_id=0)
    back, llm = _made_vocabulary(tmp_path, tok, "spm")
    for text in (">>T<<|endoftext|>", "ab >>T<<|endoftext|> c", "ab >>T<< c <|endoftext|> xy"):
        want = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert back.encode(text, parse_special=True).tolist() == want, text


def _special_ids(path):
    """llama.cpp's special ids of a file, and its named chat templates."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        ids = {n: getattr(llama_cpp, f"llama_vocab_{n}")(vocab)
               for n in ("bos", "eos", "eot", "pad", "nl")}
    finally:
        llama_cpp.llama_model_free(model)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    named = {k: v for k, v in llm.metadata.items() if k.startswith("tokenizer.chat_template.")}
    return ids, named


@pytest.mark.parametrize("name", ["qwen2", "phi-3", "command-r", "deepseek-coder", "starcoder"])
def test_a_vocabulary_written_with_another_model_keeps_its_special_ids(tmp_path, name):
    """save_gguf of a model built from a config (nothing carried from a file) with
    the tokenizer read from llama.cpp's vocabulary: llama.cpp reads the same
    special ids from both files (the padding id too) and the same named
    templates (Command R's tool_use and rag)."""
    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    path, tok = vocabulary(name)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2,
                              max_seq_len=32), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(model, tmp_path / "w.gguf", tokenizer=tok)
    assert _special_ids(tmp_path / "w.gguf") == _special_ids(path)


@pytest.mark.parametrize("name", VOCABS)
def test_perplexity_tokenizes_a_text_as_llama_perplexity(name):
    """lm.perplexity(model, text, n_ctx, tokenizer=tok) reads the text as
    llama-perplexity does: common_tokenize(text, add_special=true, parse_special
    false), so BOS and EOS as the vocabulary adds them, a special token written in
    the text read as text."""
    from ggmlopt.lm import _text_ids
    path, tok = vocabulary(name)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    specials = _specials(tok, most=2)
    text = f"{specials[0]} Once upon a time,\n  there was {specials[-1]} a fox."
    want = llm.tokenize(text.encode(), add_bos=True, special=False)
    assert _text_ids(tok, text).tolist() == want, name
