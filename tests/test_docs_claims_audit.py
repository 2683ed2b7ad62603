"""Claims of the user documentation that its runnable blocks do not check: the
figures its ``text`` blocks print, the fine-tuning pages' GGUF and QLoRA flows
(written for a downloaded model, run here on a small random one), and what a
family's config.json may hold."""
import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.nn.init import skip_init

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# SmolLM2-135M's shape, the model the pages name
SMOLLM2 = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      ffn_dim=1536, max_seq_len=2048, tie_embeddings=True)


def _page(name):
    path = DOCS / name
    if not path.is_file():
        pytest.skip("no docs/ here (installed package)")
    return path.read_text(encoding="utf-8")


def test_the_memory_report_shown_is_what_memory_report_prints_for_smollm2():
    # language-models.md shows memory_report's output for SmolLM2-135M, 1 x 2048 tokens,
    # checkpointed: an estimate computed from the shapes, so the page must show its lines
    page = _page("language-models.md")
    block = re.search(r"```text\n(memory for training at batch 1 x 2048 tokens:\n.*?)```",
                      page, re.DOTALL)
    assert block, "the memory_report block of language-models.md"
    with skip_init():   # zero weights that take no memory: only the shapes count
        model = Llama(SMOLLM2)
    model.gradient_checkpointing_enable()
    assert str(go.memory_report(model, 1, 2048)).rstrip() == block.group(1).rstrip()


def test_the_trainable_count_shown_for_smollm2_is_lora_apply_s():
    # fine-tuning.md: lora.apply(model, rank=8, alpha=16.0) on SmolLM2-135M prints
    # "trainable params: 921,600 || all params: ..."
    assert "trainable params: 921,600 ||" in _page("fine-tuning.md")
    with skip_init():
        model = Llama(SMOLLM2)
    lora.apply(model, rank=8, alpha=16.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        lora.print_trainable_parameters(model)
    assert out.getvalue().startswith("trainable params: 921,600 ||"), out.getvalue()


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A byte-level 2-layer Llama GGUF with a ChatML template, and its chats."""
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files
    return write_files(tmp_path_factory.mktemp("docs_claims"))


def test_the_gguf_instruct_flow_of_fine_tuning_md_runs(base_gguf, tmp_path):
    # the page's first block, with the small model standing for SmolLM2-135M-Instruct
    from ggmlopt.datasets import read_jsonl
    from ggmlopt.io import load_gguf, load_gguf_lora, save_gguf_lora
    model, tok = load_gguf(base_gguf / "base.gguf")
    assert tok.chat_template and 256 in tok.eog_ids
    lora.apply(model, rank=8, alpha=16.0)
    assert all("lora" in name for name, p in model.named_parameters() if p.requires_grad)
    train = go.Dataset.from_chat(read_jsonl(base_gguf / "train.jsonl"), tok, n_ctx=96)
    go.fit(model, train, "cross_entropy", nepoch=1, nbatch_logical=5, silent=True)
    reply = go.chat(model, tok, [{"role": "user", "content": "What is the capital of Zorblax?"}],
                    8, temperature=0)
    assert isinstance(reply, str)
    save_gguf_lora(model, tmp_path / "zorblax-adapter.gguf")
    base, _ = load_gguf(base_gguf / "base.gguf")
    load_gguf_lora(tmp_path / "zorblax-adapter.gguf", base)
    window = np.asarray(train.data)[:2]
    np.testing.assert_array_equal(base(window), model(window))


def test_the_qlora_flow_of_fine_tuning_md_keeps_the_file_types(base_gguf, tmp_path):
    gguf = pytest.importorskip("gguf")
    from ggmlopt.datasets import read_jsonl
    from ggmlopt.io import load_gguf, save_gguf, save_gguf_lora
    from ggmlopt.nn import QuantizedLinear
    model, tok = load_gguf(base_gguf / "base.gguf")
    save_gguf(model, tmp_path / "base-q8_0.gguf", tokenizer=tok, dtype="q8_0")
    model, tok = load_gguf(tmp_path / "base-q8_0.gguf", keep_types=True)
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.qtype == "Q8_0"
    assert q.dequantize().shape == (32, 32) and q.dequantize().dtype == np.float32
    train = go.Dataset.from_chat(read_jsonl(base_gguf / "train.jsonl"), tok, n_ctx=96)
    with pytest.raises(ValueError, match="lora.apply"):   # the weights cannot train
        go.fit(model, train, "cross_entropy", nepoch=1, nbatch_logical=5, silent=True)
    lora.apply(model, rank=8)
    go.fit(model, train, "cross_entropy", nepoch=1, nbatch_logical=5, silent=True)
    save_gguf_lora(model, tmp_path / "adapter.gguf")
    lora.merge(model)
    assert type(model.layers[0].self_attn.q_proj) is go.nn.Linear          # merged: float32
    assert isinstance(model.layers[0].mlp.gate_proj, QuantizedLinear)       # the rest kept
    save_gguf(model, tmp_path / "tuned.gguf", tokenizer=tok, dtype="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "tuned.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_gate.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"


def _edited_checkpoint(model, folder, **keys):
    from ggmlopt.io import save_hf
    save_hf(model, folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **keys}))
    return folder


def test_pretraining_tp_is_accepted_only_where_no_layer_reads_it(tmp_path):
    # model-families.md: a key no transformers layer reads changes nothing (Llama's
    # pretraining_tp: transformers 5 keeps it in LlamaConfig and never reads it); a key
    # the family does not know is refused, never dropped
    pytest.importorskip("safetensors")
    from ggmlopt.io import load_hf
    from ggmlopt.models import Mistral, MistralConfig
    small = {"vocab_size": 67, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}
    llama = Llama(LlamaConfig(**small), seed=0)
    back = load_hf(_edited_checkpoint(llama, tmp_path / "llama", pretraining_tp=2))
    tokens = np.arange(12)[None] % 67
    np.testing.assert_array_equal(back(tokens), llama(tokens))
    mistral = Mistral(MistralConfig(**small), seed=0)
    with pytest.raises(ValueError, match="pretraining_tp"):
        load_hf(_edited_checkpoint(mistral, tmp_path / "mistral", pretraining_tp=2))


def test_the_api_page_lists_every_model_class_and_config():
    """docs/api.md's "Language models" list names each public name of
    ggmlopt.models (the Gemma families were once missing from it)."""
    from ggmlopt import models
    page = _page("api.md")
    listed = set(re.findall(r"^\s+models\.(\w+)\s*$", page, flags=re.MULTILINE))
    assert set(models.__all__) - listed == set()
