"""Language-model training through the engine against a torch loop: the same
Llama, data order and AdamW, opt_period=2 and a masked position in every batch,
every physical batch's loss within 1e-5 over 50 optimizer steps; and a resumed
LM fit equal bit for bit to an uninterrupted one."""
import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=41, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def token_data(n=400, t=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (n, t)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = rng.integers(0, CFG.vocab_size, n)
    y[np.arange(n), rng.integers(0, t, n)] = -1      # one masked position per datapoint
    return x, y


def test_fifty_steps_with_accumulation_and_masking_equal_torch():
    torch = pytest.importorskip("torch")
    from test_models_torch import tensors, torch_llama

    x, y = token_data()
    ds = go.Dataset.from_arrays(x, y)
    model = Llama(CFG, seed=5)
    w = {k: v.detach().to(torch.float32).requires_grad_() for k, v in tensors(model).items()}
    pars = go.OptimizerParams(go.AdamWParams(alpha=2e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                                             wd=0.05))
    ctx = go.OptContext(model, 4, 8, loss_type=go.LossType.CROSS_ENTROPY, opt_period=2,
                        class_labels=True, get_opt_pars=lambda ud: pars, seed=1)
    ds.shuffle(ctx.rng)
    losses = []
    go.epoch(ctx, ds, go.Result(), None, -1, lambda *a: losses.append(float(ctx.loss)))
    assert ctx.iter == 51 and len(losses) == 100

    opt = torch.optim.AdamW(list(w.values()), lr=2e-3, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.05)
    perm = ds.permutation
    for step in range(50):
        opt.zero_grad()
        for half in range(2):
            rows = perm[step * 8 + half * 4: step * 8 + half * 4 + 4]
            logits = torch_llama(w, CFG, torch.tensor(x[rows]))
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, CFG.vocab_size), torch.tensor(y[rows].reshape(-1)).long(),
                ignore_index=-1) / 2
            loss.backward()
            assert losses[2 * step + half] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), \
                (step, half)
        opt.step()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, w[name].detach().numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=name)


def test_a_resumed_lm_fit_is_bit_exact(tmp_path):
    x, y = token_data(n=96)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))

    def run(nepoch, ckpt, resume=False, model=None):
        model = model or Llama(CFG, seed=2)
        go.fit(model, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY,
               lambda ep: pars, nepoch=nepoch, nbatch_logical=16, nbatch_physical=8,
               val_split=0.25, silent=True, seed=3, checkpoint=str(ckpt), resume=resume)
        return model

    straight = run(3, tmp_path / "a.npz")
    run(1, tmp_path / "b.npz")
    resumed = run(3, tmp_path / "b.npz", resume=True)
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
