"""Run under mpiexec by tests/mpi/test_mpi.py: one scenario of data-parallel training
on MPI.COMM_WORLD; every rank writes what it got to OUT/rank<r>.npz.

    mpiexec -n P python -m mpi4py tests/mpi/worker.py SCENARIO OUT [ARGS...]

(``python -m mpi4py`` aborts every rank when one raises, so a bug never hangs.)
"""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lm_dist_problem as lm
from dist_problem import history_array, make_problem, run

import ggmlopt as go
from ggmlopt import distributed


def save(out, **arrays):
    np.savez(os.path.join(out, f"rank{MPI.COMM_WORLD.Get_rank()}.npz"), **arrays)


def outcome(fn):
    """(exception type name, message) of fn(), or ('', '') when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return type(e).__name__, str(e)
    return "", ""


def dropout_masks(comm):
    """Each rank's Dropout mask of its first training batch (every rank's, gathered)
    and the shared generator's state after it."""
    model, ds = make_problem(0, dropout=0.5)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm, seed=0)
    ctx.alloc(True)
    ds.get_batch(ctx.inputs, ctx.labels, comm.Get_rank())
    ctx.eval()
    mine = np.ascontiguousarray(model[2]._mask)
    every = np.empty((comm.Get_size(),) + mine.shape, np.float32)
    comm.Allgather(mine, every)
    return every, ctx.rng.random(4)


def epoch_preds(comm):
    model, ds = make_problem(0)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY, opt_period=6, comm=comm)
    rt, rv = go.Result(), go.Result()
    go.epoch(ctx, ds, rt, rv, 240)
    return rt.pred(), rv.pred()


