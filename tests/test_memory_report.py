"""memory_report: the parts of a training step's memory, within 15% of the peak
RSS a fresh process measures; fit prints it and refuses, before allocating
anything, a run the machine cannot hold."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import gemm, lora, memory_estimate
from ggmlopt.models import Llama, LlamaConfig

SMALL = {"vocab_size": 300, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 48, "max_seq_len": 128}


def test_the_parts_add_up_and_follow_what_trains():
    model = Llama(LlamaConfig(**SMALL), seed=0)
    n = sum(p.data.size for p in model.parameters())
    full = go.memory_report(model, 2, 64)
    assert full.weights == 4 * n and full.gradients == 4 * n
    assert full.optimizer_state == 8 * n
    # the peak holds the head's chunk or one block's backward buffers, whichever is
    # larger (the head runs before the blocks' backward pass)
    def beside_the_rest(r):
        return r.total - (r.weights + r.gradients + r.optimizer_state + r.activations
                          + r.runtime)

    assert beside_the_rest(full) == full.head   # a vocabulary whose head is the larger
    narrow = go.memory_report(
        Llama(LlamaConfig(**{**SMALL, "vocab_size": 16, "ffn_dim": 512}), seed=0), 2, 64)
    assert beside_the_rest(narrow) > narrow.head   # a wide MLP's backward is
    # with checkpointing the head's buffers and one block's are not live together
    ck = go.memory_report(model, 2, 64, checkpointing=True)
    assert ck.total < (ck.weights + ck.gradients + ck.optimizer_state + ck.activations
                       + ck.head + ck.runtime)
    assert go.memory_report(model, 2, 64, optimizer="sgd").optimizer_state == 0
    # every form OptContext and fit take for the same settings
    assert go.memory_report(model, 2, 64, optimizer="SGD") == \
        go.memory_report(model, 2, 64, optimizer=go.OptimizerType.SGD)
    assert go.memory_report(model, 2, 64, optimizer_in_backward=np.True_,
                            labelled=np.float32(0.5)) == \
        go.memory_report(model, 2, 64, optimizer_in_backward=True, labelled=0.5)
    assert full["total"] == full.total and full.to_dict()["head"] == full.head
    with pytest.raises(KeyError, match="expected one of"):
        full["logits"]
    assert go.memory_report(model, 4, 64).activations == 2 * full.activations
    ckpt = go.memory_report(model, 2, 64, checkpointing=True)
    assert ckpt.activations < full.activations and ckpt.checkpointing
    # the fused head reads labelled rows only
    assert go.memory_report(model, 2, 64, labelled=0.25).head < full.head
    lora.apply(model, rank=4)
    adapters = sum(p.data.size for p in model.parameters() if p.requires_grad)
    tuned = go.memory_report(model, 2, 64)
    assert tuned.gradients == 4 * adapters and tuned.optimizer_state == 8 * adapters
    assert "total" in str(tuned) and "MiB" in str(tuned)
    for bad, kind in (({"batch_size": 0}, ValueError), ({"n_ctx": 129}, ValueError),
                      ({"optimizer": "adam"}, ValueError), ({"labelled": 2.0}, ValueError),
                      ({"checkpointing": "no"}, TypeError)):
        with pytest.raises(kind):
            go.memory_report(model, **{"batch_size": 2, "n_ctx": 64, **bad})
    with pytest.raises(TypeError, match="language model"):
        go.memory_report(go.nn.Linear(3, 4), 1, 8)


PEAK = """
import json, sys
import numpy as np
import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.models.gemma2 import Gemma2, Gemma2Config
from ggmlopt.models.phi3 import Phi3, Phi3Config
cfg, b, t, how = json.loads(sys.argv[1])
# Phi-3: its fused q|k|v and gate|up products, split into copies; Gemma 2: the final
# soft cap's slope beside the head's chunk
model = Phi3(Phi3Config(**cfg), seed=0) if "phi3" in how else \
    Gemma2(Gemma2Config(**cfg, sliding_window=64), seed=0) if "gemma2" in how else \
    Llama(LlamaConfig(**cfg), seed=0)
