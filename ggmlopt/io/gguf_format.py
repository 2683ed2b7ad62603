"""GGUF files: models that ggml's programs load, with the ``gguf`` package (the
``interop`` extra: ``pip install ggmlopt[interop]``), imported only when used.

Two layouts, told apart by ``general.architecture``:

- ``"mnist-fc"`` / ``"mnist-cnn"``: ggml's examples/mnist models, exactly as
  ggml's ``mnist-eval`` loads them and ``mnist-train`` writes them (names,
  dimensions, data order: see ggmlopt.io.ggml_mnist).
- ``"ggmlopt"`` (GENERIC_ARCH), any other model: one tensor per parameter, named
  by ``named_parameters()`` (``0.weight``, ``2.bias`` ...), holding torch's
  layout (see ggmlopt.io.torch_layout), so its ggml ``ne`` is torch's shape
  reversed: a Linear weight has ne = (in_features, out_features) and a ggml
  program computes the layer as ``ggml_mul_mat(weight, x)``.  The key
  ``ggmlopt.tensor_layout`` = ``"torch"`` says so.

Weights are float32, or float16 with ``dtype=np.float16``: tensors of two or
more dimensions (weight matrices, kernels) become float16, one-dimensional ones
(biases) stay float32, as ggml's own converters do.
"""
from __future__ import annotations

from typing import Any, overload

import numpy as np

from ._files import atomic_output, input_path, output_path
from ._gguf_common import dtype_arg, gguf_module, metadata_items, refuse_adapter_file, stored
from ._gguf_length import gguf_truncation
from .ggml_mnist import MNIST_ARCHS, GgmlTensor
from .gguf_reader import GgufFile
from .torch_layout import TorchTensor, assign_torch_arrays, torch_tensors

__all__ = ["GENERIC_ARCH", "load_gguf", "save_gguf"]

GENERIC_ARCH = "ggmlopt"
_LLAMA_ARCH = "llama"  # llama.cpp's layout of a Llama: ggmlopt.io.gguf_llama
_LAYOUT_KEY = "ggmlopt.tensor_layout"
_GGML_MAX_NAME = 63  # GGML_MAX_NAME - 1 bytes of a tensor name


def _arch_arg(arch) -> str:
    if arch is None:
        return GENERIC_ARCH
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a str or None, got {type(arch).__name__}")
    if arch != GENERIC_ARCH and arch not in MNIST_ARCHS and arch != _LLAMA_ARCH:
        raise ValueError(f"arch: expected None, {GENERIC_ARCH!r}, {_LLAMA_ARCH!r} or one of "
                         f"{sorted(MNIST_ARCHS)}, got {arch!r}")
    return arch


def _mnist_tensors(tensors: list[TorchTensor], arch: str) -> list[GgmlTensor]:
    """The ggml tensors of arch, after checking that the model's parameters are
    that model's (same count, order, torch shapes, Linear weights where ggml has
    a dense layer)."""
    specs = MNIST_ARCHS[arch]
    have = [(t.shape, t.transposed) for t in tensors]
    want = [(s.torch_shape, s.linear_weight) for s in specs]
    if have != want:
        raise ValueError(f"model: it is not ggml's {arch} model: expected parameters of torch "
                         f"shapes {[s.torch_shape for s in specs]} (Linear weights at "
                         f"{[i for i, s in enumerate(specs) if s.linear_weight]}), got "
                         f"{[t.shape for t in tensors]} (Linear weights at "
                         f"{[i for i, t in enumerate(tensors) if t.transposed]})")
    return list(specs)


def _file_layout(model) -> str | None:
    """The io module that writes model's llama.cpp file ("llama": gguf_llama,
    "gpt2": gguf_gpt2), from its family; None for a model of no family."""
    from ..models.registry import family_of
    try:
        return family_of(model).gguf_layout
    except TypeError:
        return None


