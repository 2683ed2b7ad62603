"""Ten AdamW steps of every family through the engine against the same steps of
transformers' own model (loaded from save_hf's checkpoint) in float64 under
torch.optim.AdamW on the same batches: the loss of every step within 1e-5 of
the float64 one (llm.c's test_gpt2 check, per family).  The parameters are not
compared element by element: where a gradient is rounding noise (the key
biases', whose softmax ignores a constant, and a few elements of other
tensors) AdamW's division by sqrt(v) turns any two roundings into steps of up
to alpha either way, while the losses stay equal.  A float64 reference, not
transformers in float32:
training amplifies float32 rounding differently on each side (with Gemma 3's
normalised q and k of width 8 both float32 runs drift 1e-4 from float64 by the
seventh step), so only the exact trajectory is a fixed target."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import (
    GPT2,
    Gemma3,
    Gemma3Config,
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
from ggmlopt.models.registry import family_of
from ggmlopt.nn import RopeScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
F = torch.nn.functional

V = 53
GQA = {"vocab_size": V, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 40, "max_seq_len": 64}
MODELS = {
    "llama3-tied": lambda: Llama(LlamaConfig(**GQA, tie_embeddings=True, rope_base=500000.0,
                                             rope_scaling=RopeScaling(
                                                 "llama3", 8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0,
                                                 original_max_position_embeddings=8)),
                                 seed=1),
    "mistral-window": lambda: Mistral(MistralConfig(**GQA, sliding_window=5), seed=2),
    "qwen2": lambda: Qwen2(Qwen2Config(**GQA, tie_embeddings=True), seed=3),
    "qwen3": lambda: Qwen3(Qwen3Config(**GQA, head_dim=12), seed=4),
    "phi3": lambda: Phi3(Phi3Config(**GQA), seed=5),
    "smollm3": lambda: SmolLM3(SmolLM3Config(**{**GQA, "n_layers": 4}), seed=6),
    "gemma3": lambda: Gemma3(Gemma3Config(**{**GQA, "n_layers": 3}, head_dim=16,
                                          query_pre_attn_scalar=16.0, sliding_window=5,
                                          sliding_layers=(True, False, True)), seed=7),
    "gpt2": lambda: GPT2(GPT2Config(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=64), seed=8),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_ten_adamw_steps_equal_transformers(tmp_path, name):
    from ggmlopt.io import save_hf
    model = MODELS[name]()
    rng = np.random.default_rng(11)
    for _, p in model.named_parameters():   # norms and biases away from their init
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.shape)
    save_hf(model, tmp_path)
    hf_class = getattr(transformers, family_of(model).hf_architecture)
    hf = hf_class.from_pretrained(tmp_path, attn_implementation="eager").double()
    hf.train()   # its dropouts are all zero (save_hf writes them so)
    pars = go.OptimizerParams(go.AdamWParams(alpha=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                             wd=0.1))
    ctx = go.OptContext(model, loss_type=go.LossType.CROSS_ENTROPY,
                        get_opt_pars=lambda ud: pars)
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(10):
        tokens = rng.integers(0, V, (3, 24))
        labels = np.roll(tokens, -1, axis=1)
        labels[:, -1] = -1
        ctx.alloc(True)
        ctx.eval(None, inputs=tokens, labels=labels)
        opt.zero_grad()
        logits = hf(torch.tensor(tokens)).logits
        loss = F.cross_entropy(logits.reshape(-1, V),
                               torch.tensor(labels.reshape(-1), dtype=torch.long),
                               ignore_index=-1)
        loss.backward()
        opt.step()
        assert float(ctx.loss) == pytest.approx(loss.item(), rel=1e-5), (name, step)
