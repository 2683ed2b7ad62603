"""Per-rank random streams for data-parallel training (ggmlopt.distributed).

With one process an OptContext has one generator, ``ctx.rng``: it shuffles the
dataset and feeds the model's random draws (Dropout masks).  Over P ranks the
shuffles must stay shared (every rank computes the same permutation), but the
model's draws must not: P ranks drawing one mask would train on P copies of it.
So a context with ``comm`` has two generators:

* ``ctx.rng``: the shared one, the same state on every rank (dataset shuffles);
* ``ctx.model_rng``: this rank's own stream, given to the model's modules
  (``set_rng``).  Rank r's stream is a numpy ``SeedSequence`` whose entropy is a
  hash of the shared generator's state when the context is built and whose
  spawn key is ``(r,)``, of the shared generator's bit generator type (PCG64 by
  default).  The same seed and rank count therefore give the same run; two ranks
  never share a stream; the shared generator draws nothing for it.

Checkpoints.  ``ctx.state_dict()`` with comm gathers every rank's stream state
(a collective: every rank calls it, as fit and ``ctx.save`` do) into the entry
``rank_rng_states`` (a JSON list, rank 0's first), next to ``rng_state``.
Loading it on the same number of ranks restores each rank's own stream, so a
resume continues bit for bit.  On another number of ranks (or from a state
without the entry, e.g. one process's) each rank derives a fresh stream as at
construction, from the loaded shared state and its rank: deterministic (the
same checkpoint resumed twice gives the same run) but, necessarily, not the
draws the old ranks would have made.  One process loading a state of several
ranks ignores the entry: its model draws from ``ctx.rng``, as always.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from ._rng_state import checked_rng_state, rng_state_to_json

__all__ = ["gather_states", "parse_states", "rank_generator", "restore"]


def rank_generator(shared: np.random.Generator, rank: int) -> np.random.Generator:
    """rank's own generator (see the module docstring): derived from the state of
    shared (not advanced) and rank >= 0, of shared's bit generator type."""

    state = rng_state_to_json(shared.bit_generator).encode()
    entropy = int.from_bytes(hashlib.blake2b(state, digest_size=16).digest(), "little")
    seq = np.random.SeedSequence(entropy, spawn_key=(int(rank),))
    return np.random.Generator(type(shared.bit_generator)(seq))


def gather_states(dist: Any, generator: np.random.Generator) -> str:
    """Every rank's generator state as a JSON list in rank order (a collective
    over dist, a ggmlopt.distributed.Distributed)."""

    mine = np.frombuffer(rng_state_to_json(generator.bit_generator).encode(), np.uint8)
    lengths = np.zeros(dist.size, np.int64)
    dist._allgather(np.array([mine.size], np.int64), lengths)
    width = int(lengths.max())
    send = np.zeros(width, np.uint8)
    send[:mine.size] = mine
    recv = np.zeros((dist.size, width), np.uint8)
    dist._allgather(send, recv)
    states = [json.loads(bytes(row[:n]).decode()) for row, n in zip(recv, lengths)]
    return json.dumps(states, sort_keys=True)


def parse_states(text: str, bit_generator_type: type) -> list[dict[str, Any]]:
    """The states of a ``rank_rng_states`` entry, each checked on a fresh
    generator of the type (ValueError when one is not a valid state)."""

    try:
        states = json.loads(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rank_rng_states: not a list of generator states ({e})") from None
    if not isinstance(states, list) or not states:
        raise ValueError("rank_rng_states: not a list of generator states")
    return [checked_rng_state(json.dumps(s), bit_generator_type) for s in states]


def restore(ctx: Any, states: list[dict[str, Any]] | None) -> None:
    """Set ctx.model_rng after ctx.rng was loaded: this rank's saved state when
    states (parse_states) has one per rank, else a stream derived afresh."""
    dist = ctx.distributed
    if states is not None and len(states) == dist.size:
        ctx.model_rng.bit_generator.state = states[dist.rank]
    else:
        ctx.model_rng = rank_generator(ctx.rng, dist.rank)