def save_gguf(model, path, arch=None, metadata=None, *, dtype=np.float32,
              tokenizer=None) -> None:
    """Write model's parameters to path as a GGUF file (atomically).

    arch: None or "ggmlopt" for the generic layout (every model), or "mnist-fc" /
    "mnist-cnn" for ggml's MNIST models as ggml's mnist-eval loads them (the
    model must have exactly that model's parameters).  A ggmlopt.models.Llama
    with arch None (or "llama") is written as llama.cpp loads it, with its
    tokenizer (required: a ByteTokenizer, BPETokenizer, SPMTokenizer or a Hugging
    Face checkpoint's HFTokenizer from load_hf_tokenizer; see
    ggmlopt.io.gguf_llama.save_llama_gguf); a ggmlopt.models.GPT2 given a
    tokenizer as llama.cpp's gpt2 (ggmlopt.io.gguf_gpt2; without one, the
    generic layout).
    metadata: optional dict of extra keys (str -> bool, int, float or str),
    stored as GGUF key-values (int64 / float64 / string).
    dtype: np.float32 (default) or np.float16 for the weights (two or more
    dimensions), or llama.cpp's names "f32" and "f16"; biases stay float32.  mnist-cnn is float32 only (mnist-eval
    asserts it).  A Llama-family model or a GPT2 written for llama.cpp also
    takes llama-quantize's file types ("q8_0", "q4_k_m", "q6_k", "bf16", ...:
    see save_llama_gguf).

    Raises ValueError for a model that does not fit arch, an unnamed parameter,
    a tensor name longer than 63 bytes or a weight beyond float16's range;
    FileNotFoundError when path's directory does not exist; ImportError naming
    the ``interop`` extra without the gguf package.
    """
    layout = _file_layout(model)
    if layout == "gpt2" and tokenizer is not None and arch is None:
        from .gguf_gpt2 import save_gpt2_gguf  # llama.cpp's gpt2
        save_gpt2_gguf(model, path, tokenizer=tokenizer, dtype=dtype, metadata=metadata)
        return
    llama_layout = arch == _LLAMA_ARCH or (arch is None and layout == "llama")
    arch = _arch_arg(arch)
    if arch == _LLAMA_ARCH and layout != "llama":
        raise ValueError(f"arch: expected None, {GENERIC_ARCH!r} or one of {sorted(MNIST_ARCHS)} "
                         f"for a {type(model).__name__} ({_LLAMA_ARCH!r} is for a "
                         "ggmlopt.models.Llama)")
    if llama_layout:
        if tokenizer is None:
            raise ValueError("tokenizer: a Llama's GGUF for llama.cpp needs its tokenizer "
                             "(save_gguf(llama, path, tokenizer=ByteTokenizer())), or "
                             "arch='ggmlopt' for the generic layout")
        from .gguf_llama import save_llama_gguf
        save_llama_gguf(model, path, tokenizer=tokenizer, dtype=dtype, metadata=metadata)
        return
    if tokenizer is not None:
        raise ValueError(f"tokenizer: only a Llama written for llama.cpp takes one, not "
                         f"arch={arch!r}")
    dtype = dtype_arg(dtype)
    path = output_path(path)
    tensors = torch_tensors(model)
    gguf = gguf_module()
    items = metadata_items(metadata, gguf)

    if arch == GENERIC_ARCH:
        names = [t.name for t in tensors]
        arrays = [t.to_torch() for t in tensors]
    else:
        if dtype == np.float16 and arch == "mnist-cnn":
            raise ValueError("dtype: ggml's mnist-eval asserts float32 for every mnist-cnn "
                             "tensor; save mnist-cnn as float32 (or float16 with arch=None)")
        specs = _mnist_tensors(tensors, arch)
        names = [s.name for s in specs]
        arrays = [s.ggml_array(t.to_torch()) for s, t in zip(specs, tensors)]
    for name in names:
        if len(name.encode()) > _GGML_MAX_NAME:
            raise ValueError(f"model: parameter name {name!r} is longer than ggml's "
                             f"{_GGML_MAX_NAME} bytes")
    arrays = [stored(n, a, dtype) for n, a in zip(names, arrays)]

    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            if arch == GENERIC_ARCH:
                writer.add_string(_LAYOUT_KEY, "torch")
            for key, value, vtype in items:
                writer.add_key_value(key, value, vtype)
            for name, array in zip(names, arrays):
                writer.add_tensor(name, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


class _GgufContents:
    """What load_gguf reads: the key-values (plain Python values) and each tensor's
    ggml ne, type name and float32 data (a copy: the file is closed after)."""

    def __init__(self, path: str, gguf):
        # a file cut short says so, whichever field the reader would trip over; a
        # file cut inside the last tensor's padding too, as ggml refuses it
        short = gguf_truncation(path, gguf.GGML_QUANT_SIZES)
        if short is not None:
            raise ValueError(f"path: {path!r} is a truncated GGUF file ({short})")
        # what gguf.cpp refuses (a version, a shape, a tensor's offset), which
        # GGUFReader reads as garbage
        try:
            GgufFile(path)
        except ValueError as e:
            why = str(e).removeprefix(f"path: {path!r}").lstrip(": ")
            raise ValueError(f"path: {path!r} is not a valid GGUF file ({why})") from None
        try:
            reader = gguf.GGUFReader(path)
            self.fields = {name: _field_value(field, gguf)
                           for name, field in reader.fields.items()
                           if not name.startswith("GGUF.")}
            self.tensors = {}
            for t in reader.tensors:
                self.tensors[t.name] = (tuple(int(n) for n in t.shape), t.tensor_type.name,
                                        _as_float32(t, gguf))
        except (ValueError, IndexError, KeyError, TypeError, OverflowError,
                UnicodeDecodeError) as e:
            raise ValueError(f"path: {path!r} is not a valid GGUF file ({e})") from None
        finally:
            reader = None  # drop the memory map

    def arch(self, path: str) -> str:
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            # a bad value inside the file, not a bad argument type
            raise ValueError(f"path: {path!r} has no general.architecture string; "  # noqa: TRY004
                             "not a model file")
        return arch


def _field_value(field, gguf):
    """A key-value's plain Python value (str, int, float, bool, or a list of them);
    decoded from the reader's parts, which every gguf version has."""
    vt = gguf.GGUFValueType

    def one(part, kind):
        if kind == vt.STRING:
            return bytes(part).decode("utf-8")
        value = part.tolist()[0]
        return bool(value) if kind == vt.BOOL else value

    if not field.types:
        return None
    if field.types[0] == vt.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _as_float32(t, gguf) -> np.ndarray | None:
    kind = gguf.GGMLQuantizationType
    if t.tensor_type in (kind.F32, kind.F16, kind.F64):
        return np.array(t.data, dtype=np.float32)
    if t.tensor_type == kind.BF16:
        raw = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(tuple(int(n) for n in t.shape[::-1]))
    return None  # quantized: refused when the model needs it


def _padded(ne) -> tuple[int, ...]:
    return tuple(ne) + (1,) * (4 - len(ne))


@overload
def load_gguf(path, model: None = None, *, arch: str | None = None,
              keep_types: bool = False) -> tuple[Any, Any]: ...
@overload
def load_gguf(path, model: Any, *, arch: str | None = None,
              keep_types: bool = False) -> dict[str, Any]: ...


def load_gguf(path, model=None, *, arch=None, keep_types=False):
    """Load a GGUF file written by save_gguf, or by ggml's mnist-train (mnist-fc,
    mnist-cnn), or a llama-architecture file (llama.cpp's), into model's
    parameters, in place.

    Without model, the file must be a llama-family GGUF (or llama.cpp's gpt2,
    which gives a ggmlopt.models.GPT2): returns
    ``(llama, tokenizer)``, a ggmlopt.models.Llama built from the file and its
    tokenizer (ByteTokenizer, BPETokenizer, SPMTokenizer, MetaspaceBPETokenizer
    or WordPieceTokenizer, by the file's tokenizer model; None with a
    UserWarning for another, T5's unigram); see
    ggmlopt.io.gguf_llama.load_llama_gguf, which also reads quantized tensors
    (dequantized with a UserWarning).  A Llama
    model given loads a llama-architecture file the same way.
    ``keep_types=True`` keeps the weight matrices in the file's types, read in
    place (QuantizedLinear layers, for LoRA over a quantized base: QLoRA).

    The file's general.architecture decides the layout ("ggmlopt", "mnist-fc",
    "mnist-cnn"); arch, when given, is the one the file must have.  Every tensor
    the model needs must be there with its exact ggml dimensions, and no other;
    types float32, float16 and bfloat16 are read (converted to float32).

    Returns the file's key-values (``general.architecture`` and any metadata
    saved with it) as a dict.  Raises ValueError for a truncated or foreign file,
    another architecture, a missing, extra or wrongly shaped tensor;
    TypeError for a quantized tensor; FileNotFoundError for a missing file.  On
    any error the model is unchanged.
    """
    if arch is not None:
        arch = _arch_arg(arch)
    path = input_path(path)
    if model is None or _file_layout(model) == "llama":
        from ..models.registry import family_for_gguf
        from .gguf_llama import LLAMA_FAMILY, file_architecture, load_llama_gguf
        if model is None:
            family = family_for_gguf(file_architecture(path)) if arch is None else None
            if family is not None and family.gguf_layout == "gpt2":
                if keep_types:
                    raise ValueError("keep_types: a gpt2 file is read in float32 (its kept "
                                     "types are for the llama family)")
                from .gguf_gpt2 import load_gpt2_gguf
                return load_gpt2_gguf(path)
            if arch not in (None, _LLAMA_ARCH):
                raise ValueError(f"model: required to load a {arch!r} file (only a "
                                 f"{_LLAMA_ARCH!r} one builds its own model)")
            return load_llama_gguf(path, keep_types=keep_types)
        if arch in (None, _LLAMA_ARCH) and file_architecture(path) in LLAMA_FAMILY:
            return load_llama_gguf(path, model, keep_types=keep_types)
    if keep_types:
        raise ValueError("keep_types: only a llama-family file builds a model of the file's "
                         "types (load it with model=None)")
    tensors = torch_tensors(model)
    gguf = gguf_module()
    contents = _GgufContents(path, gguf)
    refuse_adapter_file(contents.fields, path)
    file_arch = contents.arch(path)
    if arch is not None and file_arch != arch:
        raise ValueError(f"path: {path!r} holds a {file_arch!r} model, expected {arch!r}")
    source = f"{path} ({file_arch})"

    if file_arch == GENERIC_ARCH:
        layout = contents.fields.get(_LAYOUT_KEY, "torch")
        if layout != "torch":
            raise ValueError(f"path: {path!r} has {_LAYOUT_KEY}={layout!r}; expected 'torch'")
        wanted = [(t.name, _padded(t.shape[::-1])) for t in tensors]
    elif file_arch in MNIST_ARCHS:
        try:
            specs = _mnist_tensors(tensors, file_arch)
        except ValueError as e:
            raise ValueError(f"path: {path!r} holds ggml's {file_arch} model, which does not "
                             f"fit this model: {e}") from None
        wanted = [(s.name, _padded(s.ne)) for s in specs]
    else:
        raise ValueError(f"path: {path!r} holds a {file_arch!r} model; load_gguf reads "
                         f"{GENERIC_ARCH!r}, 'mnist-fc' and 'mnist-cnn' into a model, and "
                         f"{_LLAMA_ARCH!r} into a Llama")

    names = [name for name, _ in wanted]
    missing = [n for n in names if n not in contents.tensors]
    unexpected = [n for n in contents.tensors if n not in names]
    if missing or unexpected:
        parts = ([f"missing tensors {missing}"] if missing else []) + \
            ([f"tensors the model has no parameter for {unexpected}"] if unexpected else [])
        raise ValueError(f"{source}: does not match the model: {'; '.join(parts)}")
    arrays = {}
    for i, ((name, ne), t) in enumerate(zip(wanted, tensors)):
        file_ne, type_name, data = contents.tensors[name]
        if _padded(file_ne) != ne:
            raise ValueError(f"{source}: tensor {name!r} has ggml dims (ne) {_padded(file_ne)}; "
                             f"the model needs {ne}")
        if data is None:
            raise TypeError(f"{source}: tensor {name!r} has type {type_name}; load_gguf reads "
                            "F32, F16 and BF16")
        # to torch's layout, under the model's parameter name
        arrays[t.name] = data.reshape(t.shape) if file_arch == GENERIC_ARCH else \
            specs[i].torch_array(data)
    assign_torch_arrays(tensors, arrays, source)
    return dict(contents.fields)
