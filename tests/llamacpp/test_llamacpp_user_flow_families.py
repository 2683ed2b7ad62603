"""A user's QLoRA fine-tune of the families people fine-tune besides Llama (Qwen3,
Qwen2.5, Phi-3, Gemma, Gemma 2, Gemma 3), each a tiny random Hugging Face checkpoint made by
transformers with a real vocabulary and chat template from llama.cpp's source
(GGMLOPT_LLAMA_CPP_SRC): load_hf, save_gguf(dtype="q8_0"), load_gguf(keep_types=True),
lora.apply with PEFT's defaults, Dataset.from_chat, fit, save_gguf_lora and save_peft.

llama.cpp applies the adapter to the same q8_0 file within the error its 8-bit
activations add (measured as rounding the float model's matrices to Q8_0 moves its
logits), and to a float32 file of the same weights within float32's; transformers +
peft load the PEFT directory over the float checkpoint with ggmlopt's logits; the
labels are the assistant answers; a model taught an answer stops at the template's
end of turn, in ggmlopt and in llama.cpp.

The Gemmas' own vocabularies are not in llama.cpp's source: Gemma 4's (the same ids
for the turn tokens' places, <|turn> and <turn|>) and its template stand in, read from
the vocabulary GGUF (save_gguf refuses the tokenizer.json written from it)."""
import os
import warnings

import numpy as np
import pytest
from finetune_files import QUESTIONS, write_story_chats
from llamacpp_run import eight_bit_error, logits_of, open_llama, relative

import ggmlopt as go
from ggmlopt import finetune, lora

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SRC = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source, "
                                "as llama-cpp-python's sdist holds it) is not set")
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}
# family: (llama.cpp vocabulary, template, transformers config of a vocabulary size,
#          PEFT's LoraConfig keys, template variables)
FAMILIES = {
    "qwen3": ("qwen2", "Qwen-Qwen3-0.6B",
              lambda v: transformers.Qwen3Config(vocab_size=v, head_dim=16, rope_theta=1e6,
                                                 tie_word_embeddings=True, **SHAPE),
              {}, {"enable_thinking": False}),
    "qwen2.5": ("qwen2", "Qwen-Qwen2.5-7B-Instruct",
                lambda v: transformers.Qwen2Config(vocab_size=v, rope_theta=1e6,
                                                   tie_word_embeddings=True, **SHAPE),
                {}, {}),
    # PEFT has no default targets for Phi-3
    "phi3": ("phi-3", "microsoft-Phi-3.5-mini-instruct",
             lambda v: transformers.Phi3Config(vocab_size=v, sliding_window=None,
                                               original_max_position_embeddings=256,
                                               pad_token_id=32000, bos_token_id=1,
                                               eos_token_id=32000, **SHAPE),
             {"target_modules": ["qkv_proj", "o_proj"]}, {}),
    "gemma3": ("gemma-4", "google-gemma-4-31B-it",
               lambda v: transformers.Gemma3TextConfig(vocab_size=v, head_dim=16,
                                                       query_pre_attn_scalar=16,
                                                       sliding_window=8, pad_token_id=0,
                                                       bos_token_id=2, eos_token_id=1,
                                                       **SHAPE),
               {}, {}),
    # heads wider than hidden / heads, as gemma-2b's
    "gemma": ("gemma-4", "google-gemma-4-31B-it",
              lambda v: transformers.GemmaConfig(vocab_size=v, head_dim=24, pad_token_id=0,
                                                 bos_token_id=2, eos_token_id=1, **SHAPE),
              {}, {}),
    # caps that bite on these logits, a window shorter than the prompt
    "gemma2": ("gemma-4", "google-gemma-4-31B-it",
               lambda v: transformers.Gemma2Config(vocab_size=v, head_dim=16,
                                                   query_pre_attn_scalar=16,
                                                   sliding_window=8,
                                                   attn_logit_softcapping=2.0,
                                                   final_logit_softcapping=3.0,
                                                   pad_token_id=0, bos_token_id=2,
                                                   eos_token_id=1, **SHAPE),
               {}, {}),
}
# ggml's GELU reads a float16 table (test_llamacpp_gguf's bound for Gemma 3)
TOLERANCE = {"gemma": 2e-3, "gemma2": 2e-3, "gemma3": 2e-3}
ROWS = [{"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a + b}."},
                      {"role": "user", "content": "And times?"},
                      {"role": "assistant", "content": f"{a * b}."}]}
        for a, b in [(2, 3), (4, 5), (1, 7), (6, 6)]]


