"""Learning-rate schedules usable as ``get_opt_pars`` (beyond ggml).

A schedule is a callable object holding base optimizer parameters (``base``,
default ggml's defaults).  Called with the userdata ggml hands ``get_opt_pars``,
it returns a copy of ``base`` whose learning rates, ``adamw.alpha`` and
``sgd.alpha`` both, are multiplied by a factor f(t) > 0; every other field is
base's.  t is 1-based:

- ``unit="epoch"`` (default): t is the userdata, the 1-based epoch that ``fit``
  hands get_opt_pars (as ggml_opt_fit does).  Use with fit, or with an OptContext
  whose get_opt_pars_ud you set to the epoch.
- ``unit="step"``: t is ``ctx.iter``, the 1-based index of the optimizer step
  being taken.  OptContext and fit hand such a schedule the context itself as
  userdata (any get_opt_pars whose ``unit`` attribute is "step" gets it); an int
  is taken as t directly.

The factors (T = total, W = warmup, p = the fraction of the schedule done when
step or epoch t begins):

- Constant:      f(t) = 1
- Step:          f(t) = gamma ** floor((t - 1) / step_size)
- Linear:        f(t) = start + (end - start) * p,     p = min(t - 1, T) / T
- Cosine:        f(t) = m + (1 - m) * (1 + cos(pi * p)) / 2,  p = min(t - 1, T) / T
- WarmupCosine:  f(t) = t / W for t <= W, then the cosine above over the
                 remaining T - W with p = min(t - 1 - W, T - W) / (T - W)
- WarmupLinear:  f(t) = t / W for t <= W, then 1 + (end - 1) * p with the same p
                 (end = 1: a constant rate after the warmup)

Linear and Cosine are torch's LinearLR and CosineAnnealingLR with t - 1 as
torch's 0-based counter: f(1) is the start, and t = T is the last step before
the end value, so the factor stays > 0 for every t <= T even when the end value
is 0.  Past T the end value holds; when it is 0 the schedule raises ValueError
(ggml needs a learning rate > 0) naming t and T.

Example::

    sched = go.schedules.WarmupCosine(warmup=100, total=5000, unit="step",
                                      base=go.OptimizerParams(go.AdamWParams(alpha=3e-4)))
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, get_opt_pars=sched, nepoch=10, ...)
"""
from __future__ import annotations

import copy
import math
import numbers
from typing import Any

from ._args import int_arg
from .optim_params import FitEpoch, OptimizerParams

__all__ = ["Constant", "Cosine", "Linear", "Schedule", "Step", "WarmupCosine", "WarmupLinear",
           "constant", "cosine", "linear", "step", "warmup_cosine", "warmup_linear"]

_UNITS = ("epoch", "step")


