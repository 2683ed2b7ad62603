"""Special tokens as llama.cpp's vocabulary loader leaves them (llama-vocab.cpp),
whatever the file's token types say: the end-of-generation texts it knows are
control tokens, gpt-oss's channel tokens user-defined, o200k_harmony's <|end|>
and Gemma 4's </s> demoted; Phi-3's special tokens drop the whitespace after
them.  Against llama.cpp itself, on every vocabulary it ships:
tests/llamacpp/test_llamacpp_special_tokens.py."""
import numpy as np
import pytest

from ggmlopt.text import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    llama_cpp_special,
)


def _special(tokens, types, named=()):
    ids = {t: i for i, t in enumerate(tokens)}
    return llama_cpp_special(types, ids, named)


def test_end_of_generation_texts_are_control_tokens_whatever_their_type():
    tokens = ["a", "</s>", "<|endoftext|>", "<|im_end|>", "<x>", "<y>"]
    types = [TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED,
             TOKEN_NORMAL]
    control, user, eog = _special(tokens, types, named=(5, None))
    assert control == {1, 2, 3} and user == {4}
    assert eog == {1, 2, 3, 5}   # and the ids the file names (eos 5)


def test_gpt_oss_harmony_and_gemma4_exceptions():
    tokens = ["<|channel|>", "<|return|>", "<|call|>", "<|end|>", "x"]
    control, user, eog = _special(tokens, [TOKEN_CONTROL] * 4 + [TOKEN_NORMAL])
    assert 0 in user and 0 not in control          # always matched, special or not
    assert 3 not in eog and 3 in user and 3 not in control   # <|end|> ends nothing here
    assert {1, 2} <= eog
    # without the return and call tokens <|end|> ends a turn (Phi-3's)
    control, user, eog = _special(["<|end|>", "x"], [TOKEN_CONTROL, TOKEN_NORMAL])
    assert eog == {0} and control == {0}
    # beside Gemma 4's <|tool_response>, </s> is a normal token
    control, user, eog = _special(["</s>", "<|tool_response>"], [TOKEN_NORMAL, TOKEN_CONTROL])
    assert 0 not in control | user | eog and 1 in control and 1 in eog


SPACE = "\u2581"


def _phi3_fields(name):
    tokens = ["<unk>", "<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>"]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_CONTROL,
             TOKEN_USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TOKEN_BYTE] * 256
    # every character a piece, the longer pieces scored higher (each merge applies)
    words = [SPACE, "H", "i", "Y", "e", "s", ".", "Hi", "es", SPACE + "Hi", "Yes",
             SPACE + "Yes"]
    tokens += words
    types += [TOKEN_NORMAL] * len(words)
    scores = [0.0] * (len(tokens) - len(words)) + [float(len(w)) for w in words]
    return {"general.name": name, "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


@pytest.mark.parametrize("library", [True, False])
def test_phi3_special_tokens_drop_the_whitespace_after_them(library):
    from ggmlopt.io.gguf_llama import tokenizer_from_fields
    if library:
        pytest.importorskip("tokenizers")
    text = "<s><|user|>\n Hi<|end|>\n\t<|assistant|>  Yes.<|end|>\n"
    tight = "<s><|user|>Hi<|end|><|assistant|>Yes.<|end|>"
    phi3 = tokenizer_from_fields(_phi3_fields("Phi-3-mini-4k-instruct"), "f")
    other = tokenizer_from_fields(_phi3_fields("Llama 2 7B"), "f")
    assert phi3.tokens[phi3.encode("<|user|>")[0]] == "<|user|>"
    encode = phi3.encode if library else (
        lambda t, parse_special=True: phi3.encode_with_offsets(t, parse_special=parse_special)[0])
    assert encode(text).tolist() == encode(tight).tolist()
    # unparsed, the control tokens are text, the user-defined ones still strip
    assert encode(text, parse_special=False).tolist() == encode(
        "<s><|user|>Hi<|end|>\n\t<|assistant|>Yes.<|end|>\n", parse_special=False).tolist()
    # <s>, <unk> and <|endoftext|> keep what follows, as does every token of another model
    assert phi3.encode("<s> Hi").tolist() != phi3.encode("<s>Hi").tolist()
    assert other.encode(text).tolist() != phi3.encode(text).tolist()
    # the dropped whitespace is the special token's: offsets still cover the text
    ids, offsets = phi3.encode_with_offsets(text)
    assert offsets[-1] == len(text.encode()) and np.all(np.diff(offsets) >= 0)
    assert ids.tolist() == phi3.encode(text).tolist()


def test_fill_in_the_middle_pad_repo_and_separator_tokens_end_generation():
    """llama.cpp finds a vocabulary's FIM pad, repository and file-separator
    tokens by their text (the first of each kind), makes them control tokens and
    ends generation at them: command-r's <PAD>, starcoder's <|fim_pad|> ..."""
    tokens = ["a", "<PAD>", "<|repo_name|>", "<|file_sep|>", "<|fim_pad|>", "<x>"]
    types = [TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_NORMAL,
             TOKEN_USER_DEFINED]
    control, user, eog = _special(tokens, types)
    # <|fim_pad|> comes first among the pad texts: <PAD> stays what the file says
    assert {2, 3, 4} <= eog and 1 not in eog and 0 not in eog
    assert {2, 3, 4} <= control and user == {1, 5}
    _, _, eog = _special(["a", "<PAD>", "<|END_OF_TURN_TOKEN|>"],
                         [TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_CONTROL], named=(2,))
    assert eog == {1, 2}
