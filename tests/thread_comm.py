"""A communicator of threads with mpi4py's buffer methods, so that the data-parallel
code runs P ranks inside one pytest process (no MPI needed).

Every collective posts each rank's buffer, waits for all, and combines them in rank
order (sums in rank order, so every rank gets the same bits, as MPI's reductions do).
A barrier timeout turns a hang (a rank that never joins) into BrokenBarrierError.

The non-blocking collectives (Iallreduce, Ireduce_scatter) copy the buffer as it
is when they start (so a bucket started before its gradients were final gives a
wrong sum) and exchange at Wait (Request: Wait, Test, Waitall, Testall as
mpi4py's; every rank waits for its requests in their start order, as MPI's
collectives match); a request never waited for is left behind, as MPI allows.
``Dup`` gives a communicator over a new group of the same ranks.  ``group.calls``
logs every collective; ``group.log`` is a list tests may append their own events
to, in one order with the collectives.
"""
from __future__ import annotations

import threading

import numpy as np

TIMEOUT = 60.0


class ThreadGroup:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots = [None] * size
        self.calls = []  # (rank, method name) of every collective, for tests
        self.log = []    # (rank, event): the collectives and the tests' own events


class Request:
    """A non-blocking collective: run(), the blocking collective on the copy made at
    the start, runs at the first Wait."""

    def __init__(self, run):
        self._run = run
        self.waited = False

    def Wait(self):
        if not self.waited:
            self.waited = True
            self._run()

    def Test(self):
        return self.waited  # the ranks move on together only in Wait

    @classmethod
    def Waitall(cls, requests):
        for r in requests:
            r.Wait()

    @classmethod
    def Testall(cls, requests):
        done = [r.Test() for r in requests]  # every one tested, as MPI's
        return all(done)



class ThreadComm:
    def __init__(self, group, rank):
        self.group = group
        self.rank = rank

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.group.size

    def _exchange(self, name, buf):
        g = self.group
        g.calls.append((self.rank, name))
        g.log.append((self.rank, name))
        g.slots[self.rank] = np.array(buf, copy=True)
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()
        return parts

    @staticmethod
    def _sum(parts):
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total

    def Allreduce(self, sendbuf, recvbuf, op=None):
        recvbuf[...] = self._sum(self._exchange("Allreduce", sendbuf)).reshape(recvbuf.shape)

    def Iallreduce(self, sendbuf, recvbuf, op=None):
        self._exchange_as("Iallreduce")
        send = np.array(sendbuf, copy=True)
        return Request(lambda: self.Allreduce(send, recvbuf, op))

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=None):
        self._exchange_as("Ireduce_scatter")
        send = np.array(sendbuf, copy=True)
        return Request(lambda: self.Reduce_scatter(send, recvbuf, recvcounts, op))

    def Dup(self):
        g = self.group
        g.calls.append((self.rank, "Dup"))
        g.log.append((self.rank, "Dup"))
        g.barrier.wait()
        if self.rank == 0:
            g.dup = ThreadGroup(g.size)
            g.dup.calls, g.dup.log = g.calls, g.log  # one log for the tests
        g.barrier.wait()
        new = ThreadComm(g.dup, self.rank)
        g.barrier.wait()
        return new

    def _exchange_as(self, name):
        """Log a non-blocking collective under its own name (it runs as the blocking one)."""
        self.group.calls.append((self.rank, name))
        self.group.log.append((self.rank, name))

    def Bcast(self, buf, root=0):
        buf[...] = self._exchange("Bcast", buf)[root]

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=None):
        total = self._sum(self._exchange("Reduce_scatter", sendbuf)).ravel()
        start = sum(recvcounts[:self.rank])
        recvbuf[...] = total[start:start + recvcounts[self.rank]]

    def Allgather(self, sendbuf, recvbuf):
        parts = self._exchange("Allgather", sendbuf)
        recvbuf.reshape(-1)[...] = np.concatenate([p.ravel() for p in parts])


def run_ranks(size, fn, timeout=TIMEOUT * 2):
    """fn(comm) on `size` threads; returns [(result, exception)] per rank."""
    group = ThreadGroup(size)
    out = [(None, None)] * size

    def run(rank):
        try:
            out[rank] = (fn(ThreadComm(group, rank)), None)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[rank] = (None, e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a rank hangs after {timeout} s")
    return out


def results(size, fn):
    """fn(comm) on `size` ranks; raises the first rank's exception, else the results."""
    out = run_ranks(size, fn)
    for r, (_, e) in enumerate(out):
        if e is not None:
            raise AssertionError(f"rank {r} raised {type(e).__name__}: {e}") from e
    return [res for res, _ in out]