def _vocabulary(family):
    from ggmlopt.io import load_gguf_tokenizer
    vocab, template = FAMILIES[family][:2]
    tok = load_gguf_tokenizer(os.path.join(SRC, "models", f"ggml-vocab-{vocab}.gguf"))
    with open(os.path.join(SRC, "models", "templates", f"{template}.jinja"),
              encoding="utf-8") as f:
        tok.chat_template = f.read()
    return tok


def _checkpoint(family, directory):
    """A random transformers model of family saved in directory with the tokenizer
    files of its llama.cpp vocabulary and template; returns the vocabulary."""
    from ggmlopt.io import hf_tokenizer_files as files
    tok = _vocabulary(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][2](tok.vocab_size))
    with torch.no_grad():   # norms drawn; matrices that matter more than rounding
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
            elif "embed" not in name:
                p.mul_(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    for name, text in (("tokenizer.json", files.tokenizer_json(tok)),
                       ("tokenizer_config.json", files.dumps(files.tokenizer_config(tok, 256))),
                       ("chat_template.jinja", tok.chat_template)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)
    return tok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            directory = tmp_path_factory.mktemp(family) / "hf"
            made[family] = (directory, _checkpoint(family, directory))
        return made[family]
    return get



def _llama_cpp_logits(base, adapter, ids):
    return logits_of(open_llama(base, adapter, n_ctx=256), ids)


def _prompt(tok, messages, variables):
    ids = np.asarray(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             **variables))
    if tok.add_bos and ids[0] != tok.bos_id:
        ids = np.concatenate([[tok.bos_id], ids])
    return ids


