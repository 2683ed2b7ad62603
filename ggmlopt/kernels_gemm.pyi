import numpy as np
import numpy.typing as npt
from typing_extensions import TypeAlias

F32: TypeAlias = npt.NDArray[np.float32]
U16: TypeAlias = npt.NDArray[np.uint16]

def sgemm(a: F32, b: F32, out: F32, accumulate: bool = ...) -> F32: ...
def try_sgemm(a: F32, b: F32, out: F32, accumulate: bool = ...) -> bool: ...
def gemm_bf16(a16: U16, b16: U16, out: F32, accumulate: bool = ...) -> F32: ...
