"""Data-parallel training over MPI: one gradient exchange per optimizer step.

``fit(..., comm=comm)`` and ``OptContext(..., comm=comm)`` take an mpi4py
communicator (mpi4py is imported only then; ``pip install 'ggmlopt[mpi]'``) or
any object with mpi4py's buffer methods ``Get_rank()``, ``Get_size()``,
``Allreduce``, ``Bcast``, ``Reduce_scatter`` and ``Allgather`` (tests use a
communicator of threads).

Semantics, with P ranks:

* A context's ``opt_period`` is the number of physical batches in one logical
  batch over all ranks and must be a multiple of P: each rank evaluates
  ``opt_period / P`` of them per optimizer step.  The losses keep ggml's scaling
  by the whole ``opt_period``, so the gradients summed over the ranks (one
  ``Allreduce`` of the arena's gradient section, 4 bytes x parameters) are the
  single-process gradient of the logical batch; every rank then applies the same
  step.  ``fit`` therefore needs ``nbatch_logical`` to be a multiple of
  ``P * nbatch_physical`` (ValueError otherwise, naming the sizes that work).
* Every rank starts from rank 0's parameters (a ``Bcast`` at construction and
  after ``load_state_dict``), steps on the same summed gradient, and so holds
  the same parameters bit for bit.
* Data, two ways.  By default each rank holds the same Dataset; shuffles come
  from the same seed, so every rank computes the same permutation (checked at
  each epoch's start).  In epoch, logical batch j is physical batches
  ``j*opt_period ...`` of the permuted data, rank r taking the r-th run of
  ``opt_period / P`` of them; validation batches go round robin.  This gives the
  single-process result up to float rounding, and costs the whole dataset's
  memory on every rank.  ``fit(..., dataset_is_part=True)``: each rank passes
  only its own part (the same number of datapoints on each), 1/P of the memory;
  a logical batch takes ``nbatch_logical / P`` datapoints from every part, each
  part is shuffled by the shared generator (the same permutation of its own
  shard indices on every rank) and validates on its last ``val_split``.  The
  batches then differ from one process's (they equal them only when nothing is
  shuffled), and a checkpoint resumes on the same number of ranks.
* Results are summed over the ranks (loss sums and sums of squares, batches,
  datapoints, ncorrect), so the Results, the History and rank 0's progress bar
  show the whole dataset, and ``Result.pred()`` holds every rank's predictions
  in the dataset's batch order, as one process's (see ggmlopt._global_pred).
  In an epoch over several ranks the callbacks run once per optimizer step and
  once after the validation.
* The exchange overlaps the backward pass, as PyTorch DDP's does: the arena's
  gradient section is cut into buckets of ``bucket_cap_mb`` MiB (default 25, an
  argument of OptContext and fit) in reverse layer order, and in the backward
  pass of the last physical batch of each logical batch (the one that steps),
  as soon as every parameter of a bucket has its final gradient (the layers
  announce it, see ``ggmlopt.nn.grads_ready``), a non-blocking ``Iallreduce``
  of that bucket starts; the step waits for all of them before the optimizer.
  Buckets start in the same order on every rank; each element is still summed
  by one reduction over the ranks, as by the single Allreduce of the whole
  section (``bucket_cap_mb=None``: that single exchange after the backward
  pass).  Parameters that no announcement covers are exchanged when the
  backward pass returns; when no bucket started before it returned (a small
  model is one bucket, final with its first layer), the step makes the single
  exchange instead, one blocking collective, cheaper when nothing is left to
  overlap.  The buckets run on a duplicate of comm
  (``comm.Dup()``, made once per context built for OPT): a rank that fails
  during the step tells the others on comm, where they ask before waiting for
  any bucket, so nobody hangs.  A communicator without ``Dup`` and
  ``Iallreduce`` (sharded: ``Ireduce_scatter``) gets the single exchange.
  ``exchange_wait_times`` holds, per optimizer step, the seconds of exchange
  that the backward pass did not hide: the time in the exchange's calls during
  the backward pass, then until every bucket arrived, with the agreement
  between the ranks after the backward pass (where a rank also waits for the
  slowest one: ``exchange_sync_times``); sharded, also the parameters'
  Allgather.
* ``shard_optimizer=True``: the gradients are reduce-scattered over P equal
  shards of the arena, each rank clips (the global norm is summed over the
  ranks) and steps its shard and keeps only that shard's AdamW moments, then the
  parameters are all-gathered: optimizer memory per rank falls by P; the same
  bytes cross the network as with the Allreduce.  With buckets, each bucket is
  reduce-scattered (``Ireduce_scatter``) straight into the ranks' shards, so
  the shards hold what the single Reduce_scatter gives.  ``state_dict``/``save``
  then gather the moments: every rank must call them.  Unsharded, ``ctx.grad_acc``
  shows the summed gradient after a step (as with one process); sharded, it
  keeps this rank's own gradient, since the sum exists only shard by shard.
* Frozen parameters (``requires_grad=False``) are outside the arena: nothing
  is exchanged for them, and they are not broadcast.  Each rank's model must
  freeze the same parameters with the same values; the construction compares
  them (a hash) and raises ValueError on every rank when they differ.
* Only rank 0 prints (fit) and writes checkpoints (fit, ``ctx.save``); every
  rank reads the checkpoint to resume (fit, ``OptContext.load(..., comm=)``; it
  must be visible to all of them), and a checkpoint written by any number of
  ranks resumes on any other.
* Randomness: the dataset's shuffles come from the shared generator
  ``ctx.rng``; the model's draws (Dropout) from ``ctx.model_rng``, each rank's
  own stream derived from the seed and the rank (see ggmlopt.rank_rng), so the
  ranks draw different masks.  ``state_dict`` gathers every rank's stream (a
  collective, like ``save``), and a resume on as many ranks continues it.
* Threads: a context over an mpi4py communicator gives each rank the cores of
  its machine divided by the ranks there (auto_rank_threads), unless the
  process chose its threads (GGMLOPT_NUM_THREADS, the BLAS variables,
  set_num_threads, set_rank_threads).
* A failure on one rank (bad input, a NaN loss, a failing callback) inside fit,
  epoch, the context's construction, ``OptContext.load``, ``load_state_dict``
  or ``save`` makes every other rank raise RankFailed at the next collective
  instead of hanging: each collective is preceded by an agreement (an
  ``Allgather`` of a short status per rank, naming the failing rank and its
  error).  A hand-written loop of ``alloc``/``eval`` has no such guard: run it
  with ``python -m mpi4py script.py``, which aborts every rank when one raises
  (the mnist example installs the same abort).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import time
import weakref

import numpy as np

from . import _global_pred, kernels
from ._buckets import DEFAULT_BUCKET_CAP_MB, GradientBuckets, check_bucket_cap_mb
from ._crc import crc32_bytes, sampled_crc32
from .batch_plan import BatchPlan
from .optim_params import BuildType
from .result import Result

__all__ = ["Distributed", "RankFailed", "auto_rank_threads", "local_ranks",
           "optimizer_state_nbytes", "set_rank_threads"]

_COMM_METHODS = ("Get_rank", "Get_size", "Allreduce", "Bcast", "Reduce_scatter", "Allgather")
_MSG = 256        # bytes of status per rank in an agreement
_SAME_STEP = ("every rank must step with the same optimizer parameters (get_opt_pars: the "
              "same learning rate and schedule)")
_SHARD_ALIGN = 16  # floats: shards start on 64-byte lines, like the arena's sections


class RankFailed(RuntimeError):
    """Raised on every rank when another rank failed: training stops everywhere."""


def _check_arguments(bucket_cap_mb, shard_optimizer):
    """Distributed's own arguments checked: the bucket size (returned as
    check_bucket_cap_mb gives it) and shard_optimizer a bool."""
    bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
    if not isinstance(shard_optimizer, bool):
        raise TypeError(f"shard_optimizer: expected a bool, got "
                        f"{type(shard_optimizer).__name__}")
    return bucket_cap_mb


class Distributed:
    """The collectives of one context over comm (see the module docstring); the
    context's GradientExchange (ggmlopt.context) over many processes.

    comm: an mpi4py communicator or an object with its buffer methods.
    shard_optimizer: shard the optimizer state over the ranks.
    bucket_cap_mb: MiB of gradients per bucket exchanged during the backward
    pass (float > 0), or None for one exchange after it.
    """

    def __init__(self, comm, shard_optimizer=False, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB):
        if comm is None:
            _check_arguments(bucket_cap_mb, shard_optimizer)
            raise ValueError("shard_optimizer: needs comm= (an mpi4py communicator); without "
                             "one there is nothing to shard over")
        missing = [m for m in _COMM_METHODS if not callable(getattr(comm, m, None))]
        if missing:
            raise TypeError(f"comm: expected an mpi4py communicator (or an object with its "
                            f"methods {', '.join(_COMM_METHODS)}), got {type(comm).__name__} "
                            f"without {', '.join(missing)}")
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self._mpi = None
        if type(comm).__module__.startswith("mpi4py"):
            from mpi4py import MPI  # only here: the core never needs it
            self._mpi = MPI
        # a bad argument on one rank only: the others hear of it at their next
        # agreement instead of waiting there for this rank
        with self.reporting("OptContext"):
            bucket_cap_mb = _check_arguments(bucket_cap_mb, shard_optimizer)
        self.shard = shard_optimizer
        self.parts = False  # fit(dataset_is_part=True): each rank's dataset is its own part
        # id -> (weak reference to a dataset, sampled CRC, digest of all its bytes)
        # of the whole datasets epochs ran over (training and validation): read
        # whole again only when the sample changed (a CRC of mnist's 188 MB takes
        # a tenth of an epoch); an entry goes with its dataset
        self._data_digests = {}
        # filled by attach()
        self.evals_per_step = None
        self.chunk = self.lo = self.n = 0
        self.g = None      # sharded: this rank's shard of the summed gradient
        self.state = {}    # sharded: this rank's shard of each optimizer state array
        # per optimizer step: seconds of exchange not hidden behind the backward pass
        # (bench/; exchange_times: its former name)
        self.exchange_wait_times = collections.deque(maxlen=4096)
        self.exchange_times = self.exchange_wait_times
        self.exchange_wait_total = 0.0  # their sum since the construction
        # per optimizer step: the part of it in the agreement after the backward pass,
        # where a rank waits for the slowest one (load imbalance, not bytes)
        self.exchange_sync_times = collections.deque(maxlen=4096)
        self._sync = 0.0
        self.bucket_cap_mb = bucket_cap_mb
        overlap = ("Dup", "Iallreduce") if not shard_optimizer else ("Dup", "Ireduce_scatter")
        self._overlap = bucket_cap_mb is not None and all(
            callable(getattr(comm, m, None)) for m in overlap)
        self._buckets = None     # GradientBuckets, made at the first exchanging backward
        self._bucket_comm = None  # comm.Dup() of an OPT context: the buckets' collectives
        self._requests = None    # the buckets' requests of the backward pass in flight
        self._wait = 0.0         # seconds of exchange not hidden in this step so far
        self._grads_in_flight = None

    # ---- raw collectives ------------------------------------------------------------

    def _allreduce_sum(self, buf):
        if self._mpi is not None:
            self.comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
        else:
            self.comm.Allreduce(buf.copy(), buf)

    def _bcast(self, buf):
        self.comm.Bcast(buf, root=0)

    def _allgather(self, send, recv):
        self.comm.Allgather(send, recv)

    def _allgather_in_place(self, buf):
        """Rank r's shard of buf (chunk floats at r*chunk) to every rank."""
        if self._mpi is not None:
            self.comm.Allgather(self._mpi.IN_PLACE, buf)
        else:
            self.comm.Allgather(buf[self.lo:self.lo + self.chunk].copy(), buf)

    def _reduce_scatter(self, send, recv):
        counts = [self.chunk] * self.size
        if self._mpi is not None:
            self.comm.Reduce_scatter(send, recv, counts, op=self._mpi.SUM)
        else:
            self.comm.Reduce_scatter(send, recv, counts)

    # ---- agreements: a failure on one rank stops every rank ---------------------------

    def agree(self, error=None, what="", token="", hint=None):
        """Every rank's status to every rank.  error: this rank's exception (it
        then returns, and the caller re-raises it).  Otherwise raises RankFailed
        when another rank failed, and ValueError when the ranks' tokens differ
        (hint: what the message says they must share)."""
        text = (f"E{type(error).__name__}: {error}" if error is not None else f"K{token}")
        raw = text.encode("utf-8", "replace")[:_MSG]
        send = np.zeros(_MSG, np.uint8)
        send[:len(raw)] = np.frombuffer(raw, np.uint8)
        recv = np.zeros((self.size, _MSG), np.uint8)
        self._allgather(send, recv)
        msgs = [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in recv]
        if error is not None:
            return
        failed = [(r, m[1:]) for r, m in enumerate(msgs) if m.startswith("E")]
        if failed:
            r, m = failed[0]
            raise RankFailed(f"{what}: rank {r} of {self.size} failed ({m}); every rank stops")
        if len(set(msgs)) > 1:
            raise ValueError(f"{what}: the ranks disagree ({', '.join(msgs)}); "
                             + (hint or "every rank must hold the same dataset and use the "
                                        "same seed"))

    def report(self, error, what=""):
        """Tell the other ranks that this rank failed (once per exception)."""
        if isinstance(error, RankFailed) or getattr(error, "_ggmlopt_reported", False):
            return
        try:
            error._ggmlopt_reported = True
        except AttributeError:
            pass
        self.agree(error, what)

    @contextlib.contextmanager
    def reporting(self, what):
        """Run a block whose failure on this rank the others must hear about."""
        try:
            yield
        except BaseException as e:
            self.report(e, what)
            raise

    @contextlib.contextmanager
    def agreement(self, what):
        """Run a block on every rank, then agree: a failure in the block on any
        rank raises on every rank.  The yielded object's ``token`` (a str every
        rank must share) is compared too."""
        pact = _Pact()
        try:
            yield pact
        except BaseException as e:
            self.report(e, what)
            raise
        self.agree(None, what, pact.token)

    # ---- the context ----------------------------------------------------------------

    def arena_layout(self, size, state):
        """(state, min_section) of the arena for size parameter elements and the
        optimizer's state arrays named in state: sharded, the state lives here,
        one shard per rank (the arena keeps none), and the sections are padded
        so that P shards of ``chunk`` floats cover them."""
        self.chunk = -(-size // (self.size * _SHARD_ALIGN)) * _SHARD_ALIGN
        self.lo = min(size, self.rank * self.chunk)
        self.n = min(size, self.lo + self.chunk) - self.lo
        if not self.shard:
            return state, 0
        self.g = np.zeros(self.chunk, np.float32)
        self.state = {name: np.zeros(self.chunk, np.float32) for name in state}
        return (), self.chunk * self.size

    @property
    def sharded_state(self):
        """Whether this rank keeps only its shard of the optimizer's state."""
        return bool(self.state)

    def check_opt_period(self, opt_period):
        """Raise unless opt_period physical batches split evenly over the ranks."""
        if opt_period % self.size != 0:
            raise ValueError(f"opt_period: with {self.size} ranks each rank evaluates "
                             f"opt_period/{self.size} physical batches per optimizer step, so "
                             f"opt_period must be a multiple of {self.size}; got {opt_period}")
        return opt_period // self.size

    def init_context(self, ctx, build, before_taking, model=None, clip_grad_norm=None):
        """OptContext(..., comm=...): every rank checks its arguments, all agree,
        then each takes its model's parameters and rank 0's values are broadcast.
        build(check): the construction, calling check(ctx) once the arguments are
        checked and before the model's parameters are taken; before_taking: the
        caller's own such check (or None)."""

        def agreed(c):
            # only an optimizer step is shared; other contexts evaluate their own batches
            self.evals_per_step = (self.check_opt_period(c.opt_period)
                                   if c.build_type == BuildType.OPT else c.opt_period)
            if before_taking is not None:
                before_taking(c)
            self.agree(None, "OptContext", _context_token(self, c, model, clip_grad_norm),
                       hint="every rank's model must freeze the same parameters, with the "
                            "same values (its weights kept in a file's types too), and train "
                            "the same shapes with the same optimizer, precision, clipping, "
                            "shard_optimizer and bucket_cap_mb")
            if self._mpi is not None:  # agreed: ranks sharing a machine share its cores
                auto_rank_threads(self.comm)

        try:
            build(agreed)
        except BaseException as e:
            self.report(e, "OptContext")
            raise
        self.broadcast_state(ctx)
        if self._overlap and ctx.build_type == BuildType.OPT:
            # the buckets' own communicator: a failing rank's report on comm never meets
            # a bucket, and the others hear of it before they wait for one
            self._bucket_comm = self.comm.Dup()
        else:
            self._overlap = False

    def broadcast_state(self, ctx):
        """Rank 0's parameters (and unsharded optimizer state) to every rank."""
        arena = ctx.arena
        self._bcast(arena.flat("weights"))
        for name in arena.state_names:
            self._bcast(arena.flat(name))

    # ---- the exchange overlapped with the backward pass ---------------------------------

    def backward(self, ctx, grad):
        """ctx.model.backward(grad) for the eval that steps: with buckets, each
        bucket's exchange starts as soon as its gradients are final (the
        gradient-ready hook); step() then waits for them."""
        self._wait = 0.0  # this step's exposed exchange starts here
        if not self._overlap:
            ctx.model.backward(grad)
            return
        if self._buckets is None:
            sharded = self.shard
            total = self.chunk * self.size if sharded else ctx.arena.size
            elems = max(1, int(self.bucket_cap_mb * (1 << 20)) // 4)
            self._buckets = GradientBuckets(ctx.model, ctx.parameters(), total, elems)
        buckets = self._buckets
        buckets.reset()
        self._requests = []
        grads = ctx.arena.padded("grads") if self.shard else ctx.arena.flat("grads")

        def ready(module):
            t0 = time.perf_counter()
            todo = buckets.announce(buckets.final_after(module))
            for k in todo:
                self._start_bucket(grads, *buckets.bounds[k])
            if self._requests and not todo:
                # MPI moves a non-blocking collective on only inside its calls
                type(self._requests[0]).Testall(self._requests)
            self._wait += time.perf_counter() - t0

        from .nn.module import on_grads_ready
        try:
            with on_grads_ready(ready):
                ctx.model.backward(grad)
        except BaseException:
            # the buckets run on a communicator of their own: the caller's report (an
            # agreement on comm) meets the others' agreement in step(), before anyone
            # waits for a bucket, and the unfinished buckets are left behind
            self._requests = None
            raise
        if not self._requests:
            # no bucket was final before the backward pass ended (a small model, whose
            # whole gradient is one bucket): step() exchanges it as the single exchange
            # does, one blocking collective, which costs less than a non-blocking one
            # and its wait when nothing is left to overlap
            self._requests = None
            return
        self._grads_in_flight = grads

    def _start_bucket(self, grads, lo, hi):
        """The non-blocking exchange of grads[lo:hi] (a bucket)."""
        if not self.shard:
            buf = grads[lo:hi]
            if self._mpi is not None:
                req = self._bucket_comm.Iallreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
            else:
                req = self._bucket_comm.Iallreduce(buf.copy(), buf)
            self._requests.append(req)
            return
        # each rank receives the part of the bucket inside its shard, into the shard
        chunk = self.chunk
        counts = [max(0, min(hi, (r + 1) * chunk) - max(lo, r * chunk))
                  for r in range(self.size)]
        mine = max(lo, self.rank * chunk) - self.rank * chunk
        recv = self.g[mine:mine + counts[self.rank]]
        send = grads[lo:hi]
        if self._mpi is not None:
            req = self._bucket_comm.Ireduce_scatter(send, recv, counts, op=self._mpi.SUM)
        else:
            req = self._bucket_comm.Ireduce_scatter(send, recv, counts)
        self._requests.append(req)

    def _finish_buckets(self, ctx, grads, token=""):
        """Agree (a rank that failed in its backward pass says so here, and the
        buckets started are then left unfinished), start the buckets not started
        yet, then wait for every bucket.  Agreeing first keeps the agreement a
        wait for the slowest rank: a bucket started before it would be moved on
        inside it (MPI's progress is global), and a failed rank's buckets that
        were never started are never waited for."""
        try:
            t0 = time.perf_counter()
            self.agree(None, f"optimizer step {ctx.iter}", token, hint=_SAME_STEP)
            self._sync = time.perf_counter() - t0
            for k in self._buckets.rest():
                self._start_bucket(grads, *self._buckets.bounds[k])
            if self._requests:
                type(self._requests[0]).Waitall(self._requests)
        finally:
            self._requests = None

    def step(self, ctx, pars):
        """The optimizer step of ctx on the gradients summed over the ranks.

        Unsharded: sums the arena's gradients in place (waits for the buckets
        backward() started, or one Allreduce) and returns False (the context then
        clips and steps as with one process).  Sharded: reduce-scatters (per
        bucket, or at once), clips, steps this rank's shard, all-gathers the
        parameters and returns True.
        """
        arena = ctx.arena
        t0 = time.perf_counter()
        # the step's hyper-parameters (a rank with another schedule or learning rate
        # would step other parameters)
        token = "pars " + " ".join(np.float32(h).tobytes().hex() for h in pars)
        # and the clipping (a rank that changed ctx.clip_grad_norm alone clipped apart)
        token += f" clip {ctx.clip_grad_norm!r}"
        if self._requests is not None:  # backward() started the buckets
            self._finish_buckets(ctx, self._grads_in_flight, token)
            self._wait += time.perf_counter() - t0
        else:
            self.agree(None, f"optimizer step {ctx.iter}", token, hint=_SAME_STEP)
            self._sync = time.perf_counter() - t0
            if not self.shard:
                self._allreduce_sum(arena.flat("grads"))
            else:
                self._reduce_scatter(arena.padded("grads"), self.g)
            self._wait += time.perf_counter() - t0
        if not self.shard:
            self._record()
            return False
        g = self.g
        n = self.n
        if ctx.clip_grad_norm is not None:
            total = np.array([kernels.sumsq(g[:n])])
            t0 = time.perf_counter()
            self._allreduce_sum(total)
            self._wait += time.perf_counter() - t0
            norm = math.sqrt(total[0])
            # clipping.py's rule over the whole gradient (a NaN norm scales by NaN)
            if not norm + 1e-6 <= ctx.clip_grad_norm:
                kernels.scale(g[:n], np.float32(ctx.clip_grad_norm / (norm + 1e-6)))
            ctx.grad_norm = norm
        if n > 0:  # the optimizer over this rank's shard
            ctx.optimizer.step(arena.view("weights", self.lo, (n,)), g[:n],
                               {name: a[:n] for name, a in self.state.items()}, pars, ctx.iter)
        t0 = time.perf_counter()
        self._allgather_in_place(arena.padded("weights"))
        self._wait += time.perf_counter() - t0
        self._record()
        return True

    def _record(self):
        """Record the seconds of exchange this step did not hide (the time in the
        exchange's calls, measured around each of them)."""
        self.exchange_wait_times.append(self._wait)
        self.exchange_wait_total += self._wait
        self.exchange_sync_times.append(self._sync)
        self._wait = self._sync = 0.0

    def zero_state(self):
        """Zero this rank's shard of the optimizer's state (sharded)."""
        for shard in self.state.values():
            shard[...] = 0

    def gather_state(self, size):
        """Sharded: the full optimizer state arrays {name: new array of size
        floats}, gathered from every rank's shard (a collective)."""
        out = {}
        for name, shard in self.state.items():
            full = np.empty(self.chunk * self.size, np.float32)
            self._allgather(shard, full)
            out[name] = full[:size]
        return out

    def set_state(self, full):
        """Sharded: this rank's shard of the full state arrays {name: array}."""
        for name, shard in self.state.items():
            shard[:self.n] = full[name][self.lo:self.lo + self.n]

    def load_state_dict(self, ctx, sd, load):
        """ctx.load_state_dict on every rank, agreed, then rank 0's values win."""
        with self.agreement("load_state_dict"):
            opt_i = sd.get("opt_i", 0) if hasattr(sd, "get") else 0
            if self.size > 1 and isinstance(opt_i, (int, np.integer)) and opt_i != 0:
                # a logical batch half done on one process has no share per rank
                raise ValueError(f"state_dict['opt_i']: with {self.size} ranks a state must be "
                                 f"saved between logical batches (opt_i=0), got {opt_i}")
            load()
        self.broadcast_state(ctx)

    def save(self, path, sd, save_state):
        """Rank 0 writes sd; every rank learns whether it worked."""
        with self.agreement(f"saving {os.fspath(path)!r}"):
            if self.rank == 0:
                save_state(path, sd)

    # ---- epochs: this rank's share of the batches (ggmlopt.epoch_loop) -----------------

    def begin_epoch(self, ctx, dataset, idata_split, check):
        """Before a run over an epoch's batches: check() (the argument checks,
        returning (nbatches, ibatch_split)) on every rank, the rules of several
        ranks, and the ranks' agreement on the batches, the step and the
        dataset's order.  Returns check()'s (nbatches, ibatch_split)."""
        with self.agreement("epoch") as pact:
            nbatches, ibatch_split = check()
            local = self._local_period(ctx)
            if ibatch_split % local != 0:
                raise ValueError(f"idata_split: with several ranks it must end a logical "
                                 f"batch ({local} x {ctx.batch_size} datapoints), got "
                                 f"{idata_split}")
            if ibatch_split > 0 and ctx.build_type != BuildType.OPT:
                raise RuntimeError(f"epoch: with several ranks training needs a context built "
                                   f"for OPT (this one: {ctx.build_type.name}); evaluate with "
                                   "idata_split=0")
            if ctx.opt_i != 0:
                raise RuntimeError("epoch: the context is inside a logical batch (opt_i="
                                   f"{ctx.opt_i}); with several ranks an epoch starts one")
            perm = np.ascontiguousarray(dataset.permutation)
            pact.token = (f"{nbatches}/{ibatch_split}/{ctx.iter}/"
                          f"{hashlib.blake2b(perm.tobytes(), digest_size=8).hexdigest()}")
            if not self.parts:
                # every rank holds the same dataset: its bytes as well as its order (ranks
                # given their own rows of the same size trained half of each, silently)
                pact.token += f"/data {self._digest_of(dataset)}"
        return nbatches, ibatch_split

    def _digest_of(self, dataset):
        """A digest of dataset's data and labels (every byte), read again only
        when a sample of its bytes changed since the last epoch over it: a
        dataset refilled in place (a loader reusing one buffer) is read again;
        a change of a few bytes between epochs may go unseen."""
        arrays = [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                  for a in (dataset.data, dataset.labels) if a is not None]
        sample = 0
        for raw in arrays:
            sample = sampled_crc32(raw, sample)
        key = id(dataset)
        kept = self._data_digests.get(key)
        if kept is not None and kept[0]() is dataset and kept[1] == sample:
            return kept[2]
        value = 0
        for raw in arrays:
            value = crc32_bytes(raw, value)
        digests = self._data_digests

        def forget(ref, key=key):
            # the dataset is gone: its entry with it (no dataset is kept alive)
            if digests.get(key, (None,))[0] is ref:
                del digests[key]

        digests[key] = (weakref.ref(dataset, forget), sample, f"{value:08x}")
        return f"{value:08x}"

    def _local_period(self, ctx):
        """Physical batches of this rank's dataset per logical batch."""
        return ctx.evals_per_step if self.parts else ctx.opt_period

    def batch_plan(self, ctx, train, first, stop, nbatches, shown_before=0, shown_max=None):
        """This rank's share of the dataset's batches [first, stop) (see the
        module docstring), as a ggmlopt.epoch_loop.BatchPlan: training, a group
        of evals_per_step batches per logical batch, the statistics summed over
        the ranks after each; validation, one group (round robin, or this part's
        batches), summed and shown once at the end."""
        plan = _RankTraining if train else _RankValidation
        return plan(self, ctx, first, stop, nbatches, shown_before, shown_max)

    def sum_results(self, local, base, out, ctx):
        """out := base + the sum over ranks of (local - base): the statistics of
        every rank's evals since base (the totals all ranks shared)."""
        mine = np.array(local._totals(), np.float64) - np.array(base, np.float64)
        self._allreduce_sum(mine)
        out._set_totals(tuple(np.array(base, np.float64) + mine), ctx)


def part_of_logical_batch(comm, dataset_is_part, nbatch_logical):
    """fit(dataset_is_part=True): the datapoints of a logical batch in each rank's part."""
    if not isinstance(dataset_is_part, bool):
        raise TypeError(f"dataset_is_part: expected a bool, got {type(dataset_is_part).__name__}")
    if comm is None:
        raise ValueError("dataset_is_part: needs comm= (each rank's part of the data)")
    nranks = comm.Get_size()
    if nbatch_logical % nranks != 0:
        raise ValueError(f"nbatch_logical: with {nranks} ranks each holding a part of the data, "
                         f"it must be a multiple of {nranks}; got {nbatch_logical}")
    return nbatch_logical // nranks


def _frozen_token(ctx, model=None):
    """The frozen parameters of ctx's model and the weights it keeps in a file's
    types (QuantizedLinear, QuantizedEmbedding: not Parameters), for the ranks to
    compare: which positions are frozen and a hash of their values ("" when none
    is).  No rank trains them, so they must start equal: they are not broadcast."""
    from .nn.quantized import quantized_layers

    frozen = ctx.frozen_parameters()
    kept = quantized_layers(model) if model is not None else []
    if not frozen and not kept:
        return ""
    digest = hashlib.blake2b(digest_size=8)
    for p in frozen:
        # flat first: a shape with a zero in it does not cast (no copy either way)
        digest.update(memoryview(np.ascontiguousarray(p.data).reshape(-1)).cast("B"))
    for name, layer in kept:
        digest.update(f"{name} {layer.qtype}".encode())
        digest.update(memoryview(np.ascontiguousarray(layer.qweight).reshape(-1)).cast("B"))
    mask = "".join("t" if t else "f" for t in ctx.trainable_mask)
    # the whole mask (its first 48 positions let ranks freeze others further on)
    mask_digest = hashlib.blake2b(mask.encode(), digest_size=8).hexdigest()
    return f"frozen {mask[:48]} ({mask_digest}) kept {len(kept)} {digest.hexdigest()}"


def _context_token(dist, ctx, model, clip_grad_norm):
    """What every rank's context must share, as one short text: the settings
    that make the ranks' steps one step (optimizer, precision, clipping, the
    exchange), the trainable parameters' shapes (an adapter of another rank
    would size another arena) and the frozen and kept weights (_frozen_token)."""
    # (before the context takes the model: its split of model.parameters())
    trained = [p for p, t in zip(ctx.model_parameters, ctx.trainable_mask) if t]
    shapes = hashlib.blake2b(repr([tuple(p.data.shape) for p in trained]).encode(),
                             digest_size=4).hexdigest()
    # the precision that runs too: a rank without native bf16 products multiplies in
    # float32 (a warning there), and the ranks' gradients would mix the two
    return (f"{ctx.optimizer.name} {ctx.precision_asked}->{ctx.precision} clip={clip_grad_norm} "
            f"shard={bool(dist.shard)} bucket={dist.bucket_cap_mb} shapes {shapes} "
            f"{_frozen_token(ctx, model)}")


class _Pact:
    token = ""


class _RankTraining(BatchPlan):
    """This rank's training batches of the dataset's [first, stop): logical batch
    j is the physical batches from first + j * local, rank r evaluating the r-th
    run of per of them (its own part's first per with dataset_is_part); after
    each logical batch the statistics are summed over the ranks."""

    def __init__(self, dist, ctx, first, stop, nbatches, shown_before, shown_max):
        per, period, local = ctx.evals_per_step, ctx.opt_period, dist._local_period(ctx)
        self.dist, self.per = dist, per
        self.nsteps = (stop - first) // local
        super().__init__(True, first, first, nbatches, shown_before,
                         self.nsteps * period if shown_max is None else shown_max)
        start = first + (0 if dist.parts else dist.rank * per)
        self.groups = [tuple(range(start + j * local, start + j * local + per))
                       for j in range(self.nsteps)]
        self.shown_per_group = period

    def guard(self):
        # an agreement at the end: a rank that failed in its last step (its
        # callback, say) stops the others before they gather the predictions
        return self.dist.agreement("training")

    def begin(self, result):
        result = result if result is not None else Result()
        self.base, self.pred_start, self.shown = result._totals(), result._npred, Result()
        return result

    def after_group(self, result, ctx):
        self.dist.sum_results(result, self.base, self.shown, ctx)
        return self.shown

    def finish(self, result, ctx, dataset, callback, t_start):
        if self.nsteps > 0:
            result._set_totals(self.shown._totals(), ctx)
        # every rank's predictions, in the dataset's order
        _global_pred.gather_training(self.dist, result, self.pred_start, self.nsteps, self.per,
                                     _global_pred.rows_per_batch(ctx))


class _RankValidation(BatchPlan):
    """This rank's validation batches of [first, stop): round robin over the
    ranks (this part's own batches with dataset_is_part), in one group; the
    statistics are summed and shown once, at the end."""

    def __init__(self, dist, ctx, first, stop, nbatches, shown_before, shown_max):
        self.dist, self.first, self.stop = dist, first, stop
        self.mine = tuple(range(first, stop) if dist.parts
                          else range(first + dist.rank, stop, dist.size))
        self.nval = (stop - first) * (dist.size if dist.parts else 1)
        super().__init__(False, first, first, nbatches, 0, self.nval)
        self.groups = [self.mine]

    def guard(self):
        return self.dist.agreement("validation")

    def begin(self, result):
        result = result if result is not None else Result()
        self.base, self.pred_start = result._totals(), result._npred
        return result

    def after_group(self, result, ctx):
        return None   # shown once, summed, in finish

    def finish(self, result, ctx, dataset, callback, t_start):
        dist = self.dist
        # every rank got here (agreed): the sums and predictions of the whole dataset
        if self.nval:
            dist.sum_results(result, self.base, result, ctx)
            _global_pred.gather_validation(dist, result, self.pred_start, len(self.mine),
                                           self.stop - self.first, dist.parts,
                                           _global_pred.rows_per_batch(ctx))
        with dist.agreement("after validation"):
            if callback is not None and self.nval:
                callback(False, ctx, dataset, result, self.nval, self.nval, t_start)


def optimizer_state_nbytes(ctx):
    """Bytes of optimizer state (AdamW's m and v) this rank holds for ctx."""
    dist = ctx.distributed
    if dist is not None and dist.shard:
        return sum(a.nbytes for a in dist.state.values())
    return ctx.arena.nstate * ctx.arena.section * 4


def local_ranks(comm):
    """Ranks of comm on this machine (MPI's shared-memory split for an mpi4py
    communicator; MPI launchers' environment or comm's size otherwise)."""
    if type(comm).__module__.startswith("mpi4py"):
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_size()
        finally:
            node.Free()
    return _launcher_local_ranks(comm)


def _launcher_local_ranks(comm, unknown=None):
    """Ranks of comm on this machine as the MPI launcher's environment says
    (no collective); else unknown, or comm's size when unknown is None."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return int(comm.Get_size()) if unknown is None else unknown


def rank_memory(report, comm, shard_optimizer):
    """fit's memory check over comm: (this rank's ggmlopt.MemoryReport, the
    ranks on this machine that share its memory).  Sharded, a rank keeps
    1/P of the optimizer state and a shard of the summed gradient beside its
    whole gradient.  The ranks on the machine come from the launcher's
    environment, without a collective (a rank that failed before this would
    meet it with its report, see Distributed.agree); an mpi4py communicator
    without them counts 1 (no worse than one process's check), any other (a
    communicator of threads: one process) its size."""
    import dataclasses
    nranks = int(comm.Get_size())
    if shard_optimizer is True and nranks > 1:
        state = -(-report.optimizer_state // nranks)
        grad_shard = -(-report.gradients // nranks)
        report = dataclasses.replace(
            report, optimizer_state=state, gradients=report.gradients + grad_shard,
            total=report.total - report.optimizer_state + state + grad_shard)
    mpi = type(comm).__module__.startswith("mpi4py")
    return report, _launcher_local_ranks(comm, 1 if mpi else None)


def _usable_cpus():
    """The CPUs this process may run on (its affinity mask), as the kernel pool
    counts them for its default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def _cores():
    """The cores this machine's ranks share out."""
    return _usable_cpus()


def set_rank_threads(nthreads=None, comm=None):
    """Set this process's threads: ggmlopt's kernel pool (set_num_threads) and
    the BLAS pool (threadpoolctl).

    nthreads: int >= 1, or None for cores / ranks on this machine (comm given:
    an mpi4py communicator's ranks on this machine come from MPI's shared-memory
    split, ``comm.Split_type(MPI.COMM_TYPE_SHARED)``, see local_ranks), at least
    1.  Returns the kernel threads set (the pool runs at most 64).  Several ranks on one machine each starting a
    thread per core oversubscribe the cores; an OptContext (or fit) over an
    mpi4py communicator does this by itself when the process has not chosen its
    threads (see auto_rank_threads); call it to choose another count.
    """
    global _threads_chosen
    if nthreads is None:
        per_node = local_ranks(comm) if comm is not None else 1
        nthreads = max(1, _cores() // max(1, per_node))
    if isinstance(nthreads, bool) or not isinstance(nthreads, int) or nthreads < 1:
        raise ValueError(f"nthreads: expected an int >= 1 or None, got {nthreads!r}")
    kernels.set_num_threads(nthreads)
    _set_blas_threads(nthreads)
    _threads_chosen = True
    return kernels.get_num_threads()   # (the pool runs at most 64)


def _set_blas_threads(nthreads):
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    global _blas_limits
    _blas_limits = threadpool_limits(limits=nthreads, user_api="blas")


_blas_limits = None  # kept alive: the BLAS limit holds while it exists
_threads_chosen = False  # set_rank_threads ran in this process
_BLAS_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS")


def auto_rank_threads(comm):
    """The threads a rank takes without being told (OptContext and fit over an
    mpi4py communicator call it): cores / ranks on this machine (local_ranks, at
    least 1) for the kernel pool unless GGMLOPT_NUM_THREADS is set, and for BLAS
    unless OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS or
    BLIS_NUM_THREADS is; nothing when set_rank_threads already ran or the kernel
    threads were changed from their default (one per CPU the affinity mask
    allows).  So
    ``mpiexec -n 2`` on a 2-core machine runs one thread per rank.  Returns
    (kernel threads, BLAS threads or None when BLAS was left alone); a collective
    for an mpi4py comm (its shared-memory split)."""
    default = min(_usable_cpus(), 64)  # the kernel pool's own choice: the CPUs it may use
    if _threads_chosen or kernels.get_num_threads() != default:
        return kernels.get_num_threads(), None
    nthreads = max(1, _cores() // max(1, local_ranks(comm)))
    if not os.environ.get("GGMLOPT_NUM_THREADS"):
        kernels.set_num_threads(nthreads)
    blas = None
    if not any(os.environ.get(v) for v in _BLAS_THREAD_ENV):
        _set_blas_threads(nthreads)
        blas = nthreads
    return kernels.get_num_threads(), blas
