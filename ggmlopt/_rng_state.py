"""A NumPy generator's state as the JSON text that checkpoints keep, and back:
what ggmlopt.checkpoint and ggmlopt.rank_rng (each rank's stream) both need."""
from __future__ import annotations

import json

import numpy as np

__all__ = ["checked_rng_state", "rng_state_from_json", "rng_state_to_json"]


def rng_state_to_json(bit_generator):
    """The bit generator's state as JSON text (arrays as lists with their dtype)."""
    def encode(obj):
        if isinstance(obj, np.ndarray):
            return {"__ndarray__": obj.dtype.str, "data": obj.tolist()}
        if isinstance(obj, np.integer):
            return int(obj)
        raise TypeError(f"rng state: cannot encode {type(obj).__name__}")
    return json.dumps(bit_generator.state, default=encode, sort_keys=True)


def rng_state_from_json(text):
    """The state dict of rng_state_to_json's text (ValueError for another text)."""
    def decode(obj):
        if "__ndarray__" in obj:
            return np.array(obj["data"], dtype=np.dtype(obj["__ndarray__"]))
        return obj
    try:
        state = json.loads(text, object_hook=decode)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rng_state: not a generator state ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("bit_generator"), str):
        # a bad value inside a saved string, not a bad argument type
        raise ValueError("rng_state: not a generator state (no 'bit_generator' name)")  # noqa: TRY004
    return state


def checked_rng_state(text, bit_generator_type):
    """The state parsed from text, after trying it on a fresh generator of the type."""
    state = rng_state_from_json(text)
    if state["bit_generator"] != bit_generator_type.__name__:
        raise ValueError(f"rng_state: the checkpoint's generator is {state['bit_generator']}, "
                         f"the context's is {bit_generator_type.__name__}")
    try:
        bit_generator_type().state = state
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        raise ValueError(f"rng_state: not a valid {bit_generator_type.__name__} state "
                         f"({e})") from None
    return state
