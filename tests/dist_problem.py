"""One small training problem for the data-parallel tests: the thread communicator
tests (tests/test_distributed*.py) and the MPI worker (tests/mpi/worker.py) run the
same fit on 1, 2 or 3 ranks and compare with one process."""
from __future__ import annotations

import numpy as np

import ggmlopt as go

NDATA, NE_IN, NCLASSES = 360, 13, 5
# 6 physical batches of 10 per logical batch: 6, 3 or 2 per rank on 1, 2 or 3 ranks
NBATCH_LOGICAL, NBATCH_PHYSICAL = 60, 10


def make_problem(seed=0, ndata=NDATA, dropout=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ndata, NE_IN)).astype(np.float32)
    labels = (x[:, :NCLASSES] + 0.5 * rng.standard_normal((ndata, NCLASSES))).argmax(1)
    y = np.eye(NCLASSES, dtype=np.float32)[labels]
    ds = go.Dataset.from_arrays(x, y, ndata_shard=2)
    mrng = np.random.default_rng(seed + 1)
    layers = [go.nn.Linear(NE_IN, 7, rng=mrng), go.nn.ReLU(), go.nn.Linear(7, NCLASSES, rng=mrng)]
    if dropout:  # after the ReLU: model[2] is the Dropout
        layers.insert(2, go.nn.Dropout(dropout))
    model = go.nn.Sequential(*layers)
    return model, ds


def run(comm=None, optimizer="ADAMW", nepoch=3, shard_optimizer=False, clip=0.3,
        val_split=0.2, seed=0, checkpoint=None, resume=False, nbatch_logical=NBATCH_LOGICAL,
        nbatch_physical=NBATCH_PHYSICAL, dataset=None, part=False, ndata=NDATA, silent=True,
        frozen=(), dropout=0.0, **fit_kwargs):
    """fit on the problem; returns (parameters as one float32 array, History, model).
    part: each rank passes only its block of ndata / P datapoints (dataset_is_part).
    frozen: names of parameters to freeze (requires_grad=False).  dropout: a
    Dropout of that rate after the ReLU (model[2]).  fit_kwargs: more arguments of
    fit (bucket_cap_mb)."""
    model, ds = make_problem(seed, ndata, dropout)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad = False
    if dataset is not None:
        ds = dataset
    kwargs = {} if comm is None else {"comm": comm, "shard_optimizer": shard_optimizer}
    kwargs.update(fit_kwargs)
    if part:
        n = ndata // comm.Get_size()
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        ds = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
        kwargs["dataset_is_part"] = True
    opt = go.OptimizerType[optimizer]
    pars = go.OptimizerParams(adamw=go.AdamWParams(alpha=0.01), sgd=go.SGDParams(alpha=0.1))
    hist = go.fit(model, ds, go.LossType.CROSS_ENTROPY, lambda epoch: pars, nepoch=nepoch,
                  nbatch_logical=nbatch_logical, nbatch_physical=nbatch_physical,
                  val_split=val_split, silent=silent, optimizer=opt, seed=seed,
                  clip_grad_norm=clip, checkpoint=checkpoint, resume=resume, **kwargs)
    flat = np.concatenate([p.data.ravel() for p in model.parameters()])
    return flat, hist, model


def history_array(hist):
    """The History as float64 (epochs, 9), without the wall times."""
    return np.array([[e.train_loss, e.train_loss_unc, e.train_accuracy, e.train_accuracy_unc,
                      e.val_loss, e.val_loss_unc, e.val_accuracy, e.val_accuracy_unc, e.epoch]
                     for e in hist], dtype=np.float64)
