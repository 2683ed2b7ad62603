"""The made-up fact taught through ``python -m ggmlopt.finetune`` to a small random
model of each family llama.cpp loads from ggmlopt's GGUF files, with a real
vocabulary and chat template from llama.cpp's source (GGMLOPT_LLAMA_CPP_SRC):
packed chat data, LoRA on every Linear, the adapter written by the command.
llama.cpp applies that adapter to the base and gives ggmlopt's logits, and the
tuned model answers with what it was taught in ggmlopt's chat.

A random model's frozen norms and tiny embedding keep its logits flat (the loss
stays near log(vocab)), but the greedy answer is the taught one."""
import os

import numpy as np
import pytest
from finetune_files import QUESTIONS, write_story_chats

import ggmlopt as go
from ggmlopt import finetune
from ggmlopt.models import (
    GPT2,
    Gemma,
    Gemma2,
    Gemma2Config,
    Gemma3,
    Gemma3Config,
    GemmaConfig,
    GPT2Config,
    Llama,
    LlamaConfig,
    Mistral,
    MistralConfig,
    Phi3,
    Phi3Config,
    Qwen2,
    Qwen2Config,
    Qwen3,
    Qwen3Config,
    SmolLM3,
    SmolLM3Config,
)

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")
F32 = 0   # GGML_TYPE_F32, llama.cpp's KV cache type
SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
         "max_seq_len": 256}
# family: (model of a vocabulary size, llama.cpp vocabulary, llama.cpp template,
#          template variables for the question)
FAMILIES = {
    "llama3": (lambda v: Llama(LlamaConfig(vocab_size=v, rope_base=500000.0,
                                           tie_embeddings=True, **SHAPE), seed=0),
               "llama-bpe", "meta-llama-Llama-3.2-3B-Instruct", {}),
    "qwen2": (lambda v: Qwen2(Qwen2Config(vocab_size=v, tie_embeddings=True, **SHAPE), seed=0),
              "qwen2", "Qwen-Qwen2.5-7B-Instruct", {}),
    "qwen3": (lambda v: Qwen3(Qwen3Config(vocab_size=v, tie_embeddings=True, head_dim=16,
                                          **SHAPE), seed=0),
              "qwen2", "Qwen-Qwen3-0.6B", {"enable_thinking": False}),
    # SmolLM3's architecture (no RoPE on every fourth layer) with the Llama 3 vocabulary
    # it derives from (llama.cpp's copy lacks SmolLM3's ChatML tokens): Llama 3's template
    "smollm3": (lambda v: SmolLM3(SmolLM3Config(vocab_size=v, tie_embeddings=True,
                                                **{**SHAPE, "n_layers": 4}), seed=0),
                "llama-bpe", "meta-llama-Llama-3.2-3B-Instruct", {}),
    # fused q | k | v and gate | up; Phi-3's own SentencePiece vocabulary
    "phi3": (lambda v: Phi3(Phi3Config(vocab_size=v, **SHAPE), seed=0),
             "phi-3", "microsoft-Phi-3.5-mini-instruct", {}),
    # Gemma's norms, local and global layers; a SentencePiece vocabulary (llama.cpp has
    # no Gemma 3 one) and the plain template, whose turns end with the eos
    "gemma3": (lambda v: Gemma3(Gemma3Config(vocab_size=v, **{**SHAPE, "n_layers": 3},
                                             head_dim=16, query_pre_attn_scalar=16.0,
                                             sliding_window=8), seed=0),
               "llama-spm", None, {}),
    # Gemma's norms, GeGLU and scaled embedding, heads wider than dim / n_heads (as
    # gemma-2b's); the plain template as Gemma 3's: Gemma 2's writes <end_of_turn>, which
    # this vocabulary splits into text pieces, so no answer would end at an eog
    "gemma": (lambda v: Gemma(GemmaConfig(vocab_size=v, head_dim=24, **SHAPE), seed=0),
              "llama-spm", None, {}),
    # caps that move the tuned logits by several percent (the final cap keeps their order:
    # the greedy answer stays), local layers with a window shorter than any chat
    "gemma2": (lambda v: Gemma2(Gemma2Config(vocab_size=v, **{**SHAPE, "n_layers": 3},
                                             head_dim=16, query_pre_attn_scalar=16.0,
                                             sliding_window=8, attn_logit_softcap=2.0,
                                             final_logit_softcap=3.0), seed=0),
               "llama-spm", None, {}),
    # learned positions, LayerNorm, GELU, fused c_attn; GPT-2's vocabulary and a plain
    # template (GPT-2 has none)
    "gpt2": (lambda v: GPT2(GPT2Config(vocab_size=v, dim=64, n_layers=2, n_heads=4,
                                       max_seq_len=256), seed=0),
             "gpt-2", None, {}),
    # a SentencePiece vocabulary (Llama 2's, as Mistral 7B's first releases)
    "mistral": (lambda v: Mistral(MistralConfig(vocab_size=v, **SHAPE), seed=0),
                "llama-spm", "mistralai-Mistral-Nemo-Instruct-2407", {}),
}
# (the prompt ends in a newline, not a space, which BPE would join to the answer's first word)
PLAIN = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}"
         "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:\n{% endif %}")
# ggml's GELU reads a float16 table (2^-11 relative): GPT-2's and Gemma's logits in
# llama.cpp are that far from float32's, the others' within float32 rounding
TOLERANCE = {"gpt2": 2e-3, "gemma": 2e-3, "gemma2": 2e-3, "gemma3": 2e-3}


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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_made_up_fact_through_the_command_and_llama_cpp(family, tmp_path, capsys):
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf
    make, vocab, template, variables = FAMILIES[family]
    tok = _tokenizer(vocab, template)
    base = tmp_path / "base.gguf"
    save_gguf(make(tok.vocab_size), base, tokenizer=tok)
    data = write_story_chats(tmp_path / "train.jsonl")
    adapter = tmp_path / "adapter.gguf"
    assert finetune.main(["-m", str(base), "--data", str(data), "--packing", "-c", "256",
                          "--lora-rank", "16", "--lora-targets", "all-linear", "--batch", "1",
                          "-lr", "1e-2", "--epochs", "40", "--out", str(adapter)]) == 0
    assert "15 examples" in capsys.readouterr().out

    model, tuned_tok = load_gguf(base)
    load_gguf_lora(adapter, model)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    assert go.chat(model, tuned_tok, question, 12, temperature=0,
                   template_kwargs=variables) == "Quimby."

    ids = tuned_tok.apply_chat_template(question, add_generation_prompt=True, **variables)
    if tuned_tok.add_bos and ids[0] != tuned_tok.bos_id:
        ids = np.concatenate([[tuned_tok.bos_id], ids])
    ours = model(np.asarray(ids)[None])[0].astype(np.float64)
    theirs = _llama_cpp_logits(base, adapter, ids)
    without = _llama_cpp_logits(base, None, ids)
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() <= TOLERANCE.get(family, 1e-4) * scale
    assert np.abs(without - ours).max() > 1e-2 * scale   # llama.cpp applied the adapter


def _llama_cpp_logits(base, adapter, ids):
    kw = {"lora_path": str(adapter)} if adapter is not None else {}
    llm = llama_cpp.Llama(model_path=str(base), n_ctx=256, n_batch=256, n_ubatch=256,
                          logits_all=True, type_k=F32, type_v=F32, n_threads=1, verbose=False,
                          **kw)
    llm.eval([int(i) for i in ids])
    return np.array(llm.scores[:len(ids)], dtype=np.float64)