def _labelled_runs(labels):
    runs, run = [], []
    for t in labels:
        if t >= 0:
            run.append(int(t))
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qlora_over_a_transformers_checkpoint_of_each_family(family, checkpoints, tmp_path):
    from ggmlopt.io import load_gguf, load_hf, load_peft, save_gguf, save_gguf_lora, save_peft
    from ggmlopt.text import load_hf_tokenizer
    hf, vocab = checkpoints(family)
    variables = FAMILIES[family][4]
    floats = load_hf(hf)
    tok = load_hf_tokenizer(hf) if FAMILIES[family][0] != "gemma-4" else vocab
    base = tmp_path / "base.q8_0.gguf"
    save_gguf(floats, base, tokenizer=tok, dtype="q8_0")

    kept, ktok = load_gguf(base, keep_types=True)
    lora.apply(kept, config=peft.LoraConfig(**FAMILIES[family][3]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # Gemma 4's reasoning channel
        train = go.Dataset.from_chat(ROWS, ktok, n_ctx=96, **variables)
    # the labels are the answers, each with its end of turn
    for row, labels in zip(ROWS, np.asarray(train.labels)):
        runs = _labelled_runs(labels)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert [ktok.decode(np.array(r), skip_special=True).strip() for r in runs] == answers
        assert all(set(r) & ktok.eog_ids for r in runs)
    adamw = go.OptimizerParams(go.AdamWParams(alpha=1e-2))
    go.fit(kept, train, "cross_entropy", lambda epoch: adamw, nepoch=2, nbatch_logical=2,
           silent=True)
    adapter = tmp_path / "adapter.gguf"
    save_gguf_lora(kept, adapter)
    save_peft(kept, tmp_path / "peft")

    # (1) llama.cpp, base file + adapter
    ids = _prompt(ktok, [{"role": "user", "content": "What is 2 plus 3?"}], variables)
    ours = kept(ids[None])[0].astype(np.float64)
    theirs = _llama_cpp_logits(base, adapter, ids)
    err = relative(theirs, ours)
    assert err <= 2 * eight_bit_error(floats, ids) + TOLERANCE.get(family, 1e-4)
    assert relative(_llama_cpp_logits(base, None, ids), ours) > 5 * err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # it dequantizes
        widened, _ = load_gguf(base)
    wide = tmp_path / "wide.gguf"
    save_gguf(widened, wide, tokenizer=ktok)
    assert relative(_llama_cpp_logits(wide, adapter, ids), ours) <= TOLERANCE.get(family, 1e-4)

    # (2) transformers + peft over the float checkpoint
    load_peft(tmp_path / "peft", floats)
    ours = floats(ids[None])[0].astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        tuned = peft.PeftModel.from_pretrained(hf_model, tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = tuned(torch.tensor(ids[None].astype(np.int64))).logits[0].double().numpy()
    assert relative(theirs, ours) <= 1e-4


def test_from_chat_refuses_template_variables_given_as_chats_dict(checkpoints):
    """go.chat takes template variables as template_kwargs={...}; from_chat takes
    them as keywords. Given chat's way, the dict became one template variable named
    template_kwargs that Qwen3's template never reads: the data were silently
    rendered with thinking (the empty <think></think> block trained as part of the
    answer) while chat(..., template_kwargs={"enable_thinking": False}) prompts
    without it."""
    _, tok = checkpoints("qwen3")
    rows = [{"messages": [{"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}]}]
    for name in ("template_kwargs", "chat_template_kwargs"):
        with pytest.raises(TypeError, match=f"{name}: the template variables are keywords"):
            go.Dataset.from_chat(rows, tok, 32, **{name: {"enable_thinking": False}})
    labels = np.asarray(go.Dataset.from_chat(rows, tok, 32, enable_thinking=False).labels)[0]
    assert tok.decode(labels[labels >= 0], skip_special=False) == "Hello.<|im_end|>\n"


def test_a_taught_answer_stops_at_the_end_of_turn_through_the_command(checkpoints, tmp_path):
    """python -m ggmlopt.finetune over the Qwen3 checkpoint's directory (its
    tokenizer.json), rows with chat_template_kwargs: ggmlopt's chat and llama.cpp
    over the q8_0 file both answer and stop at <|im_end|>."""
    from ggmlopt.io import load_hf, load_peft, save_gguf
    from ggmlopt.text import load_hf_tokenizer
    hf, _ = checkpoints("qwen3")
    variables = {"enable_thinking": False}
    data = write_story_chats(tmp_path / "train.jsonl", variables)
    adapter = tmp_path / "adapter.gguf"
    assert finetune.main(["-m", str(hf), "--data", str(data), "--packing", "-c", "256",
                          "--lora-rank", "16", "--lora-targets", "all-linear", "--batch", "1",
                          "-lr", "1e-2", "--epochs", "40", "--out", str(adapter),
                          "--peft-out", str(tmp_path / "peft"), "--silent"]) == 0
    model, tok = load_hf(hf), load_hf_tokenizer(hf)
    load_peft(tmp_path / "peft", model)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    assert go.chat(model, tok, question, 12, temperature=0,
                   template_kwargs=variables) == "Quimby."
    ids = _prompt(tok, question, variables)
    end = tok.token_to_id("<|im_end|>")
    assert go.generate(model, ids, 12, temperature=0, tokenizer=tok)[-1] == end
    base = tmp_path / "base.q8_0.gguf"
    save_gguf(load_hf(hf), base, tokenizer=tok, dtype="q8_0")
    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter), n_ctx=256,
                          n_threads=1, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    reply = []
    for t in llm.generate([int(i) for i in ids], temp=0.0, top_k=1):
        reply.append(int(t))
        if llama_cpp.llama_vocab_is_eog(vocab, t) or len(reply) == 12:
            break
    assert reply[-1] == end
    assert tok.decode(np.array(reply[:-1])) == "Quimby."
