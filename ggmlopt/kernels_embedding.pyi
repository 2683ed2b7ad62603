import numpy as np
import numpy.typing as npt

def embedding(ids: npt.NDArray[np.int32], weight: npt.NDArray[np.float32],
              out: npt.NDArray[np.float32] | None = ...) -> npt.NDArray[np.float32]: ...
def embedding_backward(ids: npt.NDArray[np.int32], grad: npt.NDArray[np.float32],
                       grad_weight: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
