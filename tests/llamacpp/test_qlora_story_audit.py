"""Issue 26's "done means" as a user runs it: the made-up fact of
test_llamacpp_finetune_story taught through ``python -m ggmlopt.finetune
--keep-types`` over a base GGUF that save_gguf quantized (K types, Q4_1, Q8_0),
for families llama.cpp reads, with a real vocabulary and chat template from
llama.cpp's source (GGMLOPT_LLAMA_CPP_SRC).

Widths of 256 let the K types apply.  llama.cpp applies the adapter to the SAME
quantized file with ggmlopt's logits (load_gguf(keep_types=True) +
load_gguf_lora) within what its 8-bit activations move them (measured as
rounding the tuned model's matrices to Q8_0 does); over a float32 file of the
same dequantized weights, where llama.cpp rounds nothing, within float32's
rounding (ggml's float16 GELU table for Gemma 3).  ggmlopt's chat on the tuned
kept base answers with what it was taught.

A learning rate of 3e-3 (not the story's 1e-2): at this width 1e-2 makes the
random model's training chaotic, float base and kept base alike (their losses
agree for a few epochs, then part), and the answer is then whatever the chaos
leaves, not a property of the kept types."""
import os
import warnings

import numpy as np
import pytest
from finetune_files import QUESTIONS, write_story_chats
from llamacpp_run import eight_bit_error, logits_of, open_llama, relative

import ggmlopt as go
from ggmlopt import finetune, lora
from ggmlopt.models import (
    Gemma3,
    Gemma3Config,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
)
from ggmlopt.nn import QuantizedLinear

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")
SHAPE = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256,
         "max_seq_len": 256}
# family: (model of a vocabulary size, llama.cpp vocabulary, template (None: PLAIN),
#          template variables)
FAMILIES = {
    "mistral": (lambda v: Mistral(MistralConfig(vocab_size=v, **SHAPE), seed=0),
                "llama-spm", "mistralai-Mistral-Nemo-Instruct-2407", {}),
    "phi3": (lambda v: Phi3(Phi3Config(vocab_size=v, **SHAPE), seed=0),
             "phi-3", "microsoft-Phi-3.5-mini-instruct", {}),
    # a tied head: the token embedding, kept in its type
    "gemma3": (lambda v: Gemma3(Gemma3Config(vocab_size=v, **{**SHAPE, "n_layers": 3},
                                             head_dim=64, query_pre_attn_scalar=64.0,
                                             sliding_window=8), seed=0),
               "llama-spm", None, {}),
}
PLAIN = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}"
         "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:\n{% endif %}")
# ggml's GELU reads a float16 table (2^-11 relative; test_llamacpp_gguf's bound)
TOLERANCE = {"gemma3": 2e-3}
# (family, save_gguf dtype, the types the kept layers must show)
CASES = [("mistral", "q4_k_m", {"Q4_K", "Q6_K"}), ("phi3", "q4_1", {"Q4_1", "Q6_K"}),
         ("gemma3", "q8_0", {"Q8_0"})]


def _tokenizer(vocab, template):
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(os.path.join(SRC, "models", f"ggml-vocab-{vocab}.gguf"))
    if template is None:
        tok.chat_template = PLAIN
        return tok
    with open(os.path.join(SRC, "models", "templates", f"{template}.jinja"),
              encoding="utf-8") as f:
        tok.chat_template = f.read()
    return tok


@pytest.mark.parametrize("family,dtype,types", CASES, ids=[f"{f}-{d}" for f, d, _ in CASES])
def test_the_made_up_fact_over_a_kept_quantized_base(family, dtype, types, tmp_path):
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf
    make, vocab, template, variables = FAMILIES[family]
    tok = _tokenizer(vocab, template)
    base = tmp_path / "base.gguf"
    save_gguf(make(tok.vocab_size), base, tokenizer=tok, dtype=dtype)
    data = write_story_chats(tmp_path / "train.jsonl", variables)
    adapter = tmp_path / "adapter.gguf"
    assert finetune.main(["-m", str(base), "--keep-types", "--data", str(data), "--packing",
                          "-c", "256", "--lora-rank", "16", "--lora-targets", "all-linear",
                          "--batch", "1", "-lr", "3e-3", "--epochs", "20", "--out",
                          str(adapter), "--silent"]) == 0

    model, tuned_tok = load_gguf(base, keep_types=True)
    kept = {m.qtype for _, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert kept == types, kept   # the file's types are what is trained over and read
    load_gguf_lora(adapter, model)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    assert go.chat(model, tuned_tok, question, 12, temperature=0,
                   template_kwargs=variables) == "Quimby."

    ids = np.asarray(tuned_tok.apply_chat_template(question, add_generation_prompt=True,
                                                   **variables))
    if tuned_tok.add_bos and ids[0] != tuned_tok.bos_id:
        ids = np.concatenate([[tuned_tok.bos_id], ids])
    ours = model(ids[None])[0].astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # it dequantizes
        widened, _ = load_gguf(base)
    # exactly so where llama.cpp rounds no activation: a float32 file of the same weights
    wide = tmp_path / "wide.gguf"
    save_gguf(widened, wide, tokenizer=tuned_tok)
    exact = logits_of(open_llama(wide, adapter, n_ctx=256), ids)
    assert relative(exact, ours) <= TOLERANCE.get(family, 1e-4)
    # the same quantized file: within what its 8-bit activations move the tuned model
    load_gguf_lora(adapter, widened)
    lora.merge(widened)   # the tuned model in float32
    theirs = logits_of(open_llama(base, adapter, n_ctx=256), ids)
    err = relative(theirs, ours)
    assert err <= 2 * eight_bit_error(widened, ids) + TOLERANCE.get(family, 0.0)
    # and the adapter adds at most the 1e-3 of the scale to the gap llama.cpp
    # has over the base alone (ggml's GELU table aside)
    untuned, _ = load_gguf(base, keep_types=True)
    without = logits_of(open_llama(base, n_ctx=256), ids)
    base_gap = np.abs(without - untuned(ids[None])[0]).max() / np.abs(ours).max()
    assert err <= base_gap + 1e-3 + TOLERANCE.get(family, 0.0)
    assert relative(without, ours) > 5 * err   # llama.cpp applied the adapter