def _real(value: object, name: str, minimum: float, allow_equal: bool = True,
          maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    ok = math.isfinite(value) and (value >= minimum if allow_equal else value > minimum)
    if maximum is not None:
        ok = ok and value <= maximum
    if not ok:
        rng = f"{'>=' if allow_equal else '>'} {minimum}"
        if maximum is not None:
            rng += f" and <= {maximum}"
        raise ValueError(f"{name}: expected a finite float {rng}, got {value!r}")
    return value


class Schedule:
    """Base of the schedules: ``sched(userdata) -> OptimizerParams``.

    base: OptimizerParams whose alphas are scaled (default OptimizerParams(), ggml's
    defaults); it is copied, so later changes to the caller's object do not leak in.
    unit: "epoch" (t = userdata, the 1-based epoch) or "step" (t = ctx.iter).
    Subclasses define ``factor(t)`` for t >= 1.
    """

    def __init__(self, base: OptimizerParams | None = None, unit: str = "epoch") -> None:
        if base is None:
            base = OptimizerParams()
        if not isinstance(base, OptimizerParams):
            raise TypeError(f"base: expected an OptimizerParams or None, got "
                            f"{type(base).__name__}")
        if unit not in _UNITS:
            raise ValueError(f"unit: expected 'epoch' or 'step', got {unit!r}")
        self.base = copy.deepcopy(base)
        self.unit = unit

    def factor(self, t: int) -> float:
        """The learning-rate factor f(t) of the 1-based step or epoch t."""
        raise NotImplementedError

    def _t(self, userdata: Any) -> int:
        if self.unit == "step" and isinstance(userdata, FitEpoch):
            raise ValueError(f"userdata: a per-step schedule was handed fit's epoch "
                             f"({int(userdata)}), which it would read as the step: it is "
                             "called from a function that fit calls with the epoch; pass "
                             "the schedule itself as get_opt_pars (fit hands it the context, "
                             "whose iter is the step) or make it unit='epoch'")
        if self.unit == "step" and not isinstance(userdata, numbers.Integral):
            it = getattr(userdata, "iter", None)
            if it is None:
                raise TypeError(f"userdata: a per-step schedule expected an OptContext (it "
                                f"reads ctx.iter) or an int step, got {type(userdata).__name__}")
            userdata = it
        what = "epoch" if self.unit == "epoch" else "step"
        if isinstance(userdata, bool) or not isinstance(userdata, numbers.Integral):
            raise TypeError(f"userdata: a per-{what} schedule expected the 1-based {what} as "
                            f"an int, got {type(userdata).__name__}"
                            + (" (fit hands it the epoch; for OptContext set get_opt_pars_ud)"
                               if userdata is None else ""))
        if userdata < 1:
            raise ValueError(f"userdata: expected the 1-based {what} >= 1, got {userdata}")
        return int(userdata)

    def lr(self, t: Any, optimizer: str = "adamw") -> float:
        """The learning rate at t for 'adamw' or 'sgd': base alpha * factor(t)."""
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer: expected 'adamw' or 'sgd', got {optimizer!r}")
        return getattr(self.base, optimizer).alpha * self.factor(self._t(t))

    def __call__(self, userdata: Any) -> OptimizerParams:
        t = self._t(userdata)
        f = self.factor(t)
        out = copy.deepcopy(self.base)
        out.adamw.alpha = self.base.adamw.alpha * f
        out.sgd.alpha = self.base.sgd.alpha * f
        return out

    def _end_reached(self, t: int, total: int, end: float, end_name: str) -> None:
        if end == 0.0 and t > total:
            raise ValueError(f"t: {self.unit} {t} is past total={total}, where this schedule's "
                             f"learning rate is 0 ({end_name}=0); raise total or set "
                             f"{end_name} > 0")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "base")
        return f"{type(self).__name__}({fields})"


class Constant(Schedule):
    """f(t) = 1: the base parameters at every step (like constant_optimizer_params)."""

    def factor(self, t: int) -> float:
        return 1.0


class Step(Schedule):
    """Step(step_size, gamma=0.1, base=None, unit="epoch"):
    f(t) = gamma ** floor((t - 1) / step_size), torch's StepLR: the rate is
    multiplied by gamma every step_size steps or epochs.

    step_size: int >= 1.  gamma: float > 0.
    """

    def __init__(self, step_size: int, gamma: float = 0.1, base: OptimizerParams | None = None,
                 unit: str = "epoch") -> None:
        super().__init__(base, unit)
        self.step_size = int_arg(step_size, "step_size", 1)
        self.gamma = _real(gamma, "gamma", 0.0, allow_equal=False)

    def factor(self, t: int) -> float:
        return self.gamma ** ((t - 1) // self.step_size)


class Linear(Schedule):
    """Linear(total, start_factor=1.0, end_factor=0.0, base=None, unit="epoch"):
    f(t) = start + (end - start) * min(t - 1, total) / total,
    torch's LinearLR: start_factor at t = 1, going linearly to end_factor at
    t = total + 1, and end_factor after.

    total: int >= 1.  start_factor: float > 0.  end_factor: float >= 0.
    """

    def __init__(self, total: int, start_factor: float = 1.0, end_factor: float = 0.0,
                 base: OptimizerParams | None = None, unit: str = "epoch") -> None:
        super().__init__(base, unit)
        self.total = int_arg(total, "total", 1)
        self.start_factor = _real(start_factor, "start_factor", 0.0, allow_equal=False)
        self.end_factor = _real(end_factor, "end_factor", 0.0)

    def factor(self, t: int) -> float:
        self._end_reached(t, self.total, self.end_factor, "end_factor")
        p = min(t - 1, self.total) / self.total
        return self.start_factor + (self.end_factor - self.start_factor) * p


def _cosine(p: float, min_factor: float) -> float:
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * p))


class Cosine(Schedule):
    """Cosine(total, min_factor=0.0, base=None, unit="epoch"):
    f(t) = m + (1 - m) * (1 + cos(pi * min(t - 1, total) / total)) / 2, m = min_factor,
    torch's CosineAnnealingLR (eta_min = m * base alpha): 1 at t = 1, down to m
    at t = total + 1, m after.

    total: int >= 1.  min_factor: 0 <= m <= 1.
    """

    def __init__(self, total: int, min_factor: float = 0.0, base: OptimizerParams | None = None,
                 unit: str = "epoch") -> None:
        super().__init__(base, unit)
        self.total = int_arg(total, "total", 1)
        self.min_factor = _real(min_factor, "min_factor", 0.0, maximum=1.0)

    def factor(self, t: int) -> float:
        self._end_reached(t, self.total, self.min_factor, "min_factor")
        return _cosine(min(t - 1, self.total) / self.total, self.min_factor)


