"""A small language-model problem for the data-parallel tests: tests/test_distributed_ranks.py
(communicator of threads) and tests/mpi/worker.py (mpiexec) train the same Llama or GPT-2
on token windows over P ranks and compare with one process."""
from __future__ import annotations

import os

import numpy as np

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

VOCAB, N_CTX = 37, 8
_GQA = {"vocab_size": VOCAB, "dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "max_seq_len": N_CTX}
CONFIGS = {
    "llama": (Llama, LlamaConfig(**_GQA)),
    "gpt2": (GPT2, GPT2Config(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2,
                              max_seq_len=N_CTX)),
    # the other families, each with what sets it apart: biases, q/k norms and a head
    # width of its own, a window, fused projections, a layer without RoPE, Gemma's block
    "qwen2": (Qwen2, Qwen2Config(**_GQA, tie_embeddings=True)),
    "qwen3": (Qwen3, Qwen3Config(**_GQA, head_dim=6)),
    "mistral": (Mistral, MistralConfig(**_GQA, sliding_window=3)),
    "phi3": (Phi3, Phi3Config(**_GQA, sliding_window=5)),
    "smollm3": (SmolLM3, SmolLM3Config(**{**_GQA, "n_layers": 4})),
    "gemma3": (Gemma3, Gemma3Config(**{**_GQA, "n_layers": 3}, head_dim=4, sliding_window=3,
                                    query_pre_attn_scalar=4.0,
                                    sliding_layers=(True, False, True))),
}
# 4 physical batches of 6 windows per logical batch: 2 per rank on 2 ranks, 1 on 4
# (3 ranks take logical batches of 36: logical_batch(3))
NBATCH_LOGICAL, NBATCH_PHYSICAL, NDATA = 24, 6, 144
PARS = go.OptimizerParams(go.AdamWParams(alpha=5e-4))


def token_windows(ndata=NDATA, seed=0):
    """(x, y): int32 windows (ndata, N_CTX) and their next tokens, one position of
    every datapoint masked (-1)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (ndata, N_CTX)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = rng.integers(0, VOCAB, ndata)
    y[np.arange(ndata), rng.integers(0, N_CTX, ndata)] = -1
    return x, y


def logical_batch(nranks):
    """The logical batch for nranks (a multiple of nranks x NBATCH_PHYSICAL)."""
    return 36 if nranks == 3 else NBATCH_LOGICAL


def make_model(kind="llama"):
    cls, cfg = CONFIGS[kind]
    return cls(cfg, seed=4)


def params(model):
    return np.concatenate([p.data.ravel() for p in model.parameters()])


def zero_gradient_entries(kind):
    """Where params(model) holds the key biases (the middle third of GPT-2's
    ``attn.c_attn.bias``, Qwen2's ``k_proj.bias``).  Softmax is blind to a shift of a query's scores, so
    their gradient is zero and what reaches them is float rounding, which AdamW
    scales up to ~lr per step whatever its size: over ranks it is summed in
    another order, so these entries differ from one process's by rounding noise
    blown up (~5e-7 here), not by a training difference.  Excluded from the
    comparison with rounding_bound and checked on their own."""
    model = make_model(kind)
    mask = []
    for name, p in model.named_parameters():
        m = np.zeros(p.data.size, bool)
        if name.endswith("attn.c_attn.bias"):
            dim = p.data.size // 3
            m[dim:2 * dim] = True
        elif name.endswith("k_proj.bias"):   # Qwen2's key biases
            m[:] = True
        mask.append(m)
    return np.concatenate(mask)


def max_difference(kind, got, ref):
    """(max |got - ref| beyond float32 rounding of the parameters with a gradient,
    max |got - ref| over the key biases).  The first is the largest difference
    minus two units in the last place of ref's value (a parameter's own rounding,
    which a different summation order over the ranks can only show as whole
    ulps); compare it with rounding_bound."""
    zero = zero_gradient_entries(kind)
    d = np.abs(got - ref) - 2 * np.spacing(np.abs(ref))
    beyond = float(np.maximum(d[~zero], 0).max())
    return beyond, float(np.abs(got - ref)[zero].max()) if zero.any() else 0.0


# The largest cancellation allowed in one gradient entry, sum |b_i| / |sum b_i| over
# the physical batches b_i of a logical batch.  An entry that cancels more is at the
# level of rounding noise, as the key biases are (zero_gradient_entries).
CANCELLATION = 1000.0
# |d(m_hat / sqrt(v_hat))| <= ADAM_SENSITIVITY * (relative error of the gradients)
# for AdamW's bias-corrected ratio over the first steps: the numerator's weights
# over sqrt(v_hat) sum to at most sqrt(2) (Cauchy-Schwarz on its two first steps),
# and the denominator adds |m_hat / sqrt(v_hat)| <= 1 once more.
ADAM_SENSITIVITY = 2.5


def rounding_bound(nsteps, nbatch_logical, nbatch_physical=NBATCH_PHYSICAL, alpha=None):
    """The most that P ranks and one process may differ by after nsteps AdamW
    steps, from float32 rounding alone.  One process adds a logical batch's n =
    nbatch_logical / nbatch_physical gradients in order, the ranks add their
    partial sums in another order: each sum is off by at most gamma_n = n u / (1 -
    n u) times sum |b_i| (u = 2**-24), so the two differ relatively by at most
    2 gamma_n CANCELLATION; AdamW turns that into a step difference of at most
    alpha ADAM_SENSITIVITY times it, and the steps add up.  A wrong exchange (a
    rank's gradient missing or counted twice) moves a parameter by a sizeable
    fraction of alpha a step, far beyond this (5e-4 x 4 steps ~ 1e-3 against
    ~1e-6)."""
    alpha = PARS.adamw.alpha if alpha is None else alpha
    n = nbatch_logical // nbatch_physical
    u = 2.0 ** -24
    gamma = n * u / (1 - n * u)
    return nsteps * alpha * ADAM_SENSITIVITY * 2 * gamma * CANCELLATION


def nsteps_of(nepoch, nbatch_logical, ndata=NDATA, val_split=0.25):
    """The optimizer steps fit_lm takes (fit's split: whole logical batches train)."""
    return nepoch * int((1 - val_split) * (ndata // nbatch_logical))


def fit_lm(comm=None, kind="llama", dataset=None, nepoch=1, val_split=0.25,
           nbatch_logical=NBATCH_LOGICAL, part=False, seed=1):
    """fit the model on the masked windows (or dataset); (parameters, History)."""
    model = make_model(kind)
    ds = dataset if dataset is not None else go.Dataset.from_arrays(*token_windows())
    kwargs = {} if comm is None else {"comm": comm, "dataset_is_part": part}
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, lambda ep: PARS, nepoch=nepoch,
                  nbatch_logical=nbatch_logical, nbatch_physical=NBATCH_PHYSICAL,
                  val_split=val_split, silent=True, seed=seed, **kwargs)
    return params(model), hist


# ---- a corpus split into one token file per rank ----------------------------------------

PART_TOKENS = 8 * 13 + 1  # 12 windows of 8 tokens with stride 8 per part (and a next token)


def write_part_files(directory, nparts, seed=0):
    """nparts uint16 token files part<r>.bin in directory (nanoGPT's format)."""
    rng = np.random.default_rng(seed)
    for r in range(nparts):
        rng.integers(0, VOCAB, PART_TOKENS).astype(np.uint16).tofile(
            os.path.join(directory, f"part{r}.bin"))


def part_dataset(directory, rank):
    """Rank's own part: next-token windows of its memory-mapped token file."""
    tokens = np.memmap(os.path.join(directory, f"part{rank}.bin"), dtype=np.uint16, mode="r")
    return go.Dataset.from_tokens(tokens, N_CTX, stride=N_CTX)


def whole_dataset(directory, nparts):
    """One process's dataset: every part's windows, part 0's first."""
    parts = [part_dataset(directory, r) for r in range(nparts)]
    return go.Dataset.from_arrays(np.concatenate([np.asarray(p.data) for p in parts]),
                                  np.concatenate([np.asarray(p.labels) for p in parts]))
