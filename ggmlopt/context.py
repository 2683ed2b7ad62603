"""OptContext: ggml's ggml_opt_context for a Python model.

One context drives one model: it owns the parameter arena (parameters,
gradients, gradient accumulator, AdamW momenta), the batch buffers (static
mode), the loss and its gradient, and the counters ggml keeps (iter, opt_i, the
build type of the last alloc).  Every eval is one physical batch:
``ctx.alloc(backward); <fill ctx.inputs / ctx.labels>; ctx.eval(result)``.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import numpy.typing as npt

from . import checkpoint, gemm, kernels
from ._arena import ParamArena
from ._args import enum_arg, int_arg
from ._memory import AlignedBuffer
from .clipping import check_max_norm
from .nn.module import TrainingProtocol, eval_mode, in_use
from .nn.parameter import Parameter
from .nn.quantized import refuse_full_finetune_of_quantized
from .optim_params import (
    BuildType,
    LossType,
    OptimizerParams,
    OptimizerType,
    default_optimizer_params,
)
from .optimizers import Optimizer, optimizer_arg
from .result import Result
from .step_in_backward import StepInBackward

__all__ = ["GradientExchange", "OptContext", "checks_before_taking"]

F32 = np.float32
# a check fit runs on the built context before it takes the model's parameters
_BEFORE_TAKING: ContextVar[Callable[[OptContext], object] | None] = ContextVar(
    "ggmlopt_before_taking", default=None)


@contextmanager
def checks_before_taking(check: Callable[[OptContext], object]) -> Iterator[None]:
    """Within the block, every OptContext calls check(ctx) once it is built and
    before it takes the model's parameters (fit checks its dataset there, so a
    mismatch leaves the model untouched)."""
    token = _BEFORE_TAKING.set(check)
    try:
        yield
    finally:
        _BEFORE_TAKING.reset(token)
# std::mt19937's default seed: without a seed, shuffles repeat from run to run, as in ggml
DEFAULT_SEED = 5489


def _class_indices(a, name):
    """a as C-contiguous int32 class indices: (n,) from an integer array of shape
    (n,) or (n, 1), (n, positions) from one of that shape (sequence labels); None
    when a is not an integer array.  -1 masks a row."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2):
        return None
    if a.size and (a.min() < -1 or a.max() > np.iinfo(np.int32).max):
        raise IndexError(f"{name}: class indices must be >= 0 (or -1 to mask a position) and "
                         f"fit an int32, got values from {a.min()} to {a.max()}")
    if a.ndim == 2 and a.shape[1] == 1:
        a = a.reshape(-1)
    return np.ascontiguousarray(a, dtype=np.int32)


def _token_matrix(a, name, ncols=None):
    """a as a C-contiguous 2-D int32 array of token ids (copied only when needed)."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: this context takes token ids (inputs_dtype=int32): "
                        f"expected integers, got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] < 1 or (ncols is not None and a.shape[1] != ncols):
        want = f"(batch >= 1, {ncols})" if ncols is not None else "(batch >= 1, n)"
        raise ValueError(f"{name}: expected shape {want}, got {a.shape}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name}: token ids must fit an int32, got values from {a.min()} "
                         f"to {a.max()}")
    return np.ascontiguousarray(a, dtype=np.int32)


def _f32_matrix(a, name, ncols=None):
    """a as a C-contiguous 2-D float32 array (copied only when needed)."""
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] < 1 or (ncols is not None and a.shape[1] != ncols):
        want = f"(batch >= 1, {ncols})" if ncols is not None else "(batch >= 1, n)"
        raise ValueError(f"{name}: expected shape {want}, got {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _trains(p) -> bool:
    """Whether p trains (requires_grad; objects without the attribute train)."""
    return bool(getattr(p, "requires_grad", True))


def first_nonfinite(a) -> tuple[int, float] | None:
    """(row, value) of the first NaN or inf in a float array (batch, ...), else None."""
    if a is None or a.dtype.kind != "f":
        return None
    bad = ~np.isfinite(a)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return where[0], float(a[where])


def _checked_precision(precision: object) -> str:
    """precision as 'f32' or 'bf16'; 'f32', with a warning saying why, when bf16
    was asked for and this machine has no native bf16 products."""
    name = gemm.check_precision(precision)
    if name == "bf16":
        native, why = gemm.bf16_support()
        if not native:
            # (called by OptContext.__init__'s checks: the warning names its caller)
            warnings.warn(f"precision='bf16': {why}; training in float32", UserWarning,
                          stacklevel=4)
            return "f32"
    return name


def _warn_float32_convolutions(model) -> None:
    """precision='bf16' reaches Linear layers and output heads; a convolution
    multiplies in float32 whatever the precision (its direct kernels and im2col
    products have no bf16 form): a model with some says so, so that a CNN's
    speed is not taken for bf16's."""
    from .nn.conv import Conv2d
    from .nn.module import modules

    convs = sum(isinstance(m, Conv2d) for m in modules(model))
    if convs:
        warnings.warn(f"precision='bf16': the model's {convs} Conv2d layer"
                      f"{'s multiply' if convs > 1 else ' multiplies'} in float32 (bf16 "
                      "products are Linear layers' and output heads' only)", UserWarning,
                      stacklevel=4)


def _follows_get_opt_pars(optimizer) -> bool:
    """Whether the optimizer reads get_opt_pars (it overrides hyperparameters),
    rather than settings fixed when it was made (Optimizer's default)."""
    return type(optimizer).hyperparameters is not Optimizer.hyperparameters


def _warn_hidden_parameters(model, params) -> None:
    """Trainable parameters where the module tree is not walked and that the
    model's parameters() (params) does not give either (torch registers them, so
    a torch user's model would train them): said, not left silent."""
    from .nn.module import hidden_parameters
    hidden = hidden_parameters(model, params)
    if hidden:
        warnings.warn(f"model: {', '.join(hidden[:5])}{', ...' if len(hidden) > 5 else ''} "
                      f"hold{'s' if len(hidden) == 1 else ''} trainable parameters that "
                      f"parameters() does not reach (an attribute named with a leading '_', "
                      f"or a dict), so they do not train; ggmlopt's modules find sub-layers "
                      f"in public attributes and in lists or tuples of them", UserWarning,
                      stacklevel=4)


def _warn_nothing_in_bf16(model) -> None:
    """precision='bf16' reaches float32 Linear layers and output heads; a base
    kept in its file's types (QLoRA) multiplies its blocks in float32 and an
    adapter's thin products stay float32, so a kept model with nothing else
    trains in float32: said, not left silent (within float32 rounding of
    precision='f32', not bit for bit: a bf16 pass runs its float32 products on
    the bf16 engine's library)."""
    from .nn.embedding import Embedding
    from .nn.linear import Linear
    from .nn.module import modules
    from .nn.quantized import quantized_layers

    kept = quantized_layers(model)
    if not kept:
        return
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False))
    for m in modules(model):
        # (a LoRALinear over a kept base is a Linear whose weight is None)
        if isinstance(m, Linear) and getattr(m, "weight", None) is not None:
            return
        if tied and isinstance(m, Embedding) and getattr(m, "weight", None) is not None:
            return   # a float32 tied head multiplies in bf16
    warnings.warn(f"precision='bf16': nothing in this model multiplies in bf16, so it trains "
                  f"in float32: its {len(kept)} layers kept in their file's types "
                  f"(keep_types=True) multiply their blocks in float32, and LoRA adapters' "
                  f"products stay float32 (within float32 rounding of precision='f32', whose "
                  f"products run on another library; load with keep_types=False for bf16 "
                  f"products of float32 weights)", UserWarning, stacklevel=4)


def _nonfinite_cause(x, y, out) -> str:
    """Why a loss is not finite, for its error message: a NaN in the inputs may come
    from an inf there (inf - inf), so the inputs and labels are named first."""
    for what, a in (("inputs", x), ("labels", y), ("model's outputs", out)):
        if a is None:
            continue
        found = first_nonfinite(a)
        if found is not None:
            return f": the {what} hold {found[1]} in row {found[0]} of the batch"
    return ""