class _Warmup(Schedule):
    """A linear warmup over the first `warmup` steps or epochs, f(t) = t / warmup
    (so f(1) = 1/warmup and f(warmup) = 1: no step has a zero rate), then a decay
    from 1 at t = warmup + 1 to the end value at t = total + 1, the end value after:
    a subclass gives the decay's shape (_decay of the fraction p done) and the name
    of its end value's attribute (_end_name)."""

    _end_name: str

    def __init__(self, warmup: int, total: int, base: OptimizerParams | None,
                 unit: str) -> None:
        super().__init__(base, unit)
        self.total = int_arg(total, "total", 1)
        self.warmup = int_arg(warmup, "warmup", 0)
        if self.warmup > self.total:
            raise ValueError(f"warmup: expected at most total={self.total}, got {self.warmup}")

    def _decay(self, p: float) -> float:
        raise NotImplementedError

    def factor(self, t: int) -> float:
        if t <= self.warmup:
            return t / self.warmup
        end = getattr(self, self._end_name)
        self._end_reached(t, self.total, end, self._end_name)
        decay = self.total - self.warmup
        if decay == 0:
            return end
        return self._decay(min(t - 1 - self.warmup, decay) / decay)


class WarmupCosine(_Warmup):
    """WarmupCosine(warmup, total, min_factor=0.0, base=None, unit="epoch"):
    a linear warmup over the first `warmup` steps or epochs, then a cosine decay:

        f(t) = t / warmup                                         for t <= warmup
        f(t) = m + (1 - m) * (1 + cos(pi * p)) / 2,  p = min(t - 1 - warmup, total - warmup)
                                                         / (total - warmup)   after

    so f(1) = 1/warmup, f(warmup) = 1 = f(warmup + 1), and the decay reaches m at
    t = total + 1 (the schedule of Hugging Face's get_cosine_schedule_with_warmup,
    shifted so that no step has a zero rate).  warmup = 0 is Cosine(total).

    warmup: 0 <= warmup <= total.  total: int >= 1.  min_factor: 0 <= m <= 1.
    """

    _end_name = "min_factor"

    def __init__(self, warmup: int, total: int, min_factor: float = 0.0,
                 base: OptimizerParams | None = None, unit: str = "epoch") -> None:
        super().__init__(warmup, total, base, unit)
        self.min_factor = _real(min_factor, "min_factor", 0.0, maximum=1.0)

    def _decay(self, p: float) -> float:
        return _cosine(p, self.min_factor)


class WarmupLinear(_Warmup):
    """WarmupLinear(warmup, total, end_factor=0.0, base=None, unit="epoch"):
    a linear warmup over the first `warmup` steps or epochs, then a linear decay:

        f(t) = t / warmup                                 for t <= warmup
        f(t) = 1 + (end - 1) * p,  p = min(t - 1 - warmup, total - warmup)
                                       / (total - warmup)          after

    so f(1) = 1/warmup, f(warmup) = 1 = f(warmup + 1), and the decay reaches
    end_factor at t = total + 1: Hugging Face's get_linear_schedule_with_warmup
    (Trainer's default "linear"), whose decay it equals step for step, with the
    warmup shifted by one step so that no step has a zero rate, as WarmupCosine's.
    end_factor=1.0 is Trainer's "constant_with_warmup" so shifted.  warmup = 0 is
    Linear(total, end_factor=end_factor).

    warmup: 0 <= warmup <= total.  total: int >= 1.  end_factor: float >= 0.
    """

    _end_name = "end_factor"

    def __init__(self, warmup: int, total: int, end_factor: float = 0.0,
                 base: OptimizerParams | None = None, unit: str = "epoch") -> None:
        super().__init__(warmup, total, base, unit)
        self.end_factor = _real(end_factor, "end_factor", 0.0)

    def _decay(self, p: float) -> float:
        return 1.0 + (self.end_factor - 1.0) * p


# lower-case names, as the spec lists the schedules
constant = Constant
step = Step
linear = Linear
cosine = Cosine
warmup_cosine = WarmupCosine
warmup_linear = WarmupLinear
