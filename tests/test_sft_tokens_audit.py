"""Tokens on the supervised fine-tuning path, audited against llama.cpp and
transformers on the real vocabularies llama.cpp ships (GGMLOPT_LLAMA_CPP_SRC):
BOS/EOS flags as llama.cpp reads them, one BOS where a chat template writes its
own, control tokens in a user's text read as transformers and llama.cpp read
them, assistant labels equal to transformers' return_assistant_tokens_mask, and
decode equal to transformers' own GGUF tokenizer (byte-fallback pieces, leading
spaces, skip_special_tokens)."""
import random
import warnings

import numpy as np
import pytest
from llama_cpp_source import MODELS, SRC, vocabulary

import ggmlopt as go

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")

# the templates' assistant text marked as TRL's training templates mark it: the
# content and the end-of-turn token, the line break after it left out
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
          "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|eot_id|>' }}"
          "{% endgeneration %}{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
           "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
           "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{% endif %}"
           "{% endfor %}")
# a user's text holding other templates' control tokens, an answer holding one
CHAT = [{"role": "user", "content": "Say <|im_start|> <|eot_id|> </s> <s> [INST] ok"},
        {"role": "assistant", "content": "Sure: <|im_end|> done é 😀"},
        {"role": "user", "content": " next"}, {"role": "assistant", "content": " Yes\n"}]


def _transformers_dir(tok, template, tmp_path):
    """transformers' AutoTokenizer of tok (the files save_hf writes), with template."""
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import hf_tokenizer_files as files
    tok.chat_template = template
    (tmp_path / "tokenizer.json").write_text(files.tokenizer_json(tok), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        files.dumps(files.tokenizer_config(tok, 4096)), encoding="utf-8")
    return transformers.AutoTokenizer.from_pretrained(tmp_path)


def _example(tok, chat):
    """from_chat's ids of chat (the window's inputs and its last label's token) and
    which of them are trained on."""
    x, y = go.instruct.chat_windows([chat], tok, 256)
    rendered = tok.apply_chat_template(chat, tokenize=True).tolist()
    n = len(rendered) + (1 if tok.add_bos and rendered[:1] != [tok.bos_id] else 0)
    ids = x[0][:n - 1].tolist() + rendered[-1:]
    trained = [False] + [bool(t >= 0) for t in y[0][:n - 1]]
    return ids, trained


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "qwen2", "phi-3", "gemma-4",
                                  "command-r", "gpt-2"])
def test_bos_and_eos_flags_are_llama_cpp_s(name):
    llama_cpp = pytest.importorskip("llama_cpp")
    path, tok = vocabulary(name)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        theirs = (bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                  bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
                  llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab))
    finally:
        llama_cpp.llama_model_free(model)
    assert (bool(tok.add_bos), bool(tok.add_eos), tok.bos_id, tok.eos_id) == theirs


@pytest.mark.parametrize("template, name", [(LLAMA3, "llama-bpe"), (MISTRAL, "llama-spm"),
                                            (CHATML, "qwen2"), (CHATML, "llama-spm")])
def test_chat_ids_and_labels_equal_transformers(template, name, tmp_path):
    """One BOS where the template writes it (transformers' apply_chat_template adds
    none; llama.cpp strips the template's when it adds its own), the control tokens
    of the user's text read as special by both, and the trained tokens
    transformers' assistant mask (less the line break after a ChatML turn, which
    TRL's markers leave out)."""
    _, tok = vocabulary(name)
    auto = _transformers_dir(tok, template, tmp_path)
    out = auto.apply_chat_template(CHAT, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    want_ids, want_mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    ids, trained = _example(tok, CHAT)
    if template is CHATML and tok.add_bos:   # a template without {{ bos_token }}: ours first
        assert ids[0] == tok.bos_id
        ids, trained = ids[1:], trained[1:]
    assert ids == want_ids
    assert ids[:2] != [tok.bos_id, tok.bos_id]   # the template's BOS is the one BOS
    assert trained == want_mask
    # the same labels from the template without markers (the prefixes' way), where
    # the line break after a turn's end is the turn's too
    tok.chat_template = template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    plain_ids, plain = _example(tok, CHAT)
    if template is CHATML and tok.add_bos:
        plain_ids, plain = plain_ids[1:], plain[1:]
    assert plain_ids == want_ids
    breaks = [k for k in range(1, len(plain)) if want_mask[k - 1] and not want_mask[k]
              and tok.decode(np.asarray([want_ids[k]], np.int32)) == "\n"]
    assert [k for k in range(len(plain)) if plain[k] != want_mask[k]] == breaks


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "llama-bpe", "qwen2"])
def test_decode_equals_transformers_own_gguf_tokenizer(name):
    """transformers' converter of the GGUF (not ggmlopt's files): byte-fallback
    pieces (invalid UTF-8 as one U+FFFD a byte), SentencePiece's dummy prefix,
    byte-level spaces and skip_special_tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    _, tok = vocabulary(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = transformers.AutoTokenizer.from_pretrained(MODELS,
                                                          gguf_file=f"ggml-vocab-{name}.gguf")
    rng = random.Random(0)
    pieces = [i for i, t in enumerate(tok.tokens) if len(t) == 6 and t.startswith("<0x")]
    samples = [[tok.bos_id, *tok.encode(" Hello  world").tolist()],
               tok.encode("é😀 日本\n x").tolist(), tok.encode("  two").tolist()]
    for _ in range(150):
        pool = pieces if pieces and rng.random() < 0.4 else range(len(tok.tokens))
        samples.append([rng.choice(pool) for _ in range(rng.randrange(1, 6))])
    for ids in samples:
        for skip in (False, True):
            assert tok.decode(np.asarray(ids, np.int32), skip_special=skip) == \
                auto.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "gemma-4"])
def test_a_text_written_with_its_bos_starts_with_one(name):
    """from_texts / from_completions: the BOS written first in the text is the
    one BOS (llama.cpp's tokenize would add a second and warn; the rest of the
    ids are llama.cpp's)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, tok = vocabulary(name)
    bos = tok.id_to_token(tok.bos_id)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    text = f"{bos}Hello <|eot_id|> é 😀"
    want = llm.tokenize(text[len(bos):].encode(), add_bos=True, special=True) + [tok.eos_id]
    x, y = go.instruct.text_windows([text], tok, 64)
    assert x[0][:len(want) - 1].tolist() + [int(y[0][len(want) - 2])] == want
    x, y = go.instruct.completion_windows([(f"{bos}Q: hi", " A: é")], tok, 64)
    want = llm.tokenize(b"Q: hi A: \xc3\xa9", add_bos=True, special=True) + [tok.eos_id]
    assert x[0][:len(want) - 1].tolist() + [int(y[0][len(want) - 2])] == want
