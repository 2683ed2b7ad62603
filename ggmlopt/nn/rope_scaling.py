"""RoPE frequency scaling: the ``rope_scaling`` / ``rope_parameters`` of Hugging Face
configs (``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``) and llama.cpp's per-frequency factors
(a GGUF's ``rope_freqs.weight``), computed as transformers' modeling_rope_utils
does in float32, so the rotary tables equal Hugging Face's.

A rope type ggmlopt does not compute or a key it does not know is refused, never
dropped: a dropped scaling changes every logit.  LongRoPE has two sets of
frequencies, its short factors' for a pass whose positions stay within
``original_max_position_embeddings`` and its long factors' beyond, chosen per pass
as transformers chooses them (``rope_inv_freq(..., long=True)``).  Dynamic NTK
scaling leaves the frequencies alone for a pass within the config's
``max_position_embeddings`` and raises the base for a longer one by its length
(``rope_inv_freq(..., n_positions=L)``), as transformers' _compute_dynamic_ntk_parameters.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

__all__ = ["RopeScaling", "default_inv_freq", "rope_inv_freq", "rope_tables"]

# the keys each type reads (transformers' _validate_*_rope_parameters), beside
# rope_type and rope_theta
_KEYS = {
    "linear": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}, set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate"}),
    # llama.cpp's rope_freqs tensor: theta_i = base^(-2i/d) / freq_factors[i]
    "freq_factors": ({"freq_factors"}, set()),
    # Phi-3's LongRoPE: theta_i = base^(-2i/d) / short_factor[i] (or long_factor[i]
    # past the pretraining length), cos and sin times an attention factor
    "longrope": ({"short_factor", "long_factor", "original_max_position_embeddings"},
                 {"attention_factor", "factor"}),
    # dynamic NTK: the base raised past original_max_position_embeddings (the config's
    # max_position_embeddings, which transformers reads) by the pass's length
    "dynamic": ({"factor", "original_max_position_embeddings"}, set()),
}
_NOT_COMPUTED = ("proportional", "mrope", "default-axial")


def _real(value, name, minimum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"rope_scaling: {name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"rope_scaling: {name} must be >= {minimum}, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RopeScaling(rope_type, factor=1.0, low_freq_factor=None,
    high_freq_factor=None, original_max_position_embeddings=None,
    attention_factor=None, beta_fast=None, beta_slow=None, mscale=None,
    mscale_all_dim=None, truncate=True, freq_factors=None, short_factor=None,
    long_factor=None)

    How the rotary frequencies of a Llama-like model are scaled, Hugging Face's
    names: ``linear`` (inv_freq / factor), ``dynamic`` (NTK-aware: for a pass
    longer than original_max_position_embeddings the base raised by that pass's
    length, as transformers' dynamic rotary does), ``llama3`` (Llama 3.1's smooth
    interpolation between low and high frequencies), ``yarn`` (YaRN, with its
    attention factor on cos and sin), ``longrope`` (Phi-3's LongRoPE: inv_freq
    / short_factor[i] within original_max_position_embeddings, / long_factor[i]
    past it, cos and sin times attention_factor, by default sqrt(1 + ln(factor)
    / ln(original)), 1 for a factor of 1; from_hf's factor is the context over
    the original one, as transformers', unless the config gives it), or
    ``freq_factors`` (llama.cpp's ``rope_freqs``: inv_freq / freq_factors[i]).
    Checked when made (ValueError naming the field).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in _KEYS:
            raise ValueError(f"rope_scaling: rope_type {self.rope_type!r} is not computed by "
                             f"ggmlopt (it computes {', '.join(t for t in _KEYS)})")
        required, optional = _KEYS[self.rope_type]
        given = {f.name for f in dataclasses.fields(self)
                 if f.name not in ("rope_type", "truncate")
                 and getattr(self, f.name) is not None and (f.name != "factor" or
                                                            self.rope_type != "freq_factors")}
        missing = sorted(required - given)
        if missing:
            raise ValueError(f"rope_scaling: a {self.rope_type!r} scaling needs {missing}")
        extra = sorted(given - required - optional - {"factor"})
        if extra:
            raise ValueError(f"rope_scaling: {extra} do not apply to a {self.rope_type!r} "
                             "scaling")
        if self.rope_type != "freq_factors":
            object.__setattr__(self, "factor", _real(self.factor, "factor", 1.0))
        for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                     "beta_slow", "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _real(value, name, 0.0))
        n = self.original_max_position_embeddings
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
                raise ValueError(f"rope_scaling: original_max_position_embeddings must be an "
                                 f"int >= 1, got {n!r}")
            object.__setattr__(self, "original_max_position_embeddings", int(n))
        if self.rope_type == "llama3":
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(f"rope_scaling: high_freq_factor ({self.high_freq_factor}) "
                                 f"must exceed low_freq_factor ({self.low_freq_factor})")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"rope_scaling: truncate must be a bool, got {self.truncate!r}")
        for name in ("freq_factors", "short_factor", "long_factor"):
            if getattr(self, name) is None:
                continue
            if isinstance(getattr(self, name), (str, bytes)):
                raise TypeError(f"rope_scaling: {name} must be a sequence of numbers > 0")
            factors = tuple(_real(f, name, 0.0) for f in getattr(self, name))
            if not factors or min(factors) <= 0:
                raise ValueError(f"rope_scaling: {name} must be numbers > 0")
            object.__setattr__(self, name, factors)
        if self.rope_type == "longrope" and len(self.short_factor or ()) != \
                len(self.long_factor or ()):
            raise ValueError(f"rope_scaling: {len(self.short_factor or ())} short_factor and "
                             f"{len(self.long_factor or ())} long_factor values (one each per "
                             "frequency)")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, max_position_embeddings: int
                ) -> RopeScaling | None:
        """The scaling of a Hugging Face config's rope_parameters / rope_scaling
        dict (None for none or the ``default`` type).  ValueError for a type
        ggmlopt does not compute or a key it does not know."""
        if not params:
            return None
        if not isinstance(params, dict):
            # a config file's value, not an argument
            raise ValueError(f"rope_scaling: expected a dict, got "  # noqa: TRY004
                             f"{type(params).__name__}")
        params = dict(params)
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        params.pop("rope_theta", None)   # read by the caller
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope_scaling: partial_rotary_factor="
                             f"{params['partial_rotary_factor']} is not supported (rotary "
                             "embeddings on every feature of a head only)")
        params.pop("partial_rotary_factor", None)
        if kind == "default":
            if params:
                raise ValueError(f"rope_scaling: keys {sorted(params)} with rope_type "
                                 "'default' are not understood")
            return None
        if kind in _NOT_COMPUTED or kind not in _KEYS or kind == "freq_factors":
            raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (ggmlopt "
                             "computes linear, dynamic, llama3, yarn and longrope)")
        if kind == "dynamic":
            # transformers scales from the config's max_position_embeddings, whatever
            # else the dict says
            given = params.pop("original_max_position_embeddings", max_position_embeddings)
            if given != max_position_embeddings:
                raise ValueError(f"rope_scaling: a dynamic scaling's original_max_position_"
                                 f"embeddings ({given}) is not read by transformers, which "
                                 f"scales from max_position_embeddings "
                                 f"({max_position_embeddings}); give one length")
            params["original_max_position_embeddings"] = max_position_embeddings
        required, optional = _KEYS[kind]
        if kind in ("llama3", "yarn", "longrope"):
            # transformers' standardize_rope_params: the pretraining length defaults to
            # the config's
            params.setdefault("original_max_position_embeddings", max_position_embeddings)
        if kind == "longrope":
            # factor: the context over the pretraining one unless given (transformers'
            # _compute_longrope_parameters); it sets the default attention factor, 1
            # at or below 1
            factor = params.get("factor")
            if factor is None:
                factor = max_position_embeddings / params["original_max_position_embeddings"]
            if isinstance(factor, (int, float)) and not isinstance(factor, bool):
                params["factor"] = max(float(factor), 1.0)
            for name in ("short_factor", "long_factor"):
                if isinstance(params.get(name), list):
                    params[name] = tuple(params[name])
        unknown = sorted(set(params) - required - optional)
        if unknown:
            raise ValueError(f"rope_scaling: keys {unknown} of a {kind!r} scaling are not "
                             "understood")
        if "factor" in required and params.get("factor") is None:
            # transformers refuses it too (a KeyError): no factor is guessed
            raise ValueError(f"rope_scaling: a {kind!r} scaling needs its factor, got {params}")
        return cls(kind, **params)

    def context_length(self, max_position_embeddings: int) -> int:
        """The positions a model of this scaling may take, its config saying
        max_position_embeddings: that, or (dynamic NTK, which stretches it and
        for which transformers sets no limit) that times the factor."""
        if self.rope_type == "dynamic":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face rope_scaling dict (``rope_type`` and this type's keys)."""
        if self.rope_type == "freq_factors":
            raise ValueError("rope_scaling: llama.cpp's per-frequency factors have no Hugging "
                             "Face form")
        required, optional = _KEYS[self.rope_type]
        if self.rope_type == "dynamic":
            # transformers' dynamic reads the config's max_position_embeddings instead
            required = required - {"original_max_position_embeddings"}
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for name in sorted(required | optional):
            value = getattr(self, name)
            if value is not None and not (name == "truncate" and value is True):
                out[name] = value
        return out


