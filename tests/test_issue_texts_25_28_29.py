"""What issues 25, 28 and 29 promise, tested from their texts alone: the names,
arguments, errors and file contents the issues give, on small random models and
llama.cpp's own vocabularies (GGMLOPT_LLAMA_CPP_SRC; those tests skip without it)."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# the same conversation with transformers' generation markers around each answer
CHATML_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of Zorblax?"},
        {"role": "assistant", "content": "Quimby."},
        {"role": "user", "content": "And of Blip?"},
        {"role": "assistant", "content": "Blop."}]


def llama_cpp_models():
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    if not src:
        pytest.skip("GGMLOPT_LLAMA_CPP_SRC is not set")
    models = Path(src) / "models"
    if not models.is_dir():
        pytest.skip(f"no models/ under {src}")
    return models


def vocab(name):
    # (BPE vocabularies read through the tokenizers package, which the README install
    # lacks; the llama.cpp step has it)
    pytest.importorskip("tokenizers")
    path = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def template(name):
    path = llama_cpp_models() / "templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path.read_text(encoding="utf-8")


def tiny_llama(vocab_size=257, seed=0, **kw):
    cfg = {"vocab_size": vocab_size, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 256}
    cfg.update(kw)
    return Llama(LlamaConfig(**cfg), seed=seed)


def ending_model(eos, vocab_size=257):
    """A Llama whose greedy next token is always `eos`: the blocks add nothing to the
    residual stream, every embedding row is one positive vector and eos's is ten times it."""
    model = tiny_llama(vocab_size=vocab_size, n_layers=1)
    params = dict(model.named_parameters())
    e = np.linspace(0.5, 1.5, params["embed_tokens.weight"].shape[1]).astype(np.float32)
    params["embed_tokens.weight"].data[...] = e
    params["embed_tokens.weight"].data[eos] = 10 * e
    for name, p in params.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.data[...] = 0
    if "lm_head.weight" in params:
        head = params["lm_head.weight"].data
        head[...] = e[:, None]
        head[:, eos] = 10 * e
    return model


# ---------------------------------------------------------------- issue 25 --------

@pytest.mark.parametrize("dtype,ggml_type", [("f32", 0), ("F32", 0), ("f16", 1), ("F16", 1),
                                             (np.float32, 0), (np.float16, 1)])
def test_save_gguf_takes_llama_cpp_dtype_names(tmp_path, dtype, ggml_type):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    model = tiny_llama()
    path = tmp_path / "m.gguf"
    save_gguf(model, path, tokenizer=ByteTokenizer(), dtype=dtype)
    reader = gguf.GGUFReader(str(path))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert int(q.tensor_type) == ggml_type
    back, _ = load_gguf(path)
    x = np.arange(8, dtype=np.int32)[None]
    tol = 0 if ggml_type == 0 else 1e-2
    np.testing.assert_allclose(back(x), model(x), rtol=0, atol=tol * np.abs(model(x)).max())


def test_dataset_data_dtype_takes_llama_cpp_names():
    assert go.Dataset(2, 1, 6, data_dtype="f32").data.dtype == np.float32
    assert go.Dataset(2, 1, 6, data_dtype="F16").data.dtype == np.float16
    assert go.Dataset(2, 1, 6, data_dtype="i32").data.dtype == np.int32


def test_load_gguf_on_an_adapter_names_load_gguf_lora(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt import lora
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf, save_gguf_lora
    model = tiny_llama()
    save_gguf(model, tmp_path / "model.gguf", tokenizer=ByteTokenizer())
    lora.apply(model, rank=2)
    save_gguf_lora(model, tmp_path / "adapter.gguf")
    with pytest.raises(ValueError) as err:
        load_gguf(tmp_path / "adapter.gguf")
    assert "adapter" in str(err.value) and "load_gguf_lora" in str(err.value)
    with pytest.raises(ValueError) as err:
        load_gguf_lora(tmp_path / "model.gguf", tiny_llama())
    msg = str(err.value)
    assert "model" in msg and "load_gguf" in msg.replace("load_gguf_lora", "")


def _lm_dataset(labels_all_masked_rows):
    tokens = ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 8)
    ds = go.Dataset.from_tokens(tokens, n_ctx=16)
    x, y = np.asarray(ds.data)[:4].copy(), np.asarray(ds.labels)[:4].copy()
    y[labels_all_masked_rows] = -1
    return go.Dataset.from_arrays(x, y)


