"""The training run the resume tests repeat, in this process and in subprocesses: a
small classifier with gradient accumulation (opt_period 2), shuffling every epoch,
a validation split, a schedule and gradient clipping."""
import numpy as np

import ggmlopt as go


def make_problem(schedule):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(96, 7)).astype(np.float32)
    cls = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 0.5)
    y = np.eye(3, dtype=np.float32)[cls]
    ds = go.Dataset.from_arrays(x, y, ndata_shard=2)
    model = go.nn.Sequential(go.nn.Linear(7, 9, rng=1), go.nn.ReLU(), go.nn.Linear(9, 3, rng=2))
    base = go.OptimizerParams(go.AdamWParams(alpha=0.01, wd=0.01), go.SGDParams(alpha=0.1))
    if schedule == "step":
        pars = go.schedules.WarmupCosine(warmup=3, total=40, unit="step", base=base)
    else:
        pars = go.schedules.Cosine(total=4, min_factor=0.1, base=base)
    return model, ds, pars


def run(optimizer, schedule, nepoch, checkpoint=None, resume=False):
    """fit for nepoch epochs (in all); returns (model, dataset, history)."""
    model, ds, pars = make_problem(schedule)
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=pars, nepoch=nepoch,
                  nbatch_logical=8, nbatch_physical=4, val_split=0.25, silent=True,
                  optimizer=go.OptimizerType[optimizer], seed=5, checkpoint=checkpoint,
                  resume=resume, clip_grad_norm=5.0)
    return model, ds, hist