if "lora" in how:
    lora.apply(model, rank=64 if "rank64" in how else 8, targets="all-linear",
               dropout=0.1 if "dropout" in how else 0.0)
if "checkpointing" in how:
    model.gradient_checkpointing_enable()
precision = "bf16" if "bf16" in how else "f32"
report = go.memory_report(model, b, t, precision=precision)
tokens = np.random.default_rng(0).integers(0, cfg["vocab_size"], (b, t + 1)).astype(np.int32)
if how.startswith("fit"):   # fit's static context: sized without a forward pass
    data = go.Dataset.from_arrays(tokens[:, :-1].copy(), tokens[:, 1:].copy())
    go.fit(model, data, "cross_entropy", nbatch_logical=b, silent=True, precision=precision)
else:
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        precision=precision)
    for _ in range(2):
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens[:, :-1], labels=tokens[:, 1:])
# VmHWM: this process's own peak (ru_maxrss would start at the parent's size, whose
# memory the child had until its exec)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps([report.total, peak]))
"""
MEDIUM = {"vocab_size": 16000, "dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 2,
          "ffn_dim": 1024, "max_seq_len": 1024, "tie_embeddings": True}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM: Linux's /proc")
@pytest.mark.parametrize("b,t,how", [(2, 256, "full"), (1, 1024, "checkpointing"),
                                     (2, 512, "lora"), (1, 1024, "fit-lora"),
                                     (2, 512, "lora-dropout"),
                                     (2, 512, "lora-bf16"), (2, 256, "full-bf16"),
                                     (2, 512, "phi3-full"), (2, 512, "phi3-lora-bf16"),
                                     (1, 1024, "lora-bf16-checkpointing"),
                                     (2, 512, "lora-rank64"), (4, 512, "gemma2-full")])
def test_the_estimate_is_within_15_percent_of_the_measured_peak(b, t, how):
    if "bf16" in how and not gemm.bf16_support()[0]:
        pytest.skip(f"bf16 runs as float32 here: {gemm.bf16_support()[1]}")
    if "bf16" in how and gemm.bf16_engine() == "mkl":
        # (memory_report's docstring: MKL's buffers are not modelled)
        pytest.skip("bf16 products on Intel MKL, whose own buffers the estimate does not model")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PEAK, json.dumps([MEDIUM, b, t, how])],
                         capture_output=True, text=True, cwd=root, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout
    estimate, peak = json.loads(out.strip().splitlines()[-1])
    assert abs(estimate - peak) <= 0.15 * peak, (estimate / 2**20, peak / 2**20)


def _windows(n=4, t=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, SMALL["vocab_size"], (n, t)).astype(np.int32)
    return go.Dataset.from_arrays(x, np.roll(x, -1, axis=1))


def test_fit_prints_the_estimate(capsys):
    go.fit(Llama(LlamaConfig(**SMALL), seed=0), _windows(), "cross_entropy",
           nbatch_logical=2, silent=False)
    assert "memory for training at batch 2 x 32 tokens" in capsys.readouterr().err


def test_fit_refuses_what_the_machine_cannot_hold_before_allocating(monkeypatch):
    model = Llama(LlamaConfig(**SMALL), seed=0)
    weights = [p.data.copy() for p in model.parameters()]
    monkeypatch.setattr(memory_estimate, "available_memory", lambda: 1 << 20)
    monkeypatch.setattr(memory_estimate, "resident_memory", lambda: 1 << 20)
    with pytest.raises(MemoryError, match=r"the largest part is the (activations|optimizer "
                                          r"state): .*nbatch_physical; 2 now.*"
                                          r"gradient_checkpointing_enable.*lora.apply.*"
                                          r"optimizer_in_backward=True") as info:
        go.fit(model, _windows(), "cross_entropy", nbatch_logical=2, silent=True)
    assert "keep_types" not in str(info.value)   # its weights are a small part
    for p, w in zip(model.parameters(), weights):
        np.testing.assert_array_equal(p.data, w)
        assert p._grad is None   # no gradient was made
    # a way already taken is not offered again
    model.gradient_checkpointing_enable()
    with pytest.raises(MemoryError) as info:
        go.fit(model, _windows(), "cross_entropy", nbatch_logical=2, silent=True)
    assert "gradient_checkpointing_enable" not in str(info.value)


def test_the_machine_s_room_is_the_cgroup_s_and_the_weights_held(monkeypatch, tmp_path):
    # a container's memory limit caps MemAvailable; of this process's resident
    # memory only the weights the report counts are the step's
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(str(300 << 20) + "\n")
    usage.write_text(str(100 << 20) + "\n")
    monkeypatch.setattr(memory_estimate, "_CGROUP_FILES", ((str(limit), str(usage)),))
    assert memory_estimate.available_memory() == min(200 << 20, _meminfo_available())
    limit.write_text("max\n")   # no limit: MemAvailable (read twice: moves a little)
    assert abs(memory_estimate.available_memory() - _meminfo_available()) < 64 << 20
    report = go.memory_report(Llama(LlamaConfig(**SMALL), seed=0), 2, 16)
    monkeypatch.setattr(memory_estimate, "available_memory",
                        lambda: report.total - report.weights - 1)
    monkeypatch.setattr(memory_estimate, "resident_memory", lambda: 10 * report.total)
    with pytest.raises(MemoryError):   # the other 10x of its memory is not the step's
        memory_estimate.check_fits(report)
    monkeypatch.setattr(memory_estimate, "available_memory",
                        lambda: report.total - report.weights)
    memory_estimate.check_fits(report)


def _meminfo_available():
    with open("/proc/meminfo", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f
                    if line.startswith("MemAvailable:"))


def test_bf16_copies_count_a_tied_head_with_an_embedding_adapter():
    # the tied head multiplies its bf16 weight copy whether or not its embedding
    # carries a LoRA adapter; a float32 report counts no copy at all
    if not gemm.bf16_support()[0]:
        pytest.skip(f"bf16 runs as float32 here: {gemm.bf16_support()[1]}")
    cfg = LlamaConfig(**{**SMALL, "tie_embeddings": True})
    plain, adapted = Llama(cfg, seed=0), Llama(cfg, seed=0)
    lora.apply(plain, rank=4)
    lora.apply(adapted, rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                         "embed_tokens"))
    bf16 = [go.memory_report(m, 2, 64, precision="bf16") for m in (plain, adapted)]
    f32 = [go.memory_report(m, 2, 64) for m in (plain, adapted)]
    copies = [b.weights - f.weights for b, f in zip(bf16, f32)]
    embedding = 2 * SMALL["vocab_size"] * SMALL["dim"]
    assert copies[1] - copies[0] == 0 and copies[0] > embedding


# the Python memory that dropping a GGUF model's kept metadata frees, as
# tracemalloc traces it (the process's RSS would also move with the
# allocator's arenas, which other objects share)
METADATA = """
import gc, json, sys, tracemalloc, warnings
warnings.simplefilter("ignore")
import ggmlopt as go
from ggmlopt.io import load_gguf
tracemalloc.start()
model, tok = load_gguf(sys.argv[1])
del tok
params = sum(p.data.nbytes for p in model.parameters())
counted = go.memory_report(model, 1, 8).weights - params
def traced():
    gc.collect()
    return tracemalloc.get_traced_memory()[0]