def test_a_dataset_without_any_label_is_refused_before_training():
    model = tiny_llama()
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        go.fit(model, _lm_dataset(slice(None)), "cross_entropy", nepoch=1, nbatch_logical=2,
               silent=True)
    assert "dataset" in str(err.value).lower()
    for n, p in model.named_parameters():
        assert (p.data == before[n]).all(), n


def test_a_physical_batch_without_labels_warns():
    model = tiny_llama()
    with pytest.warns(UserWarning):
        go.fit(model, _lm_dataset(slice(0, 1)), "cross_entropy", nepoch=1, nbatch_logical=1,
               silent=True, shuffle=False)


def test_generate_stops_at_the_tokenizers_end_of_generation_by_default():
    tok = ByteTokenizer()
    assert tok.eos_id in {int(i) for i in tok.eog_ids}
    model = ending_model(tok.eos_id)
    prompt = tok.encode("Hi")
    free = go.generate(model, prompt, 6, temperature=0, stop_ids=())
    assert free.tolist() == [tok.eos_id] * 6               # the model ends at once
    stopped = go.generate(model, prompt, 6, temperature=0, tokenizer=tok)
    assert len(stopped) <= 1
    streamed = list(go.lm.stream(model, prompt, 6, temperature=0, tokenizer=tok))
    assert len(streamed) <= 1


def test_a_model_from_load_gguf_stops_at_its_end_of_generation(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    tok = ByteTokenizer()
    save_gguf(ending_model(tok.eos_id), tmp_path / "m.gguf", tokenizer=tok)
    back, _ = load_gguf(tmp_path / "m.gguf")
    assert len(go.generate(back, tok.encode("Hi"), 6, temperature=0)) <= 1
    assert len(go.generate(back, tok.encode("Hi"), 6, temperature=0, stop_ids=())) == 6


def test_byte_tokenizer_decode_skips_special():
    tok = ByteTokenizer()
    ids = np.r_[tok.encode("ab"), [tok.eos_id]]
    assert tok.decode(ids, skip_special=True) == "ab"


def test_lora_docstring_shows_fits_signature():
    from ggmlopt import lora
    assert "fit(llama, tokens, labels" not in (lora.__doc__ or "")


def test_getting_started_lists_the_extras():
    page = ROOT / "docs" / "getting-started.md"
    if not page.is_file():
        pytest.skip("the docs are not beside these tests (an installed wheel's run)")
    text = page.read_text(encoding="utf-8")
    for extra in ("tokenizers", "examples"):
        assert f"`{extra}`" in text or f"[{extra}]" in text, extra


def test_install_messages_give_plain_package_names():
    """Every message (a raise, a warning, a print) that says `pip install ggmlopt[extra]`
    also says `pip install <name>`; docstrings are not messages."""
    import ast
    import re

    def strings(node):
        return " ".join(n.value for n in ast.walk(node)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str))

    bad = []
    for path in (ROOT / "ggmlopt").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = strings(node.exc)
            elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
                  and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                      "warn", "print", "ImportError", "ModuleNotFoundError")):
                text = strings(node)
            else:
                continue
            if "ggmlopt[" in text and not re.search(r"pip install (?!ggmlopt\[)[A-Za-z]", text):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
def test_ggmlopt_simd_paths_give_the_same_layer(simd):
    code = ("import numpy as np, ggmlopt as go\n"
            "from ggmlopt.models import Llama, LlamaConfig\n"
            "m = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2,"
            " max_seq_len=32), seed=0)\n"
            "np.save('OUT', m(np.arange(9, dtype=np.int32)[None]))\n")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        outs = []
        for env_simd in (None, simd):
            env = dict(os.environ)
            env.pop("GGMLOPT_SIMD", None)
            if env_simd:
                env["GGMLOPT_SIMD"] = env_simd
            out = os.path.join(d, f"{env_simd}.npy")
            r = subprocess.run([sys.executable, "-c", code.replace("OUT", out)], env=env,
                               capture_output=True, text=True, cwd=ROOT, check=False)
            if r.returncode and env_simd and "not" in r.stderr and simd != "scalar":
                pytest.skip(f"{simd} is not available here: {r.stderr[-200:]}")
            assert r.returncode == 0, r.stderr[-2000:]
            outs.append(np.load(out))
    scale = np.abs(outs[0]).max()
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5 * scale)


