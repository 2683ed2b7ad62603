import numpy as np
from typing_extensions import Self, disjoint_base

ALIGNMENT: int

@disjoint_base
class AlignedBuffer:
    """Aligned memory this object owns; NumPy views of it through as_array."""
    def __new__(cls, nbytes: int) -> Self: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def as_array(self, dtype: np.dtype | type, shape: tuple[int, ...], offset: int = ...) -> np.ndarray: ...
