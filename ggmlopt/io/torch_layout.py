"""A model's parameters in torch's layout: the names and shapes of the state_dict
of the equivalent torch module.

Names come from ``ggmlopt.nn.named_parameters`` (``0.weight``, ``2.bias`` in a
Sequential, attribute names in a user's module).  Shapes are torch's: a
``Linear`` weight, stored here as (in_features, out_features), is transposed to
torch's (out_features, in_features); every other parameter (``Conv2d``'s
(out, in, kh, kw) kernel, biases) already has torch's shape and is taken as it
is.  Every exporter (GGUF, safetensors) goes through this one mapping.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..nn.linear import Linear
from ..nn.lora_layers import LoRAEmbedding
from ..nn.module import named_layers, named_parameters
from ..nn.parameter import Parameter
from ..nn.quantized import refuse_quantized

__all__ = ["TorchTensor", "assign_torch_arrays", "torch_tensors"]


class TorchTensor(NamedTuple):
    """One parameter as torch sees it: its state_dict name, the Parameter, and
    whether torch's array is the transpose of ``param.data`` (Linear weights)."""

    name: str
    param: Parameter
    transposed: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """torch's shape of the parameter."""
        shape = self.param.data.shape
        return shape[::-1] if self.transposed else shape

    def to_torch(self) -> np.ndarray:
        """A new float32 C-contiguous array in torch's layout."""
        data = self.param.data
        return np.ascontiguousarray(data.T if self.transposed else data, dtype=np.float32).copy()

    def from_torch(self, array: np.ndarray) -> np.ndarray:
        """A torch-layout array (already shape-checked) as a float32 array of
        ``param.data``'s shape."""
        return np.asarray(array.T if self.transposed else array, dtype=np.float32)


def torch_tensors(model) -> list[TorchTensor]:
    """The model's parameters in torch's layout, in named_parameters order.

    Raises TypeError when model has no parameters() method, ValueError when it
    has no parameters or when a parameter has no name (see
    ggmlopt.nn.named_parameters)."""
    if not callable(getattr(model, "parameters", None)):
        raise TypeError(f"model: expected a model with parameters(), got {type(model).__name__}")
    refuse_quantized(model, "a torch-layout file")
    named = named_parameters(model)
    if not named:
        raise ValueError("model: it has no parameters to save or load")
    # a LoRALinear's adapters are (in, rank) and (rank, out) matrices too: torch's
    # layout (PEFT's lora_A, lora_B) is their transpose, as for the weight
    # (so are an embedding adapter's: PEFT's lora_embedding_A (r, vocab), _B (dim, r));
    # a layer inside a Checkpoint counts as itself
    linear_weights = {id(p) for _, m in named_layers(model) if isinstance(m, Linear)
                      for p in (m.weight, getattr(m, "lora_a", None), getattr(m, "lora_b", None))
                      if p is not None}
    linear_weights |= {id(p) for _, m in named_layers(model) if isinstance(m, LoRAEmbedding)
                       for p in (m.lora_a, m.lora_b)}
    return [TorchTensor(name, p, id(p) in linear_weights) for name, p in named]


def _as_float_array(name: str, value, source: str) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise TypeError(f"{source}: tensor {name!r} has dtype {array.dtype}; expected floats")
    return array


def assign_torch_arrays(tensors: list[TorchTensor], arrays: Mapping[str, np.ndarray],
                        source: str) -> None:
    """Copy arrays (name -> torch-layout array) into the parameters, in place
    (``param.data[...] = ...``, so views an OptContext holds stay valid).

    Every name must be there and no other, with torch's shape and a float
    dtype; everything is checked before anything is copied, so on error
    (ValueError naming the tensors, TypeError for a non-float dtype) the model
    is unchanged.  source names the file in messages."""
    expected = {t.name for t in tensors}
    missing = [t.name for t in tensors if t.name not in arrays]
    unexpected = [name for name in arrays if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"tensors the model has no parameter for {unexpected}")
        raise ValueError(f"{source}: does not match the model: {'; '.join(parts)}")
    converted = []
    for t in tensors:
        array = _as_float_array(t.name, arrays[t.name], source)
        if array.shape != t.shape:
            raise ValueError(f"{source}: tensor {t.name!r} has shape {array.shape}; the model "
                             f"expects {t.shape} (torch's layout)")
        converted.append(t.from_torch(array))
    for t, value in zip(tensors, converted):
        t.param.data[...] = value
