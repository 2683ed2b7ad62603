"""A LoRA step against torch + PEFT on the same SmolLM2-135M-shaped llama (dim
576, 30 layers, GQA 9/3, ffn 1536, vocabulary 49152, tied embeddings), LoRA on
q/k/v/o at rank 8 over the frozen float32 base, batch 1 x 256, 2 threads each,
the steps interleaved so that a change of machine load hits every side.

Sides: ggmlopt (OptContext, AdamW over the adapters) in float32 on the GEMM
engine in force and, when that is not native, on ggmlopt's own products too
(GGMLOPT_GEMM=native), and, where the CPU multiplies bf16 natively, with
precision="bf16"; transformers' LlamaForCausalLM + peft.get_peft_model
(torch.optim.AdamW over the adapters) in float32 and under
torch.autocast(bfloat16).  The weights are the same (ggmlopt's,
through save_hf and from_pretrained).

Run: python -m pytest -q -s bench/test_bench_lora_step.py
Target (issues 26 and 30): ggmlopt's LoRA step <= 0.6x torch + PEFT's; asserted
only with GGMLOPT_BENCH_STRICT=1.
"""
import os
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import gemm, kernels, lora
from ggmlopt.models import Llama, LlamaConfig

sys.path.insert(0, os.path.dirname(__file__))
from test_bench_lm_step import REPEATS, STRICT, interleaved_medians, on_engine

SHAPE = {"vocab_size": 49152, "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3,
         "ffn_dim": 1536, "max_seq_len": 2048, "tie_embeddings": True}
T = 256
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LR = 1e-4


def tokens():
    t = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, T + 1)).astype(np.int32)
    return np.ascontiguousarray(t[:, :-1]), np.ascontiguousarray(t[:, 1:])


def ggmlopt_lora_step(model, precision):
    lora.apply(model, rank=8, alpha=16, targets=TARGETS, seed=0)
    pars = go.OptimizerParams(go.AdamWParams(alpha=LR))
    ctx = go.OptContext(model, loss_type="cross_entropy", inputs_dtype=np.int32,
                        get_opt_pars=lambda ud: pars, precision=precision)
    x, y = tokens()

    def step():
        ctx.alloc(True)
        ctx.eval(None, inputs=x, labels=y)

    return step


def peft_step(directory, autocast_bf16):
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=list(TARGETS)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    x, y = (torch.from_numpy(a).long() for a in tokens())

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, SHAPE["vocab_size"]), y.view(-1))
        loss.backward()
        opt.step()

    return step


def test_bench_lora_step_against_peft(threads, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ggmlopt.io import save_hf

    threads(2)
    torch.set_num_threads(2)
    cfg = LlamaConfig(**SHAPE)
    base = Llama(cfg, seed=0)
    save_hf(base, tmp_path / "hf")
    steps = {"ggmlopt f32": ggmlopt_lora_step(base, "f32"),
             "peft f32": peft_step(tmp_path / "hf", False)}
    if gemm.engine() != "native":
        # ggmlopt's own products beside the engine in force, in the same rounds
        steps["ggmlopt f32 native"] = on_engine(ggmlopt_lora_step(Llama(cfg, seed=0), "f32"),
                                                "native")
    native, why = gemm.bf16_support()
    if native:
        steps["ggmlopt bf16"] = ggmlopt_lora_step(Llama(cfg, seed=0), "bf16")
        steps["peft bf16"] = peft_step(tmp_path / "hf", True)
    med, all_times = interleaved_medians(steps)
    lines = [(f"LoRA q/k/v/o r8, SmolLM2-135M shape, 1 x {T}, 2 threads, {REPEATS} "
              f"interleaved repeats, medians (torch {torch.__version__}, "
              f"{torch.backends.cpu.get_cpu_capability()}; ggmlopt "
              f"{kernels.simd_info()['active']}, GEMM {gemm.engine()}; bf16: {why})")]
    for name, t in med.items():
        lines.append(f"{name:13s} {t:.3f} s/step  "
                     f"(all: {', '.join(f'{x:.2f}' for x in all_times[name])})")
    lines.append(f"ggmlopt f32 / peft f32 = {med['ggmlopt f32'] / med['peft f32']:.2f} "
                 "(target <= 0.6)")
    if "ggmlopt f32 native" in med:
        lines.append(f"ggmlopt f32 native / peft f32 = "
                     f"{med['ggmlopt f32 native'] / med['peft f32']:.2f}")
    if native:
        lines.append(f"ggmlopt bf16 / peft bf16 = {med['ggmlopt bf16'] / med['peft bf16']:.2f}; "
                     f"ggmlopt bf16 / peft f32 = {med['ggmlopt bf16'] / med['peft f32']:.2f}")
    print("\n" + "\n".join(lines))
    if STRICT:
        assert med["ggmlopt f32"] <= 0.6 * med["peft f32"]