def default_inv_freq(head_dim: int, base: float) -> np.ndarray:
    """float32 (head_dim // 2,): 1 / base ** (2i / head_dim), as transformers
    computes it in float32 (and ggmlopt.kernels_attention.rope_table)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None = None, *,
                  long: bool = False, n_positions: int | None = None
                  ) -> tuple[np.ndarray, float]:
    """(inv_freq float32 (head_dim // 2,), attention_factor) for a scaling, each
    step in float32 as transformers' _compute_<type>_parameters; long: LongRoPE's
    long factors' (a pass past original_max_position_embeddings); n_positions:
    the length of the pass, which a dynamic scaling's base grows with past
    original_max_position_embeddings (None: within it)."""
    f32 = np.float32
    if scaling is not None and scaling.rope_type == "dynamic":
        return _dynamic(head_dim, base, scaling, n_positions), 1.0
    inv = default_inv_freq(head_dim, base)
    if scaling is None:
        return inv, 1.0
    kind = scaling.rope_type
    if kind == "longrope":
        return _longrope(head_dim, base, scaling, long)
    if kind == "linear":
        return (inv / f32(scaling.factor)).astype(f32), 1.0
    if kind == "freq_factors":
        factors = np.asarray(scaling.freq_factors, f32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_scaling: {factors.size} freq_factors for head_dim "
                             f"{head_dim} (expected {inv.size})")
        return (inv / factors).astype(f32), 1.0
    if kind == "llama3":
        factor = f32(scaling.factor)
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        assert low is not None and high is not None
        old = scaling.original_max_position_embeddings
        assert old is not None
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = (f32(2 * math.pi) / inv).astype(f32)
        llama = np.where(wavelen > low_wavelen, inv / factor, inv).astype(f32)
        smooth = ((f32(old) / wavelen - f32(low)) / f32(high - low)).astype(f32)
        smoothed = ((f32(1) - smooth) * llama / factor + smooth * llama).astype(f32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, llama).astype(f32), 1.0
    assert kind == "yarn"
    return _yarn(head_dim, base, scaling)


def _dynamic(dim, base, s, n_positions):
    """Dynamic NTK's inv_freq for a pass of n_positions: the plain one within the
    original length; past it the base times ((factor L / original) - (factor -
    1)) ** (dim / (dim - 2)), in float32 as transformers computes it from the
    pass's length (a tensor) in dynamic_rope_update."""
    f32 = np.float32
    original = s.original_max_position_embeddings
    if n_positions is None or n_positions <= original:
        return default_inv_freq(dim, base)
    grown = f32(f32(s.factor) * f32(n_positions) / f32(original)) - f32(s.factor - 1.0)
    new_base = f32(f32(base) * (grown ** f32(dim / (dim - 2))))
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    return (f32(1.0) / (new_base ** exponent)).astype(f32)


def _longrope(dim, base, s, long):
    f32 = np.float32
    factors = np.asarray(s.long_factor if long else s.short_factor, f32)
    if factors.size != dim // 2:
        raise ValueError(f"rope_scaling: {factors.size} LongRoPE factors for head_dim {dim} "
                         f"(expected {dim // 2})")
    original = s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else \
            math.sqrt(1 + math.log(s.factor) / math.log(original))
    shape = (np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)).astype(f32)
    return (f32(1.0) / (factors * (f32(base) ** shape).astype(f32))).astype(f32), float(attention)


def _yarn(dim, base, s):
    f32 = np.float32
    factor = s.factor

    def mscale_of(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(mscale_of(factor, s.mscale) / mscale_of(factor, s.mscale_all_dim))
        else:
            attention = mscale_of(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(rotations):
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extrapolation_factor = (f32(1) - ramp.astype(f32)).astype(f32)
    pos_freqs = (f32(base) ** (np.arange(0, dim, 2).astype(f32) / f32(dim))).astype(f32)
    extrapolation = (f32(1) / pos_freqs).astype(f32)
    interpolation = (f32(1) / (f32(factor) * pos_freqs)).astype(f32)
    inv = (interpolation * (f32(1) - extrapolation_factor)
           + extrapolation * extrapolation_factor).astype(f32)
    return inv, float(attention)


def rope_tables(inv_freq: np.ndarray, n_positions: int, attention_factor: float = 1.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 (n_positions, len(inv_freq)) of the float32 angles
    position * inv_freq (Hugging Face's), cos and sin in float64 rounded once,
    then times attention_factor in float32 as transformers scales them."""
    angles = np.arange(n_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles64 = angles.astype(np.float64)
    cos = np.cos(angles64).astype(np.float32)
    sin = np.sin(angles64).astype(np.float32)
    if attention_factor != 1.0:
        cos = (cos * np.float32(attention_factor)).astype(np.float32)
        sin = (sin * np.float32(attention_factor)).astype(np.float32)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)
