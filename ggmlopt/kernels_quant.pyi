from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

QTYPES: dict[str, int]
QUANTIZE_TYPES: tuple[str, ...]
Q8_ACTIVATION_TYPES: tuple[str, ...]
Q8_K_ACTIVATION_TYPES: tuple[str, ...]

def row_bytes(qtype: str | int, ncols: int) -> int: ...
def dequantize(qtype: str | int, raw: npt.NDArray[np.generic], ncols: int, start: int = ...,
               stop: int | None = ...,
               out: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
def matmul(x: npt.NDArray[np.float32], qtype: str | int, raw: npt.NDArray[np.generic],
           out: npt.NDArray[np.float32] | None = ...,
           activations: str = ...) -> npt.NDArray[np.float32]: ...
def matmul_many(x: npt.NDArray[np.float32],
                weights: Sequence[tuple[str | int, npt.NDArray[np.generic]]],
                activations: str = ...) -> list[npt.NDArray[np.float32]]: ...
def quantize_q8_0_activations(
        x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
def quantize_q8_k_activations(
        x: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], npt.NDArray[np.int16]]: ...
def gather(ids: npt.NDArray[np.int32], qtype: str | int, raw: npt.NDArray[np.generic],
           ncols: int, out: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
def quantize(rows: npt.NDArray[np.float32], qtype: str | int,
             out: npt.NDArray[np.uint8] | None = ...) -> npt.NDArray[np.uint8]: ...