before = traced()
model.gguf_metadata = None
print(json.dumps([counted, before - traced()]))
"""


def test_a_gguf_model_s_vocabulary_strings_count_with_its_weights(tmp_path):
    # a 128k-token vocabulary's tokens and merges, kept by the model to be written
    # back, hold about 30 MiB of Python strings: counted, not left out
    pytest.importorskip("tokenizers")
    src = os.environ.get("GGMLOPT_LLAMA_CPP_SRC")
    vocab = os.path.join(src or "", "models", "ggml-vocab-llama-bpe.gguf")
    if not os.path.isfile(vocab):
        pytest.skip("GGMLOPT_LLAMA_CPP_SRC (llama.cpp's vocabularies) is not set")
    import warnings

    from ggmlopt.io import load_gguf_tokenizer, save_gguf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_gguf_tokenizer(vocab)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, dim=8, n_layers=1, n_heads=2,
                              ffn_dim=16, max_seq_len=16), seed=0)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", METADATA, str(tmp_path / "m.gguf")],
                         capture_output=True, text=True, cwd=root, check=True).stdout
    counted, freed = json.loads(out.strip().splitlines()[-1])
    assert freed > 16 << 20   # what is counted is there
    assert abs(counted - freed) <= 0.35 * freed, (counted / 2**20, freed / 2**20)


def test_a_kept_base_under_adapters_counts_with_the_weights(tmp_path):
    # an adapter's base layer is no sub-module: its blocks were left out of the weights
    pytest.importorskip("gguf")
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    cfg = LlamaConfig(**{**SMALL, "vocab_size": 257, "dim": 64, "ffn_dim": 128})
    save_gguf(Llama(cfg, seed=0), tmp_path / "q8.gguf", tokenizer=ByteTokenizer(),
              dtype="q8_0")
    kept, _ = load_gguf(tmp_path / "q8.gguf", keep_types=True)
    before = go.memory_report(kept, 1, 16).weights
    lora.apply(kept, rank=2, targets="all-linear")
    adapters = sum(p.data.nbytes for _, layer in lora.named_adapters(kept)
                   for p in (layer.lora_a, layer.lora_b))
    assert go.memory_report(kept, 1, 16).weights == before + adapters


def test_checkpointed_blocks_hold_their_bf16_copies_one_at_a_time():
    # release_buffers drops a block's bf16 weight copies with its other buffers: under
    # checkpointing one block's are held at a time, without it every block's
    if not gemm.bf16_support()[0]:
        pytest.skip(f"bf16 runs as float32 here: {gemm.bf16_support()[1]}")
    model = Llama(LlamaConfig(**SMALL), seed=0)
    block, _ = memory_estimate._bf16_linears(model.layers[0])
    n = len(model.layers)
    plain = go.memory_report(model, 2, 16, precision="bf16", checkpointing=False)
    ckpt = go.memory_report(model, 2, 16, precision="bf16", checkpointing=True)
    f32 = go.memory_report(model, 2, 16, checkpointing=True)
    assert n > 1 and plain.weights - ckpt.weights == (n - 1) * block
    assert ckpt.weights - f32.weights == block + 2 * model.lm_head.weight.data.size


def _adapter_buffers(model):
    """The bytes of the private arrays the model's adapters keep after a step."""
    return sum(v.nbytes for _, layer in lora.named_adapters(model)
               for k, v in vars(layer).items() if k.startswith("_") and isinstance(v, np.ndarray)
               and not isinstance(v, go.nn.Parameter))


