import numpy as np
import numpy.typing as npt
from typing_extensions import TypeAlias

F32: TypeAlias = npt.NDArray[np.float32]

def swiglu(gate: F32, up: F32, out: F32 | None = ...) -> F32: ...
def swiglu_backward(gate: F32, up: F32, grad_h: F32, grad_gate: F32 | None = ...,
                    grad_up: F32 | None = ...) -> tuple[F32, F32]: ...
