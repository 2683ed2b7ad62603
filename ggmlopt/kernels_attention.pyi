"""Type stubs for ggmlopt.kernels_attention (causal attention, rotary embedding)."""
import numpy as np
import numpy.typing as npt

MAX_HEAD_DIM: int

def attention_forward(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32] | None = ...,
    lse: npt.NDArray[np.float32] | None = ...,
    kv_start: npt.NDArray[np.int32] | None = ...,
    softcap: float | None = ...,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
def document_starts(doc_ids: npt.ArrayLike) -> npt.NDArray[np.int32]: ...
def window_starts(batch: int, t: int, window: int) -> npt.NDArray[np.int32]: ...
def attention_backward(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    lse: npt.NDArray[np.float32],
    grad_out: npt.NDArray[np.float32],
    dq: npt.NDArray[np.float32] | None = ...,
    dk: npt.NDArray[np.float32] | None = ...,
    dv: npt.NDArray[np.float32] | None = ...,
    kv_start: npt.NDArray[np.int32] | None = ...,
    softcap: float | None = ...,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
def attention_forward_qkv(
    qkv: npt.NDArray[np.float32],
    n_heads: int,
    n_kv_heads: int | None = ...,
    out: npt.NDArray[np.float32] | None = ...,
    lse: npt.NDArray[np.float32] | None = ...,
    kv_start: npt.NDArray[np.int32] | None = ...,
    softcap: float | None = ...,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
def attention_backward_qkv(
    qkv: npt.NDArray[np.float32],
    n_heads: int,
    out: npt.NDArray[np.float32],
    lse: npt.NDArray[np.float32],
    grad_out: npt.NDArray[np.float32],
    n_kv_heads: int | None = ...,
    dqkv: npt.NDArray[np.float32] | None = ...,
    kv_start: npt.NDArray[np.int32] | None = ...,
    softcap: float | None = ...,
) -> npt.NDArray[np.float32]: ...
def rope(
    x: npt.NDArray[np.float32],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    pos: int = ...,
    out: npt.NDArray[np.float32] | None = ...,
    *,
    inverse: bool = ...,
) -> npt.NDArray[np.float32]: ...
def rope_table(
    head_dim: int, n_positions: int, base: float = ...
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
def attention_decode(
    q: npt.NDArray[np.float32],
    cache_k: npt.NDArray[np.float32],
    cache_v: npt.NDArray[np.float32],
    length: int,
    out: npt.NDArray[np.float32] | None = ...,
    start: int = ...,
    softcap: float | None = ...,
) -> npt.NDArray[np.float32]: ...