class GradientExchange:
    """The seam between a context and the processes it trains with: what the
    eval that steps needs to exchange, and when.  This one is a single
    process's: nothing to exchange.  ggmlopt.distributed.Distributed is the
    other (comm=...): it reads the context through its public attributes
    (arena, parameters(), optimizer, iter, clip_grad_norm, evals_per_step)."""

    def backward(self, ctx: OptContext, grad: np.ndarray | None) -> None:
        """The backward pass of the eval that ends a logical batch (an exchange
        may start as gradients become final)."""
        ctx.model.backward(grad)

    def step(self, ctx: OptContext, hyper: tuple[np.float32, ...]) -> bool:
        """Before the optimizer step: make the arena's gradients the sum over the
        processes.  True when it also clipped and stepped (a sharded optimizer),
        False to let the context clip and step."""
        return False


_ONE_PROCESS = GradientExchange()


class OptContext:
    """OptContext(model, batch_size=None, ne_datapoint=None, loss_type=LossType.MEAN,
    build_type=BuildType.OPT, opt_period=1, optimizer=OptimizerType.ADAMW,
    get_opt_pars=default_optimizer_params, get_opt_pars_ud=None, seed=None,
    clip_grad_norm=None, comm=None, shard_optimizer=False, *, class_labels=False,
    inputs_dtype=None, bucket_cap_mb=25.0)

    model: any object with parameters() (Parameters: float32 .data and .grad),
    forward(x) (batch, ne_datapoint) -> (batch, ne_out) and backward(grad_out).
    Its trainable parameters move into the context's arena; .data and .grad
    become views.  Frozen parameters (``requires_grad=False``) stay where they
    are, with no gradient and no optimizer memory, and no step changes them;
    gradient clipping and the ranks' exchanges see only the trainable ones.  A
    context built for GRAD or OPT needs at least one trainable parameter
    (ValueError otherwise); the split is fixed when the context is built (an
    alloc after a parameter's requires_grad changed raises RuntimeError).
    A model may also return one row of ne_out outputs per position,
    (batch, positions, ne_out), as a language model's logits (batch, n_ctx,
    vocab): the losses then run over every row (see class_labels).
    inputs_dtype: float32, or int32 for models that take token ids: ``inputs``
    is then an int32 buffer, and dynamic-mode inputs must be integers (passed as
    int32, not converted to float).  None (the default): the model's own
    ``inputs_dtype`` attribute when it has one (the language models of
    ggmlopt.models do), else float32.

    batch_size, ne_datapoint: static mode (ggml's static graphs): owned buffers
    ``inputs`` (batch_size, ne_datapoint) and ``labels`` (batch_size, ne_out), the
    latter None for MEAN and SUM.  batch_size=None: dynamic mode, where
    ``eval(result, inputs=x, labels=y)`` takes arrays of any batch size.
    class_labels: CROSS_ENTROPY only: the labels are class indices, in static
    mode an int32 ``labels`` buffer of shape (batch_size,) (a quarter of the
    memory of 10 one-hot floats); same loss, gradient and ncorrect as their
    one-hot encoding.  Dynamic mode needs no flag: integer labels of shape
    (batch,) or (batch, 1) given to eval are class indices.  With outputs
    (batch, positions, ne_out) the class labels are one per position, int32
    (batch, positions) (sequence labels: each position's next token), and -1
    masks a position: the loss is the mean over the labelled positions of the
    physical batch (torch's ``F.cross_entropy(..., ignore_index=-1)``), scaled
    by 1/opt_period as ggml does, and accuracy counts the labelled positions
    (``Result.nlabelled``).  -1 masks a datapoint's single class the same way.

    build_type: the furthest an eval may go (FORWARD, GRAD or OPT).  opt_period:
    physical batches per optimizer step (gradient accumulation).
    optimizer: OptimizerType.ADAMW or SGD (or their names), or any
    ggmlopt.optimizers.Optimizer (one class: its hyper-parameters, its state in
    the arena, its step; see ggmlopt.optimizers).
    get_opt_pars(get_opt_pars_ud) -> OptimizerParams is called at every optimizer
    step (the optimizer reads its hyper-parameters from what it returns); a get_opt_pars whose ``unit`` attribute is "step" (a per-step
    ggmlopt.schedules schedule) receives the context itself instead.
    seed: int or numpy Generator for ``rng`` (dataset shuffles, and the random
    numbers of the model's layers: Dropout); None uses a fixed default seed, so
    runs repeat, as in ggml.  ``model_rng`` is the generator the model's layers
    draw from: ``rng`` itself, except with comm, where each rank has its own
    stream derived from rng's state and the rank (see ggmlopt.rank_rng), so the
    ranks draw different masks while they shuffle alike.

    The model is told on every alloc whether the eval trains
    (``ggmlopt.nn.set_training(model, backward)``: ``model.train(mode)`` or
    ``model.training``) and is given ``model_rng`` (``ggmlopt.nn.set_rng``: each
    module's ``set_rng(rng)``), over the module tree as it is when the context
    is built; see ggmlopt.nn.module.  The forward pass on zeros that a static
    context makes at construction runs with training off.
    clip_grad_norm: None, or a float > 0: before every optimizer step the
    gradient is clipped to that global L2 norm (see ggmlopt.clipping).
    precision: "f32" (default) or "bf16": mixed precision where the CPU
    multiplies bf16 natively (AVX512-BF16, AMX; the products through Intel MKL,
    see ggmlopt.gemm): the layers' matrix products take bf16 copies of weights,
    activations and output gradients and sum in float32, while the weights,
    gradients and AdamW moments stay float32.  Elsewhere it warns and trains in
    float32 (``ctx.precision`` says which runs).

    comm: None, or an mpi4py communicator (data-parallel training over its ranks:
    opt_period counts the physical batches of a logical batch over all ranks and
    must be a multiple of their number; see ggmlopt.distributed).
    shard_optimizer: with comm, each rank keeps only its shard of the AdamW
    moments (optimizer memory per rank falls by the number of ranks).
    bucket_cap_mb: with comm, the MiB of gradients per bucket (float > 0, default
    25 as PyTorch DDP's ``bucket_cap_mb``): each bucket is exchanged as soon as
    the backward pass has finished its gradients, hidden behind the rest of it;
    None: one exchange of every gradient after the backward pass.  The sums are
    the same bits either way (see ggmlopt.distributed).

    optimizer_in_backward: True steps each parameter during the backward pass,
    as soon as its gradient is final, and lends gradients from a small pool
    instead of keeping one for every parameter (a full fine-tune's memory falls
    by about the size of the weights); the same numbers, bit for bit.  Needs
    opt_period=1, no clip_grad_norm, no comm; ``grad_acc`` is then refused.  See
    ggmlopt.step_in_backward.

    Checkpoints: ``state_dict()`` / ``load_state_dict(sd)``, ``save(path)`` /
    ``OptContext.load(path, model)`` (see ggmlopt.checkpoint).
    """

    # the BLAS threads of the last epoch (training.epoch sets it, fit records it)
    _blas_threads: int | None = None

    def __init__(self, model: Any, batch_size: int | None = None,
                 ne_datapoint: int | None = None, loss_type: LossType | int | str = LossType.MEAN,
                 build_type: BuildType | int | str = BuildType.OPT, opt_period: int = 1,
                 optimizer: OptimizerType | int | str | Optimizer = OptimizerType.ADAMW,
                 get_opt_pars: Callable[[Any], OptimizerParams] = default_optimizer_params,
                 get_opt_pars_ud: Any = None, seed: int | np.random.Generator | None = None,
                 clip_grad_norm: float | None = None, comm: Any = None,
                 shard_optimizer: bool = False, *, class_labels: bool = False,
                 inputs_dtype: npt.DTypeLike | None = None,
                 bucket_cap_mb: float | None = 25.0, precision: str = "f32",
                 optimizer_in_backward: bool = False) -> None:
        def checks():
            # the precision asked for is the checkpoint's setting; the one that runs is
            # float32 where this machine has no bf16 products
            self._precision_asked = gemm.check_precision(precision)
            self._precision = _checked_precision(self._precision_asked)
            if not isinstance(optimizer_in_backward, (bool, np.bool_)):
                raise TypeError(f"optimizer_in_backward: expected a bool, got "
                                f"{type(optimizer_in_backward).__name__}")
            if optimizer_in_backward and (comm is not None or shard_optimizer):
                raise ValueError("optimizer_in_backward: not with comm (the ranks sum every "
                                 "gradient before any step); build the context without one of "
                                 "them")

        if comm is None and shard_optimizer is False:
            checks()
        self._wants_step_in_backward = bool(optimizer_in_backward)
        self._in_backward: StepInBackward | None = None
        # an eval stopped inside its backward pass (an exception, Ctrl-C): the
        # gradients hold part of a batch, so no eval runs until reset or a load
        self._interrupted = False
        args = (model, batch_size, ne_datapoint, loss_type, build_type, opt_period, optimizer,
                get_opt_pars, get_opt_pars_ud, seed, clip_grad_norm, class_labels, inputs_dtype)
        before_taking = _BEFORE_TAKING.get()
        self._dist: Any = None   # ggmlopt.distributed.Distributed with comm
        if comm is None and shard_optimizer is False:
            from ._buckets import check_bucket_cap_mb
            check_bucket_cap_mb(bucket_cap_mb)  # meaningful with comm only, checked always
            OptContext._init(self, *args, _before_taking=before_taking)
        else:  # many processes: ggmlopt.distributed wraps the construction
            from .distributed import Distributed
            self._dist = Distributed(comm, shard_optimizer, bucket_cap_mb)
            with self._dist.reporting("OptContext"):  # a bad argument on one rank stops all
                checks()
            self._dist.init_context(
                self, lambda check: OptContext._init(self, *args, _before_taking=check),
                before_taking, model, clip_grad_norm)

    def _init(self, model: Any, batch_size: Any, ne_datapoint: Any, loss_type: Any,
              build_type: Any, opt_period: Any, optimizer: Any, get_opt_pars: Any,
              get_opt_pars_ud: Any, seed: Any, clip_grad_norm: Any, class_labels: Any,
              inputs_dtype: Any = None, *,
              _before_taking: Callable[[OptContext], object] | None = None) -> None:
        for method in ("parameters", "forward", "backward"):
            if not callable(getattr(model, method, None)):
                raise TypeError(f"model: {type(model).__name__} has no {method}() method; a "
                                "model needs parameters(), forward(x) and backward(grad_out)")
        self._loss_type = enum_arg(loss_type, LossType, "loss_type")
        self._built = enum_arg(build_type, BuildType, "build_type")
        self._optimizer = optimizer_arg(optimizer)
        if self._built == BuildType.OPT and not _follows_get_opt_pars(self._optimizer):
            # settings fixed when it was made (Lion(alpha=...)): said now, by their name
            try:
                self._optimizer.hyperparameters(None)
            except (TypeError, ValueError) as e:
                raise type(e)(f"optimizer: {e}") from None
        self._opt_period = int_arg(opt_period, "opt_period", 1)
        if not callable(get_opt_pars):
            raise TypeError(f"get_opt_pars: expected a callable, got {type(get_opt_pars).__name__}")
        batch_size = int_arg(batch_size, "batch_size", 1, allow_none=True)
        ne_datapoint = int_arg(ne_datapoint, "ne_datapoint", 1, allow_none=True)
        if batch_size is not None and ne_datapoint is None:
            raise ValueError("ne_datapoint: required with batch_size (static mode)")
        clip_grad_norm = check_max_norm(clip_grad_norm)
        if not isinstance(class_labels, (bool, np.bool_)):
            raise TypeError(f"class_labels: expected a bool, got {type(class_labels).__name__}")
        class_labels = bool(class_labels)
        if class_labels and self._loss_type != LossType.CROSS_ENTROPY:
            raise ValueError(f"class_labels: class indices are labels for CROSS_ENTROPY; "
                             f"{self._loss_type.name} needs "
                             + ("float targets shaped like the model's outputs (one-hot "
                                "encode the classes)"
                                if self._loss_type == LossType.MEAN_SQUARED_ERROR
                                else "no labels"))
        if inputs_dtype is None:
            inputs_dtype = getattr(model, "inputs_dtype", np.float32)
        try:
            inputs_dtype = np.dtype(inputs_dtype)
        except TypeError:
            inputs_dtype = None
        if inputs_dtype not in (np.dtype(np.float32), np.dtype(np.int32)):
            raise TypeError("inputs_dtype: expected numpy.float32 (features) or numpy.int32 "
                            "(token ids)")
        if isinstance(seed, np.random.Generator):
            rng = seed
        else:
            rng = np.random.default_rng(
                DEFAULT_SEED if seed is None else int_arg(seed, "seed", 0))

        params = self._collect_parameters(model)
        trainable = [p for p in params if _trains(p)]
        if self._built != BuildType.FORWARD:   # (an evaluation trains nothing anyway)
            _warn_hidden_parameters(model, params)
        if self._built != BuildType.FORWARD:
            # first: over a base kept in its file's types, the way out is lora.apply
            # (or keep_types=False), even when nothing else trains either
            refuse_full_finetune_of_quantized(model)
        if not trainable and self._built != BuildType.FORWARD:
            frozen = ", ".join(checkpoint.parameter_names(model, params)[:4])
            raise ValueError(f"model: it has no trainable parameter (every parameter is frozen, "
                             f"requires_grad=False: {frozen}{', ...' if len(params) > 4 else ''})"
                             f"; set requires_grad=True on the ones to train, or build the "
                             f"context with build_type=FORWARD")
        if self._precision == "bf16":
            _warn_float32_convolutions(model)
            _warn_nothing_in_bf16(model)
        if self._wants_step_in_backward:
            self._check_step_in_backward(trainable, clip_grad_norm)
        # the frozen/trainable split, over model.parameters() (distributed and the
        # checkpoints compare it)
        self._model_params = params
        self._trainable_mask = tuple(_trains(p) for p in params)
        self._frozen = [p for p in params if not _trains(p)]
        self._per_datapoint = self._loss_type != LossType.SUM
        self._needs_labels = self._loss_type in (LossType.CROSS_ENTROPY,
                                                 LossType.MEAN_SQUARED_ERROR)

        self._batch_size = batch_size
        self._class_labels = class_labels
        self._ne_datapoint = ne_datapoint
        self._inputs_dtype = inputs_dtype
        self._ne_out: int | None = None
        self._out_shape: tuple[int, ...] | None = None
        self._inputs: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self._batch_buffers: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        if batch_size is not None:
            assert ne_datapoint is not None  # required with batch_size, checked above
            # one buffer for the inputs and labels, as ggml's static context
            self._inputs = AlignedBuffer(batch_size * ne_datapoint * 4).as_array(
                inputs_dtype, (batch_size, ne_datapoint))
            out_shape = self._outputs_shape(model, batch_size)
            self._out_shape = out_shape[1:]
            self._ne_out = out_shape[-1]
            if class_labels:  # one class per row of outputs: (batch,) or (batch, positions)
                rows = out_shape[:-1]
                self._labels = AlignedBuffer(math.prod(rows) * 4).as_array(np.int32, rows)
            elif self._needs_labels:
                self._labels = AlignedBuffer(math.prod(out_shape) * 4).as_array(
                    np.float32, out_shape)
            self._make_batch_buffers(out_shape)

        protocol = TrainingProtocol(model)   # reads the module tree, changes nothing
        self.model = model   # (a caller's check reads it: a language model's token ids)
        if _before_taking is not None:  # a caller's last check (fit: the dataset)
            _before_taking(self)
        # from here on nothing can fail: take the parameters
        self._training_protocol = protocol
        self.get_opt_pars = get_opt_pars
        self.get_opt_pars_ud = get_opt_pars_ud
        self.rng = rng
        # the model's random draws: rng itself with one process; over ranks each
        # rank's own stream, so ranks draw different Dropout masks (ggmlopt.rank_rng)
        self.model_rng = rng
        if self._dist is not None:
            from .rank_rng import rank_generator
            self.model_rng = rank_generator(rng, self._dist.rank)
        self._params = trainable
        self._index = {id(p): i for i, p in enumerate(trainable)}
        self._frozen_ids = {id(p) for p in self._frozen}
        self._requires_grad_changes = Parameter._requires_grad_changes
        self._build_arena(trainable)
        self._storage_changes = Parameter._storage_changes

        self.iter = 1
        self.opt_i = 0
        self._exchange = self._dist if self._dist is not None else _ONE_PROCESS
        # on this process: over comm's ranks, its share (ggmlopt.distributed agreed on it)
        self._evals_per_step = (self._opt_period if self._dist is None
                                else self._dist.evals_per_step)
        self._build_type = self._built   # of the last alloc; ggml starts at the built type
        self._eval_ready = False
        self.outputs: np.ndarray | None = None
        self._fused_pred: np.ndarray | None = None
        self.loss: np.float32 | None = None
        self.pred: np.ndarray | None = None
        self.ncorrect: int | None = None
        self._clip_grad_norm = clip_grad_norm
        self.grad_norm: float | None = None  # the step gradient's norm before the last clipping
        self._opt_pars_in_force = None   # the validated parameters of the last step
        # fit(accumulate="tokens") sets "tokens" and, before each logical batch's first
        # micro-batch, calls _begin_token_step; see _token_weight
        self._accumulate = "batches"
        self._step_labelled: int | None = None   # the logical batch's labelled positions
        self._step_seen = 0   # those of its micro-batches so far
        self._step_source = "get_batch"   # what gathers the micro-batches, for messages

    # ---- construction ---------------------------------------------------------------

    @staticmethod
    def _collect_parameters(model):
        got = model.parameters()
        try:
            got = list(got)
        except TypeError:
            raise TypeError("model.parameters(): expected a sequence of Parameters, got "
                            f"{type(got).__name__}") from None
        params, seen = [], set()
        for i, p in enumerate(got):
            data = getattr(p, "data", None)
            # (a Parameter makes its gradient when .grad is first read: not here)
            if not isinstance(data, np.ndarray) or not (isinstance(p, Parameter)
                                                        or hasattr(p, "grad")):
                raise TypeError(f"model.parameters()[{i}]: expected a ggmlopt.nn.Parameter (an "
                                f"object with a .data ndarray and .grad), got {type(p).__name__}")
            if data.dtype != np.float32:
                raise TypeError(f"model.parameters()[{i}]: expected float32 data, got {data.dtype}")
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if not params or sum(p.data.size for p in params) == 0:
            from .nn.module import hidden_parameters
            hidden = hidden_parameters(model)
            where = (f"; {', '.join(hidden[:5])} hold parameters that parameters() does not "
                     f"reach (an attribute named with a leading '_', or a dict): make them "
                     f"public attributes, or lists of layers" if hidden else "")
            raise ValueError("model: it has no parameters to train (parameters() gave "
                             f"{len(params)} with no elements){where}")
        return params

    def _check_step_in_backward(self, trainable, clip_grad_norm):
        """ValueError unless optimizer_in_backward can run here (see
        ggmlopt.step_in_backward for why each one is refused)."""
        if self._built != BuildType.OPT:
            raise ValueError(f"optimizer_in_backward: the context steps no optimizer "
                             f"(build_type={self._built.name}); build it for OPT")
        if self._opt_period != 1:
            raise ValueError(f"optimizer_in_backward: needs opt_period=1 (each step's "
                             f"gradient is one physical batch's), got {self._opt_period}; "
                             "accumulate with a larger physical batch instead")
        if clip_grad_norm is not None:
            raise ValueError("optimizer_in_backward: not with clip_grad_norm (the global "
                             "norm needs every gradient before any step)")
        odd = [type(p).__name__ for p in trainable if not isinstance(p, Parameter)]
        if odd:
            raise TypeError(f"optimizer_in_backward: every trainable parameter must be a "
                            f"ggmlopt.nn.Parameter (its gradient is lent while the backward "
                            f"pass needs it), got {odd[0]}")

    def _build_arena(self, params):
        """params (the trainable ones) into one arena; .data and .grad re-pointed
        at its views (with optimizer_in_backward the arena keeps no gradients:
        they are lent, ggmlopt.step_in_backward)."""
        size = sum(p.data.size for p in params)
        # the optimizer's state (AdamW's moments) beside them, for a context that steps
        state = self._optimizer.state_names if self._built == BuildType.OPT else ()
        min_section = 0
        if self._dist is not None:  # many processes: a sharded state lives in self._dist
            state, min_section = self._dist.arena_layout(size, state)
        lent = self._wants_step_in_backward
        # gradients only in a context that computes them (a FORWARD one, as ggml's
        # forward graph, has none); a forward-only context of a frozen model holds
        # nothing but one padding element
        kept = not lent and self._built != BuildType.FORWARD
        arena = ParamArena(max(size, 1), False, min_section, state, kept)
        start = 0
        for p in params:
            shape = p.data.shape
            w = arena.view("weights", start, shape)
            w[...] = p.data
            grad = arena.view("grads", start, shape) if kept else None
            if isinstance(p, Parameter):
                p._set_storage(w, grad)
            else:
                p.data = w
                p.grad = grad
            start += w.size
        self._grads = [p.grad for p in params] if kept else []
        self._weights = [p.data for p in params]
        self._flagged = [p for p in params if hasattr(p, "grad_is_zero")]
        self.arena = arena
        if lent:
            self._in_backward = StepInBackward(self.model, params, arena, self._optimizer)
        # what the optimizer steps: flat views of the whole arena
        self._step_arrays = (arena.flat("weights"), arena.flat("grads") if kept else None,
                             {name: arena.flat(name) for name in arena.state_names})
        self._zero_grads()

    def _zero_grads(self):
        """Zero every gradient (one kernel call) and tell the layers so."""
        if self._in_backward is not None:   # lent gradients: back to the pool
            self._in_backward.release()
        self.arena.zero_grads()
        for p in self._flagged:
            p.grad_is_zero = True

    def _make_batch_buffers(self, out_shape):
        """grad_out float32 shaped like the outputs, pred and the labels' argmax
        int32, one per row of outputs."""
        rows = math.prod(out_shape[:-1])
        self._batch_buffers = (
            out_shape[0],
            np.zeros(out_shape, dtype=np.float32),
            np.zeros(rows, dtype=np.int32),
            np.zeros(rows, dtype=np.int32),
        )

    def _outputs_shape(self, model, batch):
        """The shape of model's outputs for the static input batch: what the model
        says it is (a language model's outputs_shape, after the checks its forward
        makes of the inputs), else what a forward pass gives (a probe).  A language
        model's probe would make its whole logits (192 MiB at 1 x 1024 over 49152
        tokens), the training's peak, where training runs its head in chunks."""
        shape_of = getattr(model, "outputs_shape", None)
        if callable(shape_of):
            shape = tuple(int(n) for n in shape_of(self._inputs))
            if len(shape) not in (2, 3) or shape[0] != batch or 0 in shape:
                raise ValueError(f"model.outputs_shape: expected ({batch}, n) (or ({batch}, "
                                 f"positions, n)) for a batch of {batch}, got {shape}")
            return shape
        with eval_mode(model):  # a probe: no dropout, no draws from any rng
            return self._check_outputs(model.forward(self._inputs), batch).shape

    def _check_outputs(self, out, batch):
        if not isinstance(out, np.ndarray):
            raise TypeError(f"model.forward: expected it to return a numpy.ndarray, got "
                            f"{type(out).__name__}")
        if out.dtype != np.float32:
            raise TypeError(f"model.forward: expected float32 outputs, got {out.dtype}")
        if out.ndim not in (2, 3) or out.shape[0] != batch or 0 in out.shape:
            raise ValueError(f"model.forward: expected outputs of shape ({batch}, n) (or "
                             f"({batch}, positions, n)) for a batch of {batch}, got {out.shape}")
        if self._out_shape is not None and out.shape[1:] != self._out_shape:
            raise ValueError(f"model.forward: expected outputs of shape {self._out_shape} per "
                             f"datapoint (as when the context was built), got {out.shape[1:]}")
        return out if out.flags.c_contiguous else np.ascontiguousarray(out)

    # ---- read-only state --------------------------------------------------------------

    @property
    def inputs(self) -> np.ndarray | None:
        """Static mode: the input batch buffer (batch_size, ne_datapoint) float32."""
        return self._inputs

    @property
    def labels(self) -> np.ndarray | None:
        """Static mode: the label batch buffer (batch_size, ne_out) float32, or
        (batch_size,) int32 class indices with class_labels; None for MEAN and SUM
        (no labels) and in dynamic mode."""
        return self._labels

    @property
    def class_labels(self) -> bool:
        """Whether the static labels buffer holds class indices (int32)."""
        return self._class_labels

    @property
    def static_graphs(self) -> bool:
        """True in static mode (built with batch_size), False in dynamic mode."""
        return self._batch_size is not None

    @property
    def batch_size(self) -> int | None:
        """Datapoints per physical batch in static mode; None in dynamic mode."""
        return self._batch_size

    @property
    def ne_datapoint(self) -> int | None:
        """Elements per input datapoint (static mode; None unless given)."""
        return self._ne_datapoint

    @property
    def ne_out(self) -> int | None:
        """The model's outputs per datapoint, or per position for outputs
        (batch, positions, ne_out) (static mode: found by a forward pass at
        construction; None in dynamic mode)."""
        return self._ne_out

    @property
    def out_shape(self) -> tuple[int, ...] | None:
        """The shape of one datapoint's outputs, (ne_out,) or (positions, ne_out)
        (static mode; None in dynamic mode)."""
        return self._out_shape

    @property
    def inputs_dtype(self) -> np.dtype:
        """float32, or int32 for models that take token ids."""
        return self._inputs_dtype

    @property
    def opt_period(self) -> int:
        """Physical batches per optimizer step (gradient accumulation)."""
        return self._opt_period

    @property
    def loss_type(self) -> LossType:
        """The LossType the context computes."""
        return self._loss_type

    @property
    def build_type(self) -> BuildType:
        """The build type the context was made for (the furthest an eval may go)."""
        return self._built

    @property
    def build_type_last(self) -> BuildType:
        """The build type of the last alloc."""
        return self._build_type

    @property
    def clip_grad_norm(self) -> float | None:
        """None, or the global L2 norm gradients are clipped to before each step."""
        return self._clip_grad_norm

    @clip_grad_norm.setter
    def clip_grad_norm(self, value: float | None) -> None:
        value = check_max_norm(value)
        if value is not None and self._in_backward is not None:
            raise ValueError("clip_grad_norm: this context steps each parameter in the "
                             "backward pass (optimizer_in_backward=True); a global norm needs "
                             "every gradient before any step")
        self._clip_grad_norm = value

    @property
    def optimizer_type(self) -> OptimizerType | None:
        """The OptimizerType (ADAMW or SGD) of the optimizer steps; None for an
        optimizer defined outside ggml's two (see ``optimizer``)."""
        return self._optimizer.optimizer_type

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer of the steps (ggmlopt.optimizers: AdamW, SGD or a user's)."""
        return self._optimizer

    @property
    def loss_per_datapoint(self) -> bool:
        """Whether the loss is a mean over datapoints (every LossType but SUM)."""
        return self._per_datapoint

    @property
    def eval_ready(self) -> bool:
        """True between alloc() and eval()."""
        return self._eval_ready

    def parameters(self) -> list[Any]:
        """The parameters this context trains, in arena order (frozen ones,
        ``requires_grad=False``, are not among them)."""
        return list(self._params)

    @property
    def model_parameters(self) -> list[Any]:
        """Every parameter of the model (model.parameters() without repeats),
        trainable or frozen, in the model's order."""
        return list(self._model_params)

    def frozen_parameters(self) -> list[Any]:
        """The model's frozen parameters (``requires_grad=False``): outside the
        arena, never changed by this context."""
        return list(self._frozen)

    @property
    def trainable_mask(self) -> tuple[bool, ...]:
        """Per parameter of ``model_parameters``: whether it trains."""
        return self._trainable_mask

    @property
    def distributed(self) -> Any:
        """The ggmlopt.distributed.Distributed of a context over comm, else None."""
        return self._dist

    @property
    def evals_per_step(self) -> int:
        """Physical batches this process evaluates per optimizer step: opt_period,
        or its share of it over comm's ranks."""
        return self._evals_per_step

    @property
    def opt_pars_in_force(self) -> tuple[np.float32, ...] | None:
        """The optimizer's hyper-parameters of the last step (None before one)."""
        return self._opt_pars_in_force

    def _restore_counters(self, iteration, opt_i, build_type_last, opt_pars_in_force):
        """ggml's counters and the last step's hyper-parameters, from a checkpoint."""
        self.iter = iteration
        self.opt_i = opt_i
        self._build_type = build_type_last
        self._opt_pars_in_force = opt_pars_in_force

    def grad_acc(self, param: Any) -> np.ndarray:
        """The gradient accumulator of param (a float32 view of its shape in the
        arena): the gradient summed over the physical batches of the logical batch
        so far; after an optimizer step it still holds the sum the step used.
        With opt_period 1 it is the gradient of the last batch.  A context with
        optimizer_in_backward keeps none, nor does a FORWARD one (RuntimeError)."""
        if self._built == BuildType.FORWARD:
            raise RuntimeError("grad_acc: this context was built for FORWARD (ggml's forward "
                               "graph) and keeps no gradients; build it for GRAD or OPT")
        if self._in_backward is not None:
            raise RuntimeError("grad_acc: this context steps each parameter in the backward "
                               "pass (optimizer_in_backward=True) and keeps no gradient after "
                               "its step; build it without to read gradients")
        i = self._index.get(id(param))
        if i is None:
            if id(param) in self._frozen_ids:
                raise ValueError(f"param: {param!r} is frozen (requires_grad=False): it has "
                                 "no gradient and this context does not train it")
            raise ValueError("param: not a parameter of this context's model")
        return self._grads[i]

    @property
    def precision(self) -> str:
        """The precision of the layers' products in this context's evals: 'f32', or
        'bf16' (asked for, and native here)."""
        return self._precision

    @property
    def precision_asked(self) -> str:
        """The precision the context was made with, 'f32' or 'bf16': its
        checkpoints' setting (``precision`` says which runs on this machine)."""
        return self._precision_asked

    # ---- alloc / eval / reset -----------------------------------------------------------

    def alloc(self, backward: bool) -> None:
        """Prepare one eval: backward=False is a forward pass (FORWARD); backward=True
        computes gradients (GRAD), and on the last physical batch of a logical
        batch ((opt_i + 1) % opt_period == 0) also steps the optimizer (OPT)."""
        self._refuse_if_interrupted("alloc")
        if self._eval_ready:
            raise RuntimeError("alloc: already called; call eval() before the next alloc()")
        if backward:
            bt = BuildType.OPT if (self.opt_i + 1) % self._evals_per_step == 0 else BuildType.GRAD
        else:
            bt = BuildType.FORWARD
        if bt > self._built:
            raise RuntimeError(f"alloc(backward={bool(backward)}): this eval needs build type "
                               f"{bt.name} but the context was built for {self._built.name}")
        if Parameter._requires_grad_changes != self._requires_grad_changes or \
                Parameter._storage_changes != self._storage_changes:
            self._check_split()
        # the training protocol (ggmlopt.nn.module): whether this eval trains, and the
        # generator of the model's random numbers (part of this context's checkpoints)
        self._training_protocol.apply(bt != BuildType.FORWARD, self.model_rng)
        # Gradients are zeroed lazily, as a logical batch begins: ggml_opt_alloc resets
        # its accumulators after an OPT step when opt_period > 1, and with opt_period 1
        # its OPT graph computes gradients afresh.  A GRAD context accumulates until
        # reset().  The rule reads the whole opt_period, not this rank's share of it: a
        # rank evaluating one batch a step of opt_period > 1 leaves the gradients as one
        # process does (zero after the step once an eval follows), so its checkpoints
        # resume on any number of ranks (not the last step's sum, which a process with
        # several batches a step would add its first batch to).
        if self._built == BuildType.OPT and self.opt_i == 0 and (
                (self._build_type == BuildType.OPT and self._opt_period > 1)
                or (self._evals_per_step == 1 and backward)):
            self._zero_grads()
        self._build_type = bt
        self._eval_ready = True

    def _check_split(self):
        """Raise unless every parameter trains as when the context was built (a
        requires_grad changed since); when it does, the gradients are the
        arena's again (a flag set to False and back dropped them).  An array
        assigned to a parameter's data or grad since (as torch users do) is
        taken into the arena, whose views they become again; a grad set to None
        (torch's zero_grad(set_to_none=True)) is a zero gradient."""
        for p in self._params:
            if not _trains(p):
                raise RuntimeError(f"alloc: {p!r} was frozen (requires_grad=False) after this "
                                   "context was built; the arena was laid out for the "
                                   "parameters that trained then: set it back, or build a new "
                                   "context (save() and OptContext.load keep the training "
                                   "state of the others)")
        for p in self._frozen:
            if _trains(p):
                raise RuntimeError(f"alloc: {p!r} was unfrozen (requires_grad=True) after "
                                   "this context was built, which has no gradient or "
                                   "optimizer memory for it: set it back, or build a new "
                                   "context")
        for p, w in zip(self._params, self._weights):
            if p.data is not w:   # an array assigned: its values train, in the arena
                np.copyto(w, p.data)
                if isinstance(p, Parameter):
                    p._data = w
                else:
                    p.data = w
        for p, grad in zip(self._params, self._grads):   # none when lent
            current = p._grad if isinstance(p, Parameter) else p.grad
            if current is grad:
                continue
            if current is not None:   # an array assigned: the gradient so far
                np.copyto(grad, current)
            elif getattr(p, "_grad_cleared", False):   # None assigned: a zero gradient
                grad.fill(0.0)
            zero = current is None and getattr(p, "_grad_cleared", False)
            if isinstance(p, Parameter):
                p._grad, p._grad_cleared = grad, False
            else:
                p.grad = grad
            if hasattr(p, "grad_is_zero"):
                # (a flag set to False and back dropped the gradient: the arena's stand)
                p.grad_is_zero = zero
        self._requires_grad_changes = Parameter._requires_grad_changes
        self._storage_changes = Parameter._storage_changes

    def _undo_alloc(self, build_type_last):
        """Forget an alloc whose eval did not run (build_type_last: the value before
        it).  A gradient zeroing it did stays: the next alloc at this opt_i zeroes
        them the same way."""
        self._build_type = build_type_last
        self._eval_ready = False

    def reset(self, optimizer: bool) -> None:
        """Zero the gradients; optimizer=True also zeroes the AdamW momenta and sets
        iter back to 1.  After an eval stopped inside its backward pass, this is
        what lets the context run evals again."""
        self._zero_grads()
        self._interrupted = False
        if optimizer:
            self.arena.zero_momenta()
            if self._dist is not None:  # a sharded state
                self._dist.zero_state()
            self.iter = 1

    def _batch(self, inputs, labels):
        """The (inputs, labels) arrays of this eval."""
        if self._batch_size is not None:
            if labels is not None and self._labels is None:
                raise ValueError(f"labels: {self._loss_type.name} takes no labels")
            # check both before copying either: a bad labels must not change ctx.inputs
            copies = [(self._copy_source(a, buf, name), buf)
                      for a, buf, name in ((inputs, self._inputs, "inputs"),
                                           (labels, self._labels, "labels")) if a is not None]
            for src, buf in copies:
                np.copyto(buf, src, casting="same_kind")
            return self._inputs, self._labels
        if inputs is None:
            raise ValueError("inputs: required in dynamic mode (batch_size=None)")
        if self._inputs_dtype == np.int32:
            x = _token_matrix(inputs, "inputs", self._ne_datapoint)
        else:
            x = _f32_matrix(inputs, "inputs", self._ne_datapoint)
        if not self._needs_labels:
            if labels is not None:
                raise ValueError(f"labels: {self._loss_type.name} takes no labels")
            return x, None
        if labels is None:
            raise ValueError(f"labels: required for {self._loss_type.name}")
        if self._loss_type == LossType.CROSS_ENTROPY:
            y = _class_indices(labels, "labels")
            if y is not None and (y.ndim == 1 or self._inputs_dtype == np.int32):
                if y.shape[0] != x.shape[0]:
                    raise ValueError(f"labels: expected {x.shape[0]} class indices (one per "
                                     f"row of inputs), got {y.shape[0]}")
                return x, y
        elif np.ndim(labels) == 1 and np.asarray(labels).dtype.kind in "iu":
            raise ValueError(f"labels: integers of shape {np.shape(labels)} look like class "
                             f"indices, which only CROSS_ENTROPY takes; "
                             f"{self._loss_type.name} needs float targets of shape (batch, "
                             "outputs) (one-hot encode the classes)")
        y = _f32_matrix(labels, "labels")
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"labels: expected {x.shape[0]} rows like inputs, got {y.shape[0]}")
        return x, y

    @staticmethod
    def _copy_source(src, dst, name):
        """src checked and reshaped to be copied into the batch buffer dst."""
        src = np.asarray(src)
        if dst.dtype == np.int32:
            if src.dtype.kind not in "iu":
                what = "token ids" if name == "inputs" else "class indices"
                raise TypeError(f"{name}: this context takes {what} (integers, shape "
                                f"{dst.shape}), got dtype {src.dtype}")
        elif src.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers, got dtype {src.dtype}")
        if src.size != dst.size:
            raise ValueError(f"{name}: expected {dst.size} elements for the {dst.shape} batch "
                             f"buffer, got shape {src.shape}")
        return src.reshape(dst.shape)

    def _opt_step_params(self):
        """The validated optimizer parameters of this step (before anything changes)."""
        # per-step schedules read ctx.iter, so they receive the context itself
        ud = self if getattr(self.get_opt_pars, "unit", None) == "step" else self.get_opt_pars_ud
        returned = self.get_opt_pars(ud)
        opt = self._optimizer
        try:
            values = tuple(opt.hyperparameters(returned))
        except (TypeError, ValueError) as e:
            # (the kind, not the class: an optimizer's own exception class may take other
            # arguments)
            kind = TypeError if isinstance(e, TypeError) else ValueError
            where = (f"get_opt_pars: what it returned for step {self.iter} is refused"
                     if _follows_get_opt_pars(opt) else
                     f"optimizer: {type(opt).__name__}'s settings are refused")
            raise kind(f"{where}: {e}") from e
        names = tuple(opt.hyperparameter_names)
        if len(values) != len(names):   # (a step would unpack them; a checkpoint names them)
            raise ValueError(f"optimizer: {type(opt).__name__}.hyperparameters gave "
                             f"{len(values)} values for its {len(names)} hyperparameter_names "
                             f"{list(names)}")
        return values

    def eval(self, result: Result | None = None, inputs: npt.ArrayLike | None = None,
             labels: npt.ArrayLike | None = None) -> None:
        """Run the eval prepared by alloc: forward, loss, and per its build type the
        backward pass (gradients accumulate over the logical batch) and the
        optimizer step.  result: a Result that records the loss (and for
        cross-entropy the predictions and ncorrect).  inputs, labels: the batch in
        dynamic mode (2-D arrays, converted to float32); in static mode optional
        arrays copied into ctx.inputs / ctx.labels.

        Raises FloatingPointError, before any gradient or parameter changes, when
        the loss is NaN or infinite; a refused eval leaves ctx.rng as it was.
        The model computes in this thread only meanwhile (another thread's call
        is refused: ggmlopt.nn.module.in_use).
        """
        with in_use(self.model, "an OptContext's eval"):
            self._eval(result, inputs, labels)

    def _eval(self, result, inputs, labels):
        self._refuse_if_interrupted("eval")
        if not self._eval_ready:
            raise RuntimeError("eval: call alloc() first (one alloc before every eval)")
        if result is not None and not isinstance(result, Result):
            raise TypeError(f"result: expected a ggmlopt.Result or None, got "
                            f"{type(result).__name__}")
        bt = self._build_type
        x, y = self._batch(inputs, labels)
        batch = x.shape[0]
        if result is not None:
            result._check(batch, self._per_datapoint, self._opt_period)
        backward = bt != BuildType.FORWARD
        weight = self._token_weight(y) if backward else None   # may refuse: nothing changed yet
        step = self._opt_step_params() if bt == BuildType.OPT else None

        # a refusal found in the forward pass or the loss (labels that do not fit the
        # outputs, a loss that is not finite) leaves the generator as it was: the
        # dropout masks the forward pass drew are drawn again
        # (the model's generator: the context's own, or a rank's over a communicator)
        generators = [(g, g.bit_generator.state) for g in dict.fromkeys(
            (self.rng, self.model_rng))]
        try:
            if self._fuses_head(x, y):
                out, grad = None, None   # backward(None): the head's gradient is in place
                loss, pred, ncorrect, nlabelled = self._fused_head_loss(x, y, backward, weight)
            else:
                out, grad, loss, pred, ncorrect, nlabelled = self._outputs_and_loss(
                    x, y, batch, backward, weight)
        except BaseException as e:
            for g, state in generators:
                g.bit_generator.state = state
            if backward and not isinstance(e, Exception) and self._fuses_head(x, y):
                self._stopped_inside()   # (Ctrl-C: the head's gradient may be half written)
            raise
        if ncorrect is not None and nlabelled == 0 and bt != BuildType.FORWARD:
            warnings.warn(f"eval: physical batch {self.opt_i + 1}/{self._opt_period} of "
                          f"logical batch {self.iter} has no labelled position (every "
                          "label is -1): it adds nothing to the gradient",
                          UserWarning, stacklevel=2)

        if backward:
            try:
                self._backward_and_step(grad, step)
            except BaseException:
                self._stopped_inside()
                raise
        self.opt_i = (self.opt_i + 1) % self._evals_per_step
        self._eval_ready = False

        self.outputs = out
        self.loss = loss
        self.pred = pred if ncorrect is not None else None
        self.ncorrect = ncorrect
        if result is not None:
            # token-weighted, a micro-batch without labelled positions is 0 of its
            # step's token mean: it counts, unless the whole step has none
            result._add(batch, loss, self._per_datapoint, self._opt_period,
                        self.pred, ncorrect, nlabelled,
                        counted=weight is not None and bool(self._step_labelled))

    def _adopt_arena(self):
        """Every trainable parameter's data and grad the arena's views again,
        an array assigned before (a loaded state overwrote what it held) dropped."""
        for p, w in zip(self._params, self._weights):
            if p.data is not w:
                if isinstance(p, Parameter):
                    p._swap_data(w)
                else:
                    p.data = w
        for p, grad in zip(self._params, self._grads):
            if isinstance(p, Parameter):
                p._grad, p._grad_cleared = grad, False
            elif p.grad is not grad:
                p.grad = grad
        self._storage_changes = Parameter._storage_changes

    def _refuse_if_interrupted(self, what):
        if self._interrupted:
            raise RuntimeError(
                f"{what}: an earlier eval stopped inside its backward pass (an exception or "
                f"Ctrl-C), so the gradients hold part of its batch"
                f"{' and some parameters may have stepped' if self._in_backward else ''}: "
                f"call reset(False) to zero the gradients (the logical batch goes on without "
                f"what it accumulated), or load a checkpoint")

    def _stopped_inside(self):
        self._interrupted = True
        self._eval_ready = False

    def _backward_and_step(self, grad, step):
        """eval's backward pass and, on the last physical batch of a logical
        batch (step: its optimizer parameters), the optimizer step."""
        with gemm.products_in(self._precision):
            if step is not None and self._in_backward is not None:
                # each parameter stepped as its gradient becomes final
                self._in_backward.backward(grad, step, self.iter)
            elif step is not None:   # the eval that steps: its exchange may start here
                self._exchange.backward(self, grad)
            else:
                self.model.backward(grad)
        if step is not None and self._in_backward is not None:
            self._opt_pars_in_force = step
            self.iter += 1
        elif step is not None:
            # the gradients summed over the processes; with a sharded optimizer the
            # exchange also clips and steps (stepped is True)
            stepped = self._exchange.step(self, step)
            if self._clip_grad_norm is not None and not stepped:
                self.grad_norm = self.arena.clip_grad_norm(self._clip_grad_norm)
            self._opt_pars_in_force = step
            if not stepped:
                weights, grads, state = self._step_arrays
                self._optimizer.step(weights, grads, state, step, self.iter)
            self.iter += 1

    # ---- checkpoints (ggmlopt.checkpoint) -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The training state as a dict of plain numbers, strings and NumPy arrays
        (copies): parameters, gradients, AdamW m and v, iter, opt_i, the settings
        in force and the state of rng (shuffles, dropout masks).  See ggmlopt.checkpoint.
        With comm it gathers every rank's model_rng (ggmlopt.rank_rng): every rank
        calls it."""
        return checkpoint.context_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a state_dict() into this context's own buffers after checking every
        name, shape, dtype and setting; on any mismatch raise and change nothing."""
        if self._dist is not None:  # many processes: every rank loads, rank 0's values win
            self._dist.load_state_dict(
                self, state_dict, lambda: checkpoint.load_context_state_dict(self, state_dict))
        else:
            checkpoint.load_context_state_dict(self, state_dict)
        self._interrupted = False   # every gradient and parameter is the state's
        self._adopt_arena()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write state_dict() to path as one .npz file, atomically (a crash leaves
        the previous file intact).  With comm, every rank calls it; rank 0 writes."""
        if self._dist is not None:  # many processes
            self._dist.save(path, self.state_dict(), checkpoint.save_state)
        else:
            checkpoint.save_state(path, self.state_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any,
             get_opt_pars: Callable[[Any], OptimizerParams] = default_optimizer_params,
             get_opt_pars_ud: Any = None, clip_grad_norm: float | None = None,
             comm: Any = None, shard_optimizer: bool = False,
             bucket_cap_mb: float | None = 25.0, optimizer: Any = None,
             optimizer_in_backward: bool = False) -> OptContext:
        """A context for model, built with the settings saved in the checkpoint at
        path and holding its state.  model's parameters must have the saved shapes
        (checked before the model is touched).  comm, shard_optimizer,
        bucket_cap_mb: as for the constructor (every rank reads path; a checkpoint
        of any number of ranks; the bucket size is not part of a checkpoint).
        optimizer: None (the checkpoint's AdamW or SGD), or the Optimizer it was
        saved with, which one defined outside ggmlopt needs (ggmlopt.optimizers).
        optimizer_in_backward: as for the constructor (not part of a checkpoint:
        either way resumes the same trajectory)."""
        from ._buckets import check_bucket_cap_mb
        check_bucket_cap_mb(bucket_cap_mb)  # before the file is read, as the constructor
        if comm is None and shard_optimizer is False:
            return checkpoint.load_context(cls, path, model, get_opt_pars, get_opt_pars_ud,
                                           clip_grad_norm, optimizer,
                                           optimizer_in_backward=optimizer_in_backward)
        from .distributed import Distributed  # many processes: a failing rank stops all
        with Distributed(comm, shard_optimizer, bucket_cap_mb).reporting("OptContext.load"):
            return checkpoint.load_context(cls, path, model, get_opt_pars, get_opt_pars_ud,
                                           clip_grad_norm, optimizer, comm=comm,
                                           shard_optimizer=shard_optimizer,
                                           bucket_cap_mb=bucket_cap_mb,
                                           optimizer_in_backward=optimizer_in_backward)

    def _refuse_nonfinite(self, loss, x, y, out) -> None:
        """FloatingPointError for a NaN or infinite loss (before any gradient or
        parameter changes), naming where the non-finite value is."""
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"eval: the loss is {float(loss)} (iteration {self.iter}, physical batch "
                f"{self.opt_i + 1}/{self._opt_period} of the logical batch)"
                f"{_nonfinite_cause(x, y, out)}; not training on")

    def _fuses_head(self, x, y) -> bool:
        """Whether this eval runs the model's fused head and loss: a language
        model (fused_cross_entropy, fused_head on) trained or evaluated with
        cross-entropy on next-token labels shaped like its tokens."""
        return (self._loss_type == LossType.CROSS_ENTROPY and y is not None
                and y.dtype == np.int32 and x.dtype == np.int32 and y.shape == x.shape
                and bool(getattr(self.model, "fused_head", False))
                and callable(getattr(self.model, "fused_cross_entropy", None)))

    def _begin_token_step(self, labelled: int, source: str) -> None:
        """accumulate="tokens": the logical batch whose first micro-batch comes
        next holds labelled positions (counted in the dataset's labels), its
        micro-batches gathered by source (named in the error when they differ)."""
        self._step_labelled, self._step_seen, self._step_source = labelled, 0, source

    def _token_weight(self, labels) -> np.float32 | None:
        """fit(accumulate="tokens"), on a training micro-batch of a logical batch of
        several: the micro-batch's labelled positions over the logical batch's, which
        scales its mean loss and gradient instead of ggml's 1/opt_period, so the
        step's gradient is the mean over every labelled position of the step
        (Hugging Face Trainer's num_items_in_batch).  None: ggml's rule.

        ValueError, before anything changes, when the micro-batches hold other
        labelled positions than the step's count (a get_batch that masks or
        changes labels, as a Dataset subclass may): the step's weights would not
        sum to 1, a gradient and loss off the token mean."""
        step = self._step_labelled
        if self._accumulate != "tokens" or self._opt_period == 1 or labels is None \
                or labels.dtype != np.int32:
            return None
        if step is None:
            raise RuntimeError("eval: accumulate='tokens' needs the logical batch's labelled "
                               "positions before its first micro-batch (fit sets them)")
        n = int(np.count_nonzero(labels >= 0))
        seen = self._step_seen + n
        if seen > step or (self.opt_i == self._opt_period - 1 and seen != step):
            raise ValueError(
                f"dataset: accumulate='tokens' counted {step} labelled positions in the "
                f"dataset's labels for logical batch {self.iter}, but its micro-batches from "
                f"{self._step_source} hold {seen} by physical batch {self.opt_i + 1}/"
                f"{self._opt_period}; get_batch must gather dataset.labels unchanged (mask "
                "labels in the dataset), or pass accumulate='batches'")
        self._step_seen = seen
        return F32(n / step) if step else F32(0)

    def _fused_head_loss(self, x, y, backward, weight=None):
        """(loss, pred, ncorrect, nlabelled) of the model's fused head and loss:
        no logits are kept (ctx.outputs is None), the masked positions'
        predictions are -1; the head's gradient is in place when backward.
        weight: the token weight of this micro-batch (_token_weight) or None."""
        rows = x.size
        if self._fused_pred is None or self._fused_pred.shape[0] != rows:
            self._fused_pred = np.empty(rows, dtype=np.int32)
        pred = self._fused_pred
        period = self._opt_period
        inv_period = F32(1) / F32(period)
        scale = inv_period if weight is None else weight
        with gemm.products_in(self._precision):
            loss = F32(self.model.fused_cross_entropy(x, y, grad_scale=scale,
                                                      backward=backward, pred=pred))
        if weight is not None:
            loss = F32(loss * weight)
        elif period > 1:
            loss = F32(loss * inv_period)
        self._refuse_nonfinite(loss, x, y, None)
        labels = y.reshape(-1)
        labelled = labels >= 0   # a masked position's prediction is -1, as its label
        ncorrect = int(np.count_nonzero((pred == labels) & labelled))
        return loss, pred, ncorrect, int(np.count_nonzero(labelled))

    def _outputs_and_loss(self, x, y, batch, backward, weight=None):
        """(outputs, d loss / d outputs or None, loss, pred, ncorrect, nlabelled)
        of model.forward and the loss on its outputs (weight: _token_weight's)."""
        with gemm.products_in(self._precision):
            out = self._check_outputs(self.model.forward(x), batch)
        by_class = y is not None and y.dtype == np.int32
        if y is not None and not by_class and y.shape != out.shape:
            raise ValueError(f"labels: expected shape {out.shape} like the model's outputs, "
                             f"got {y.shape}")
        if by_class and y.size * out.shape[-1] != out.size:
            raise ValueError(f"labels: expected class indices of shape {out.shape[:-1]} (one per "
                             f"row of the model's outputs {out.shape}), got {y.shape}")
        bufs = self._batch_buffers
        if bufs is None or bufs[0] != batch or bufs[1].shape != out.shape:
            self._make_batch_buffers(out.shape)
            bufs = self._batch_buffers
        assert bufs is not None
        _, grad, pred, label_arg = bufs
        loss = self._loss(out, y, grad if backward else None, pred, weight)
        self._refuse_nonfinite(loss, x, y, out)
        ncorrect = nlabelled = None
        if self._loss_type == LossType.CROSS_ENTROPY:
            rows = out.reshape(-1, out.shape[-1])
            if not by_class:   # (class indices: the loss's pass wrote the predictions)
                kernels.argmax_rows(rows, out=pred)
            if by_class:  # a masked position (-1) never equals a prediction
                labelled = y.reshape(-1)
                ncorrect = kernels.count_equal(pred, labelled)
                nlabelled = labelled.size - int(np.count_nonzero(labelled < 0))
            else:
                kernels.argmax_rows(y.reshape(rows.shape), out=label_arg)
                ncorrect = kernels.count_equal(pred, label_arg)
                nlabelled = pred.size
        return out, grad if backward else None, loss, pred, ncorrect, nlabelled

    def _loss(self, out, labels, grad, pred=None, weight=None):
        """The float32 loss as ggml computes it; grad (if given) receives d loss / d out;
        pred (if given) each row's argmax, with cross-entropy on class indices;
        weight: cross-entropy's scale instead of 1/opt_period (_token_weight)."""
        lt = self._loss_type
        period = self._opt_period
        if lt == LossType.SUM:
            if grad is not None:
                kernels.fill(grad, 1.0)
            return F32(kernels.sum(out))
        if lt == LossType.CROSS_ENTROPY:
            # one row per datapoint, or per position (batch, positions, n)
            inv_period = F32(1) / F32(period)
            n = out.shape[-1]
            by_class = labels.dtype == np.int32
            loss = F32(kernels.cross_entropy(
                out.reshape(-1, n), labels.reshape(-1) if by_class else labels.reshape(-1, n),
                None if grad is None else grad.reshape(-1, n),
                grad_scale=inv_period if weight is None else weight,
                ignore_index=-1 if by_class else None, pred=pred if by_class else None))
            if weight is not None:
                return F32(loss * weight)
            return F32(loss * inv_period) if period > 1 else loss
        scale = F32(1) / F32(period * out.size)
        if lt == LossType.MEAN:
            if grad is not None:
                kernels.fill(grad, scale)
            return F32(F32(kernels.sum(out)) * scale)
        # MEAN_SQUARED_ERROR: sum((out - labels)^2) * scale
        return F32(F32(kernels.squared_error(out, labels, grad, grad_scale=scale)) * scale)

    def __repr__(self) -> str:
        mode = (f"batch_size={self._batch_size}, ne_datapoint={self._ne_datapoint}"
                if self._batch_size is not None else "dynamic")
        return (f"OptContext({mode}, loss_type={self._loss_type.name}, build_type="
                f"{self._built.name}, opt_period={self._opt_period}, optimizer="
                f"{_optimizer_repr(self._optimizer)}, iter={self.iter}, parameters="
                f"{sum(p.data.size for p in self._params)}"
                + (f", frozen={sum(p.data.size for p in self._frozen)}" if self._frozen else "")
                + ")")


def _optimizer_repr(optimizer: Optimizer) -> str:
    """ADAMW / SGD as ggml names them; a user's optimizer as its repr."""
    kind = optimizer.optimizer_type
    return kind.name if kind is not None else repr(optimizer)
