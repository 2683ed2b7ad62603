from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

@disjoint_base
class LlamaBlockStep:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    def __init__(self, projections: Mapping[str, tuple[str | int, npt.NDArray[np.generic],
                                                       npt.NDArray[np.float32] | None]],
                 attn_norm: npt.NDArray[np.float32], ffn_norm: npt.NDArray[np.float32], *,
                 n_heads: int, n_kv_heads: int, eps: float,
                 q_norm: npt.NDArray[np.float32] | None = ...,
                 k_norm: npt.NDArray[np.float32] | None = ...,
                 window: int | None = ..., activations: str = ...) -> None: ...
    def step(self, x: npt.NDArray[np.float32], cache_k: npt.NDArray[np.float32],
             cache_v: npt.NDArray[np.float32], pos: int,
             cos: npt.NDArray[np.float32] | None = ...,
             sin: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