def test_an_adapter_s_rank_costs_what_its_buffers_hold():
    # what a higher rank adds to the estimate is what the adapters' own buffers grow
    # by after a step (t, u, their transposes, dA^T), measured on the layers
    tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 65)).astype(np.int32)
    held, estimated = [], []
    for rank in (4, 36):
        model = Llama(LlamaConfig(**SMALL), seed=0)
        lora.apply(model, rank=rank, targets="all-linear", seed=0)
        estimated.append(go.memory_report(model, 2, 64).activations)
        ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32)
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens[:, :-1], labels=tokens[:, 1:])
        held.append(_adapter_buffers(model))
    assert estimated[1] - estimated[0] == held[1] - held[0] > 0


def test_checkpointing_releases_the_bf16_copies_an_adapter_s_base_holds():
    # an adapter's base layer is not a sub-module: its bf16 copies (the weight's, the
    # rows') went with no block's buffers, and every block kept them
    if not gemm.bf16_support()[0]:
        pytest.skip(f"bf16 runs as float32 here: {gemm.bf16_support()[1]}")
    model = Llama(LlamaConfig(**SMALL), seed=0)
    lora.apply(model, rank=4, targets="all-linear", seed=0)
    model.gradient_checkpointing_enable()
    tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 33)).astype(np.int32)
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        precision="bf16")
    ctx.alloc(True)
    ctx.eval(None, inputs=tokens[:, :-1], labels=tokens[:, 1:])
    kept = [name for name, layer in lora.named_adapters(model)
            if any(isinstance(v, np.ndarray) and v.dtype == np.uint16
                   for v in vars(layer.base_layer).values())]
    assert kept == []