def main(scenario, out, *args):
    comm = MPI.COMM_WORLD
    if scenario == "threads":  # what a rank takes without being told
        before = go.get_num_threads()
        go.OptContext(make_problem(0)[0], batch_size=10, ne_datapoint=13, opt_period=6,
                      comm=comm)
        from ggmlopt._blas_threads import current_blas_threads
        blas = current_blas_threads()
        save(out, before=before, kernel=go.get_num_threads(),
             blas=-1 if blas is None else blas, local=distributed.local_ranks(comm))
        return
    distributed.set_rank_threads(comm=comm)
    if scenario == "equivalence":
        optimizer, shard = args[0], args[1] == "shard"
        logical = int(args[2]) if len(args) > 2 else 60
        params, hist, _ = run(comm, optimizer, shard_optimizer=shard, nbatch_logical=logical)
        save(out, params=params, history=history_array(hist))
    elif scenario == "masks":
        every, shared = dropout_masks(comm)
        params, hist, _ = run(comm, "ADAMW", nepoch=2, dropout=0.3)
        save(out, masks=every, shared=shared, params=params, history=history_array(hist))
    elif scenario == "preds":
        train, val = epoch_preds(comm)
        save(out, train=train, val=val)
    elif scenario == "lm":
        params, hist = lm.fit_lm(comm, args[0], nbatch_logical=lm.logical_batch(comm.Get_size()))
        save(out, params=params, history=history_array(hist))
    elif scenario == "lm-parts":
        directory = args[0]
        params, hist = lm.fit_lm(comm, dataset=lm.part_dataset(directory, comm.Get_rank()),
                                 nepoch=2, val_split=0.0, nbatch_logical=12 * comm.Get_size(),
                                 part=True)
        save(out, params=params, history=history_array(hist))
    elif scenario == "frozen":  # the first layer's weight frozen
        params, hist, _ = run(comm, "ADAMW", shard_optimizer=args[0] == "shard",
                              frozen=("0.weight",))
        save(out, params=params, history=history_array(hist))
    elif scenario == "part":  # each rank holds only its block of the data
        params, hist, _ = run(comm, "ADAMW", ndata=60, val_split=0.0, part=True)
        save(out, params=params, history=history_array(hist),
             ndata=np.array([hist.ndata_train, hist.ndata_val]))
    elif scenario == "drop-last":  # 366 datapoints: 6 left out, not a whole physical batch
        params, hist, _ = run(comm, "ADAMW", ndata=366, drop_last=True)
        save(out, params=params, history=history_array(hist),
             ndata=np.array([hist.ndata_train, hist.ndata_val]))
    elif scenario == "resume":
        ckpt, nepoch, resume, shard = args[0], int(args[1]), args[2] == "resume", \
            args[3] == "shard"
        params, hist, _ = run(comm, "ADAMW", nepoch=nepoch, checkpoint=ckpt, resume=resume,
                              shard_optimizer=shard)
        save(out, params=params, history=history_array(hist))
    elif scenario == "fail-setup":
        ds = None
        if comm.Get_rank() == 1:  # bad input on one rank
            ds = go.Dataset.from_arrays(np.zeros((360, 4), np.float32),
                                        np.eye(5, dtype=np.float32)[np.zeros(360, int)])
        kind, msg = outcome(lambda: run(comm, "ADAMW", dataset=ds))
        save(out, kind=kind, msg=msg)
    elif scenario == "fail-argument":  # a bad context argument on rank 1 alone
        model, _ = make_problem(0)
        bad = {"precision": "fp8"} if comm.Get_rank() == 1 else {}
        kind, msg = outcome(lambda: go.OptContext(model, batch_size=10, ne_datapoint=13,
                                                  opt_period=6, comm=comm, **bad))
        save(out, kind=kind, msg=msg)
    elif scenario == "memory":  # room for one rank's training, not for every rank's here
        from ggmlopt import memory_estimate
        report = go.memory_report(lm.make_model(), lm.NBATCH_PHYSICAL, lm.N_CTX)
        memory_estimate.available_memory = lambda: report.total * 3 // 2
        memory_estimate.resident_memory = lambda: 0
        kind, msg = outcome(lambda: lm.fit_lm(comm, nbatch_logical=lm.logical_batch(
            comm.Get_size())))
        save(out, kind=kind, msg=msg)
    elif scenario == "fail-training":
        # each rank its own part (a whole dataset of other rows is refused at the start)
        _, ds = make_problem(0)
        n = ds.ndata // comm.Get_size()
        rows = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
        part = go.Dataset.from_arrays(ds.data[rows], ds.labels[rows], ndata_shard=2)
        if comm.Get_rank() == 1:
            part.data[n // 2:] = np.nan  # a NaN loss on rank 1 in the middle of the epoch
        kind, msg = outcome(lambda: run(comm, "ADAMW", dataset=part, dataset_is_part=True))
        save(out, kind=kind, msg=msg)
    elif scenario == "lm-masked-part":  # rank 1's part: padding rows alone
        directory = args[0]
        part = lm.part_dataset(directory, comm.Get_rank())
        if comm.Get_rank() == 1:
            part = go.Dataset.from_arrays(np.asarray(part.data),
                                          np.full(part.labels.shape, -1, np.int32))
        params, hist = lm.fit_lm(comm, dataset=part, nepoch=2, val_split=0.0,
                                 nbatch_logical=12 * comm.Get_size(), part=True)
        save(out, params=params, history=history_array(hist))
    elif scenario == "disagree":  # rank 1 builds another context or fit than rank 0
        what, other = args[0], comm.Get_rank() == 1
        kw = {"optimizer": "SGD" if other else "ADAMW"} if what == "optimizer" else \
            {"clip": 0.5 if other else 0.3} if what == "clip" else \
            {"nepoch": 2 if other else 3} if what == "nepoch" else \
            {"bucket_cap_mb": None if other else 25.0} if what == "bucket" else {}
        if what == "frozen-past-48":   # the same shapes and values, another one frozen
            model = go.nn.Sequential(*[go.nn.Linear(4, 4, bias=False, rng=i) for i in range(60)])
            params = list(model.parameters())
            params[50].data[...] = params[55].data[...] = 0.5
            params[55 if other else 50].requires_grad = False
            before = np.concatenate([p.data.ravel() for p in params])
            kind, msg = outcome(lambda: go.OptContext(
                model, batch_size=4, ne_datapoint=4, loss_type="mean_squared_error",
                opt_period=2, comm=comm))
            after = np.concatenate([p.data.ravel() for p in params])
            save(out, kind=kind, msg=msg, changed=not np.array_equal(before, after))
            return
        if what in ("lr", "data"):   # another learning rate; rows of its own, as many
            model, ds = make_problem(0)
            if what == "data" and other:
                ds = make_problem(1)[1]
            pars = go.OptimizerParams(go.AdamWParams(alpha=0.02 if other and what == "lr"
                                                     else 0.01))
            before = np.concatenate([p.data.ravel() for p in model.parameters()])
            kind, msg = outcome(lambda: go.fit(model, ds, go.LossType.CROSS_ENTROPY,
                                               lambda epoch: pars, nepoch=1,
                                               nbatch_logical=60, nbatch_physical=10,
                                               silent=True, comm=comm))
            after = np.concatenate([p.data.ravel() for p in model.parameters()])
            save(out, kind=kind, msg=msg, changed=not np.array_equal(before, after))
            return
        if what == "clip-later":   # rank 1 changes ctx.clip_grad_norm alone after a step
            model, ds = make_problem(0)
            ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                                loss_type=go.LossType.CROSS_ENTROPY, opt_period=2, comm=comm,
                                clip_grad_norm=1.0)
            before = None

            def steps():
                nonlocal before
                for i in range(8):
                    if i == 4:   # after two steps
                        before = np.concatenate([p.data.ravel() for p in model.parameters()])
                        if other:
                            ctx.clip_grad_norm = 0.001
                    ctx.alloc(True)
                    ds.get_batch(ctx.inputs, ctx.labels, comm.Get_rank() + 2 * (i // 2))
                    ctx.eval()
            kind, msg = outcome(steps)
            after = np.concatenate([p.data.ravel() for p in model.parameters()])
            save(out, kind=kind, msg=msg, changed=not np.array_equal(before, after))
            return
        if what in ("part-width", "part-rows"):   # dataset_is_part: parts of other shapes
            from ggmlopt.models import Llama, LlamaConfig
            model = Llama(LlamaConfig(vocab_size=31, dim=8, n_layers=1, n_heads=2,
                                      max_seq_len=16), seed=0)
            width = 15 if other and what == "part-width" else 16
            rows = 8 if other and what == "part-rows" else 12
            ids = np.random.default_rng(comm.Get_rank()).integers(0, 31, (rows, width + 1))
            part = go.Dataset.from_arrays(ids[:, :-1].astype(np.int32),
                                          ids[:, 1:].astype(np.int32))
            before = np.concatenate([p.data.ravel() for p in model.parameters()])
            kind, msg = outcome(lambda: go.fit(model, part, go.LossType.CROSS_ENTROPY,
                                               nepoch=1, nbatch_logical=4, nbatch_physical=2,
                                               silent=True, comm=comm, dataset_is_part=True))
            after = np.concatenate([p.data.ravel() for p in model.parameters()])
            save(out, kind=kind, msg=msg, changed=not np.array_equal(before, after))
            return
        kind, msg = outcome(lambda: run(comm, **kw))
        save(out, kind=kind, msg=msg, changed=False)
    elif scenario == "kept-base":  # a kept (quantized) base of another seed on rank 1
        from ggmlopt import lora
        from ggmlopt.io import load_gguf
        model, _ = load_gguf(args[comm.Get_rank() == 1], keep_types=True)
        lora.apply(model, rank=2, targets=("q_proj",), seed=0)
        x, y = lm.token_windows()
        kind, msg = outcome(lambda: go.fit(model, go.Dataset.from_arrays(x, y),
                                           go.LossType.CROSS_ENTROPY, lambda ep: lm.PARS,
                                           nbatch_logical=12, nbatch_physical=6, silent=True,
                                           comm=comm))
        save(out, kind=kind, msg=msg)
    elif scenario == "uneven":
        kind, msg = outcome(lambda: run(comm, "ADAMW", nbatch_logical=20, nbatch_physical=10))
        save(out, kind=kind, msg=msg)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