# ---------------------------------------------------------------- issue 28 --------

def _hf_configs():
    return {
        "llama3": ("LlamaConfig", "LlamaForCausalLM", {
            "rope_theta": 500000.0, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        "llama_linear": ("LlamaConfig", "LlamaForCausalLM", {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", {
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16}}),
        "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", {
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True,
                                                        "rope_theta": 1000000.0}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
        "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 4,
                                                                   "pad_token_id": 0}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
            "sliding_window": 4, "num_hidden_layers": 2, "query_pre_attn_scalar": 24, "head_dim": 16}),
        # llama.cpp's gemma3 scales the scores by head_dim: another scalar is refused
        "gemma3_hd": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
            "sliding_window": 4, "num_hidden_layers": 2, "query_pre_attn_scalar": 16, "head_dim": 16}),
    }


def _save_pretrained(name, path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg_cls, model_cls, extra = _hf_configs()[name]
    kw = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    kw.update(extra)
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kw)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():                       # norms off ones, so that they count
        for n, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("name", list(_hf_configs()))
def test_load_hf_reads_what_save_pretrained_writes(tmp_path, name):
    torch = pytest.importorskip("torch")
    from ggmlopt.io import load_hf
    hf = _save_pretrained(name, tmp_path)
    model = load_hf(tmp_path)
    if isinstance(model, tuple):
        model = model[0]
    tokens = np.random.default_rng(0).integers(0, 257, (2, 33))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    got = model(tokens.astype(np.int32))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "mistral", "phi3", "smollm3",
                                  "gemma3"])
