import numpy as np
import numpy.typing as npt

QTYPES: dict[str, int]

def row_bytes(qtype: str | int, ncols: int) -> int: ...
def dequantize(qtype: str | int, raw: npt.NDArray[np.generic], ncols: int, start: int = ...,
               stop: int | None = ...,
               out: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
def matmul(x: npt.NDArray[np.float32], qtype: str | int, raw: npt.NDArray[np.generic],
           out: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
