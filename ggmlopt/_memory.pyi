import numpy as np

ALIGNMENT: int

class AlignedBuffer:
    nbytes: int
    def __init__(self, nbytes: int) -> None: ...
    @property
    def address(self) -> int: ...
    def as_array(self, dtype: np.dtype | type, shape: tuple[int, ...], offset: int = ...) -> np.ndarray: ...