def test_save_hf_loads_in_transformers_without_missing_keys(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import load_hf, save_hf
    _save_pretrained(name, tmp_path / "a")
    model = load_hf(tmp_path / "a")
    save_hf(model, tmp_path / "b")
    cls = getattr(transformers, _hf_configs()[name][1])
    _, info = cls.from_pretrained(tmp_path / "b", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_load_hf_refuses_a_config_key_it_does_not_implement(tmp_path):
    from ggmlopt.io import load_hf
    _save_pretrained("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["frobnication_depth"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="frobnication_depth"):
        load_hf(tmp_path)


@pytest.mark.parametrize("name,arch", [("llama3", "llama"), ("qwen2", "qwen2"),
                                       ("qwen3", "qwen3"), ("smollm3", "smollm3"),
                                       ("phi3", "phi3"), ("gemma3_hd", "gemma3")])
def test_save_gguf_writes_llama_cpp_architecture_names(tmp_path, name, arch):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, load_hf, save_gguf
    _save_pretrained(name, tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_gguf(model, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    back = load_gguf(tmp_path / "m.gguf")
    back = back[0] if isinstance(back, tuple) else back
    assert type(back) is type(model)
    tokens = np.arange(1, 12, dtype=np.int32)[None]
    assert (back(tokens) == model(tokens)).all()


def _vectors(name):
    path = vocab(name)
    raw = Path(f"{path}.inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts = texts[:-1]
    outs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    outs = [[int(t) for t in line.split()] for line in outs[:len(texts)]]
    assert len(texts) == len(outs)
    return path, texts, outs


VECTOR_VOCABS = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder",
                 "falcon", "mpt", "starcoder", "refact", "command-r", "llama-spm", "phi-3"]


@pytest.mark.parametrize("name", VECTOR_VOCABS)
def test_tokenizers_are_exact_on_llama_cpps_vectors(name):
    path, texts, outs = _vectors(name)
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(path)
    bad = [t for t, o in zip(texts, outs)
           if np.asarray(tok.encode(t, parse_special=False)).tolist() != o]
    assert not bad, f"{len(bad)}/{len(texts)} differ, e.g. {bad[:3]!r}"


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm", "phi-3"])
def test_vocabulary_facts_equal_llama_cpps(name):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = vocab(name)
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    v = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_vocab_n_tokens(v)
    assert tok.vocab_size == n
    assert tok.bos_id == llama_cpp.llama_vocab_bos(v)
    assert tok.eos_id == llama_cpp.llama_vocab_eos(v)
    assert bool(tok.add_bos) == bool(llama_cpp.llama_vocab_get_add_bos(v))
    eog = {i for i in range(n) if llama_cpp.llama_vocab_is_eog(v, i)}
    assert {int(i) for i in tok.eog_ids} == eog
    for i in (0, 1, 100, n - 1):
        piece = tok.id_to_token(i)
        assert llama_cpp.llama_vocab_get_text(v, i).decode("utf-8", "replace") == piece
        assert tok.token_to_id(piece) == i
    text = "Hello world, it's 2024!"
    assert np.asarray(tok.encode(text, parse_special=False)).tolist() == llm.tokenize(
        text.encode(), add_bos=False, special=False)


def test_load_gguf_tokenizer_is_what_load_gguf_returns(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf
    tok = load_gguf_tokenizer(vocab("qwen2"))
    save_gguf(tiny_llama(vocab_size=tok.vocab_size), tmp_path / "m.gguf", tokenizer=tok)
    _, from_model = load_gguf(tmp_path / "m.gguf")
    alone = load_gguf_tokenizer(tmp_path / "m.gguf")
    assert type(from_model) is type(alone) is type(tok)
    text = "<|im_start|>user\nHello there, 12345 ümlaut<|im_end|>"
    assert (np.asarray(from_model.encode(text)) == np.asarray(alone.encode(text))).all()
    assert (np.asarray(alone.encode(text)) == np.asarray(tok.encode(text))).all()


@pytest.mark.parametrize("name,marks", [("qwen2", ("<|im_start|>", "<|im_end|>")),
                                        ("llama-bpe", ("<|start_header_id|>", "<|eot_id|>"))])
def test_encode_turns_control_tokens_into_ids(name, marks):
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(vocab(name))
    start, end = (tok.token_to_id(m) for m in marks)
    text = f"{marks[0]}user\nHi{marks[1]}"
    default = np.asarray(tok.encode(text)).tolist()
    assert default == np.asarray(tok.encode(text, parse_special=True)).tolist()
    assert default[0] == start and default[-1] == end
    plain = np.asarray(tok.encode(text, parse_special=False)).tolist()
    assert start not in plain and len(plain) > len(default)
    assert end in {int(i) for i in tok.eog_ids}
    assert tok.decode(default, skip_special=True) == "user\nHi"
    assert tok.decode(default) == text


def test_load_hf_tokenizer_reads_a_tokenizer_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import load_gguf_tokenizer, save_hf
    from ggmlopt.text import load_hf_tokenizer
    tok = load_gguf_tokenizer(vocab("qwen2"))
    save_hf(tiny_llama(vocab_size=tok.vocab_size), tmp_path, tokenizer=tok)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_hf_tokenizer(tmp_path)
    text = "<|im_start|>user\nHello there, 12345 ümlaut<|im_end|>\n"
    want = hf.encode(text, add_special_tokens=False)
    assert np.asarray(ours.encode(text)).tolist() == want
    assert np.asarray(tok.encode(text)).tolist() == want


def test_save_hf_writes_the_tokenizer_files_with_the_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ggmlopt.io import save_hf
    tok = ByteTokenizer(chat_template=CHATML)
    save_hf(tiny_llama(), tmp_path, tokenizer=tok)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / f).is_file(), f
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.chat_template == CHATML
    text = "Hello, wörld!"
    assert hf.encode(text, add_special_tokens=False) == np.asarray(tok.encode(text)).tolist()


def test_save_gguf_keeps_the_sources_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    tok = ByteTokenizer(chat_template=CHATML)
    save_gguf(tiny_llama(), tmp_path / "a.gguf", tokenizer=tok)
    model, tok2 = load_gguf(tmp_path / "a.gguf")
    assert tok2.chat_template == CHATML
    save_gguf(model, tmp_path / "b.gguf", tokenizer=tok2)

    def keys(p):
        r = gguf.GGUFReader(str(p))
        return {k: f.contents() for k, f in r.fields.items()
                if k.startswith(("tokenizer.", "general."))}
    a, b = keys(tmp_path / "a.gguf"), keys(tmp_path / "b.gguf")
    for k, v in a.items():
        assert k in b, k
        if k != "general.file_type":
            assert b[k] == v, k


# ---------------------------------------------------------------- issue 29 --------

def _transformers_render(tmpl, messages, add_generation_prompt, tok, **kw):
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    out = render_jinja_template(conversations=[messages], chat_template=tmpl,
                                add_generation_prompt=add_generation_prompt,
                                bos_token="<s>", eos_token="</s>", **kw)
    rendered = out[0] if isinstance(out, tuple) else out
    return rendered[0]


@pytest.mark.parametrize("name", ["HuggingFaceTB-SmolLM3-3B", "meta-llama-Llama-3.2-3B-Instruct",
                                  "meta-llama-Llama-3.1-8B-Instruct",
                                  "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
                                  "google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct",
                                  "mistralai-Mistral-Nemo-Instruct-2407"])
@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("gen", [True, False])
def test_apply_chat_template_renders_as_transformers(name, system, gen):
    pytest.importorskip("jinja2")
    tmpl = template(name)
    from ggmlopt.io import load_gguf_tokenizer
    tok = load_gguf_tokenizer(vocab("llama-spm"))   # bos <s>, eos </s>
    tok.chat_template = tmpl
    messages = CHAT if system else CHAT[1:]
    if gen:
        messages = messages[:-1]
    try:
        want = _transformers_render(tmpl, messages, gen, tok)
    except Exception:  # noqa: BLE001 - the template refuses the conversation
        with pytest.raises(Exception):  # noqa: B017 - whatever transformers' refusal is
            tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        return
    text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert text == want
    ids = tok.apply_chat_template(messages, add_generation_prompt=gen)   # tokenize=True
    assert np.asarray(ids).tolist() == np.asarray(tok.encode(text)).tolist()


def test_byte_tokenizer_chat_template_and_bos_eos_bound():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    assert tok.chat_template == CHATML
    text = tok.apply_chat_template(CHAT[1:3], add_generation_prompt=False, tokenize=False)
    assert text == ("<|im_start|>user\nWhat is the capital of Zorblax?\n"
                    "<|im_start|>assistant\nQuimby.<|endoftext|>\n")
    ids = tok.apply_chat_template(CHAT[1:3])
    # ByteTokenizer.encode keeps its text-only default; the template's eos is one id
    assert np.asarray(ids).tolist() == np.asarray(tok.encode(text, parse_special=True)).tolist()
    raising = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        ByteTokenizer(chat_template=raising).apply_chat_template(CHAT, tokenize=False)
    globals_ = "{{ messages | tojson }}|{{ strftime_now('%Y') }}"
    out = ByteTokenizer(chat_template=globals_).apply_chat_template(CHAT[:1], tokenize=False)
    assert out.startswith('[{"role": "system"')
    assert out.rsplit("|", 1)[1] in {time.strftime("%Y"), time.strftime("%Y", time.gmtime())}


def test_chat_template_survives_gguf(tmp_path):
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf
    save_gguf(tiny_llama(), tmp_path / "m.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    assert load_gguf(tmp_path / "m.gguf")[1].chat_template == CHATML
    assert load_gguf_tokenizer(tmp_path / "m.gguf").chat_template == CHATML


def _trained_targets(ds, row, ids):
    """The indices j of ids (the rendered conversation) whose token is a label."""
    data, labels = np.asarray(ds.data)[row], np.asarray(ds.labels)[row]
    n = len(ids) - 1
    assert data[:n].tolist() == list(ids[:-1])
    js = [t + 1 for t in range(len(labels)) if labels[t] >= 0]
    for j in js:
        assert labels[j - 1] == ids[j]
    return set(js)


def test_from_chat_masks_equal_transformers_assistant_mask():
    pytest.importorskip("jinja2")
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    tok = ByteTokenizer(chat_template=CHATML_MARKED)
    ids = np.asarray(tok.apply_chat_template(CHAT)).tolist()
    rendered, spans = render_jinja_template(conversations=[CHAT], chat_template=CHATML_MARKED,
                                            return_assistant_tokens_mask=True,
                                            eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    text = rendered[0]
    # ByteTokenizer: the rendered text is ASCII but for the special token, one id
    assert tok.decode(ids) == text
    mask_chars = np.zeros(len(text), bool)
    for a, b in spans[0]:
        mask_chars[a:b] = True
    want, pos = set(), 0
    for j, i in enumerate(ids):
        width = len(tok.decode([i]))
        if mask_chars[pos:pos + width].any():
            want.add(j)
        pos += width
    ds = go.Dataset.from_chat([CHAT], tok, n_ctx=len(ids) + 3)
    assert _trained_targets(ds, 0, ids) == want
    # the same template without markers: the rendered prefixes' differences, which
    # are the marked spans and the line break the template writes after each message
    plain = ByteTokenizer(chat_template=CHATML)
    assert np.asarray(plain.apply_chat_template(CHAT)).tolist() == ids
    ds = go.Dataset.from_chat([CHAT], plain, n_ctx=len(ids) + 3, train_on="assistant")
    got = _trained_targets(ds, 0, ids)
    assert got >= want and all(ids[j] == ord("\n") and j - 1 in want for j in got - want)
    assert len(got - want) == 2


def test_from_chat_train_on_last_and_all():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    ids = np.asarray(tok.apply_chat_template(CHAT)).tolist()
    every = _trained_targets(go.Dataset.from_chat([CHAT], tok, len(ids) + 3), 0, ids)
    last = _trained_targets(go.Dataset.from_chat([CHAT], tok, len(ids) + 3, train_on="last"),
                            0, ids)
    everything = _trained_targets(go.Dataset.from_chat([CHAT], tok, len(ids) + 3,
                                                       train_on="all"), 0, ids)
    assert last < every and min(last) > max(every - last)
    assert tok.decode([ids[j] for j in sorted(last)]).startswith("Blop.")
    assert tok.decode([ids[j] for j in sorted(every - last)]).startswith("Quimby.")
    assert everything == set(range(1, len(ids)))
    with pytest.raises(ValueError, match="train_on"):
        go.Dataset.from_chat([CHAT], tok, len(ids) + 3, train_on="assistants")


def test_from_chat_never_cuts_silently():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    n = len(tok.apply_chat_template(CHAT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            go.Dataset.from_chat([CHAT, CHAT[1:3]], tok, n_ctx=n // 2)
        except ValueError:
            return
    assert caught, "a too-long conversation was cut without a word"


def test_from_completions_trains_on_the_completion_only():
    tok = ByteTokenizer()
    pairs = [("Q: capital of Zorblax? A:", " Quimby"), ("Q: 2+2? A:", " 4")]
    ds = go.Dataset.from_completions(pairs, tok, n_ctx=48)
    for row, (prompt, completion) in enumerate(pairs):
        labels = np.asarray(ds.labels)[row]
        got = tok.decode(labels[labels >= 0], skip_special=True)
        assert got == completion


def test_read_jsonl_reads_the_three_forms_and_names_a_bad_line(tmp_path):
    from ggmlopt.datasets import read_jsonl
    path = tmp_path / "d.jsonl"
    rows = [{"messages": CHAT[1:3]}, {"prompt": "a", "completion": "b"}, {"text": "hello"}]
    for row in rows:
        path.write_text("\n".join(json.dumps(r) for r in [row, row]) + "\n")
        assert len(list(read_jsonl(path))) == 2
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="2"):
        read_jsonl(path)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="2"):
        read_jsonl(path)


def test_fit_drop_last_takes_a_ragged_dataset():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    ds = go.Dataset.from_chat([CHAT[1:3]] * 5, tok, n_ctx=96)
    go.fit(tiny_llama(), ds, "cross_entropy", nepoch=1, nbatch_logical=2, silent=True,
           drop_last=True)


def _nll(model, ds):
    data, labels = np.asarray(ds.data), np.asarray(ds.labels)
    logits = model(data).astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    rows, cols = np.nonzero(labels >= 0)
    return logz[rows, cols] - logits[rows, cols, labels[rows, cols]], np.abs(logits).max()


def test_packing_equals_each_example_alone():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    chats = [CHAT, CHAT[1:3], CHAT[3:], CHAT[1:]]
    alone = go.Dataset.from_chat(chats, tok, n_ctx=200)
    packed = go.Dataset.from_chat(chats, tok, n_ctx=200, packing=True)
    assert packed.ndata < alone.ndata
    doc, pos = np.asarray(packed.document_ids), np.asarray(packed.positions)
    assert doc.shape == pos.shape == np.asarray(packed.data).shape
    model = tiny_llama()
    a, scale_a = _nll(model, alone)
    p, _ = _nll(model, packed)
    assert a.size == p.size
    np.testing.assert_allclose(np.sort(p), np.sort(a), rtol=0, atol=1e-5 * max(scale_a, 1))
    np.testing.assert_allclose(p.sum(), a.sum(), rtol=1e-5)


def test_chat_and_new_sampling_options():
    pytest.importorskip("jinja2")
    tok = ByteTokenizer(chat_template=CHATML)
    model = ending_model(tok.eos_id)
    reply = go.chat(model, tok, CHAT[1:2], 8, temperature=0)
    assert reply == ""
    model = tiny_llama()
    reply = go.chat(model, tok, CHAT[1:2], 8, temperature=0.7, seed=0, min_p=0.05,
                    repetition_penalty=1.3)
    assert isinstance(reply, str)
    prompt = tok.encode("Hello")
    base = go.generate(model, prompt, 8, temperature=0, stop_ids=())
    assert (go.generate(model, prompt, 8, temperature=0, stop_ids=(), min_p=0.1) == base).all()
    assert (go.generate(model, prompt, 8, temperature=0, stop_ids=(),
                        repetition_penalty=1.0) == base).all()


# the command ---------------------------------------------------------------------

def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ggmlopt.finetune", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
                          check=False)


@pytest.fixture
def command_files(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from ggmlopt.io import save_gguf
    save_gguf(tiny_llama(), tmp_path / "model.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": CHAT[1:3]}) + "\n" for _ in range(5))
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return tmp_path


def test_finetune_help_lists_the_issues_flags(command_files):
    r = _run(["--help"], command_files)
    assert r.returncode == 0, r.stderr
    for flag in ("--model", "--data", "--valid", "--lora-rank", "--lora-alpha", "--lora-targets",
                 "--full", "--keep-types", "--epochs", "--max-steps", "--lr", "--lr-schedule",
                 "--warmup", "--weight-decay", "--batch", "--micro-batch", "--ctx", "--packing",
                 "--train-on", "--gradient-checkpointing", "--eval-every", "--checkpoint",
                 "--resume", "--out", "--merge-out", "--out-type", "--plot", "-m", "-f", "-c",
                 "-b", "-ub", "-lr", "-wd", "-val-split", "-opt"):
        assert f"{flag} " in r.stdout or f"{flag}," in r.stdout or f"{flag}\n" in r.stdout, flag


def test_finetune_writes_an_adapter_and_a_merged_model(command_files):
    gguf = pytest.importorskip("gguf")
    d = command_files
    r = _run(["--model", "model.gguf", "--data", "train.jsonl", "--lora-rank", 4,
              "--lora-alpha", 8, "--ctx", 96, "--batch", 2, "--micro-batch", 1, "--epochs", 1,
              "--lr", 1e-3, "--out", "adapter.gguf", "--merge-out", "merged.gguf",
              "--out-type", "f16"], d)
    assert r.returncode == 0, r.stderr[-3000:]
    f = gguf.GGUFReader(str(d / "adapter.gguf")).fields["general.type"]
    assert bytes(f.parts[f.data[0]]).decode() == "adapter"
    from ggmlopt.io import load_gguf
    load_gguf(d / "merged.gguf")


def test_finetune_takes_llama_finetunes_flags(command_files):
    d = command_files
    r = _run(["-m", "model.gguf", "-f", "text.txt", "-c", 32, "-b", 32, "-ub", 32, "-lr", 1e-4,
              "-wd", 0.0, "--epochs", 1, "-val-split", 0.1, "-opt", "sgd", "--out", "a.gguf"], d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (d / "a.gguf").is_file()


def test_finetune_takes_a_hugging_face_directory(command_files):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")   # (the tokenizer.json save_hf writes)
    from ggmlopt.io import save_hf
    d = command_files
    save_hf(tiny_llama(), d / "hf", tokenizer=ByteTokenizer(chat_template=CHATML))
    r = _run(["--model", "hf", "--data", "train.jsonl", "--ctx", 96, "--batch", 2,
              "--max-steps", 1, "--out", "a.gguf"], d)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("args,word", [
    (["--lora-rank", 0], "lora-rank"),
    (["--lr-schedule", "zigzag"], "lr-schedule"),
    (["--train-on", "nobody"], "train-on"),
    (["-opt", "lion"], "opt"),
    (["--data", "missing.jsonl"], "missing.jsonl"),
])
def test_finetune_refuses_bad_arguments_by_name(command_files, args, word):
    base = {"--model": "model.gguf", "--data": "train.jsonl", "--ctx": "96", "--out": "a.gguf"}
    flags = []
    for k, v in base.items():
        if k not in args:
            flags += [k, v]
    r = _run(flags + args, command_files)
    assert r.returncode != 0
    assert word in r.stderr, r.stderr[-2000:]
    assert not (command_files / "a.gguf").exists()


def test_finetune_names_a_bad_data_line(command_files):
    d = command_files
    with open(d / "train.jsonl", "a") as f:
        f.write('{"messages": [{"role": "user"}]}\n')
    r = _run(["--model", "model.gguf", "--data", "train.jsonl", "--ctx", 96, "--out", "a.gguf"], d)
    assert r.returncode != 0
    assert "6" in r.stderr and "train.jsonl" in r.stderr, r.stderr[-2000:]


def test_finetune_validates_on_a_valid_file(command_files):
    d = command_files
    with open(d / "valid.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": CHAT[3:5]}) + "\n" for _ in range(3))
    r = _run(["--model", "model.gguf", "--data", "train.jsonl", "--valid", "valid.jsonl",
              "--ctx", 96, "--batch", 2, "--epochs", 1, "--eval-every", 1, "--out", "a.gguf",
              "--checkpoint", "c.npz"], d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validating on 3 examples from valid.jsonl (+1 masked rows)" in r.stdout, r.stdout
    # the file's windows validate: fit shuffles the training part only (shuffle="train"),
    # not the whole dataset once, which would mix the two
    from ggmlopt.checkpoint import load_state
    assert int(load_state(d / "c.npz")["fit.shuffle"]) == 2
    # with -val-split it would hold out training data as well: one of them
    r = _run(["--model", "model.gguf", "--data", "train.jsonl", "--valid", "valid.jsonl",
              "-val-split", 0.2, "--ctx", 96, "--out", "b.gguf"], d)
    assert r.returncode == 2 and "--valid" in r.stderr
    with open(d / "valid.jsonl", "a") as f:
        f.write("{broken\n")
    r = _run(["--model", "model.gguf", "--data", "train.jsonl", "--valid", "valid.jsonl",
              "--ctx", 96, "--out", "b.gguf"], d)
    assert r.returncode == 2 and "valid.jsonl" in r.stderr and "4" in r.stderr, r.stderr
    assert not (d / "b.gguf").exists()


@pytest.mark.parametrize("ntrain,nvalid", [(1, 1), (3, 1), (7, 3), (40, 1), (1, 9),
                                           (999, 7), (12345, 678)])
def test_valid_split_holds_out_exactly_the_valid_batches(ntrain, nvalid):
    from ggmlopt._fit_plan import training_batches
    from ggmlopt.finetune import _valid_split
    split = _valid_split(ntrain, nvalid)
    assert 0 < split < 1
    assert training_batches(ntrain + nvalid, split) == ntrain
