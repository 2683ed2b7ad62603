import numpy as np
import numpy.typing as npt
from typing_extensions import TypeAlias

F32: TypeAlias = npt.NDArray[np.float32]

def rmsnorm(x: F32, weight: F32, eps: float = ..., out: F32 | None = ...,
            rstd: F32 | None = ...) -> tuple[F32, F32]: ...
def norm_backward_workspace(nrows: int, dim: int) -> int: ...
def rmsnorm_backward(x: F32, weight: F32, rstd: F32, grad_y: F32, grad_x: F32 | None = ...,
                     grad_weight: F32 | None = ..., *, input_grad: bool = ...,
                     workspace: F32 | None = ...) -> F32 | None: ...
def layernorm(x: F32, weight: F32, bias: F32 | None = ..., eps: float = ...,
              out: F32 | None = ..., mean: F32 | None = ...,
              rstd: F32 | None = ...) -> tuple[F32, F32, F32]: ...
def layernorm_backward(x: F32, weight: F32, mean: F32, rstd: F32, grad_y: F32,
                       grad_x: F32 | None = ..., grad_weight: F32 | None = ...,
                       grad_bias: F32 | None = ..., *, input_grad: bool = ...,
                       workspace: F32 | None = ...) -> F32 | None: ...
