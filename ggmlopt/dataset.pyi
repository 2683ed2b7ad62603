import enum
from typing import Any

import numpy as np
import numpy.typing as npt

class StorageKind(enum.IntEnum):
    STORAGE_F32 = 0
    STORAGE_F16 = 1
    STORAGE_U8 = 2
    STORAGE_I32 = 3

class GetBatchStatus(enum.IntEnum):
    GET_BATCH_OK = 0
    GET_BATCH_OUT_OF_RANGE = -1
    GET_BATCH_LABELS_MISMATCH = -2
    GET_BATCH_NO_CONVERSION = -3

class Dataset:
    ndata: int
    ndata_shard: int
    nshards: int
    ne_datapoint: int
    ne_label: int
    def __init__(self, ne_datapoint: int, ne_label: int, ndata: int, ndata_shard: int = ...,
                 data_dtype: npt.DTypeLike = ..., label_dtype: npt.DTypeLike = ...,
                 data_scale: float | None = ...) -> None: ...
    @classmethod
    def from_arrays(cls, data: np.ndarray, labels: np.ndarray | None = ...,
                    ndata_shard: int = ..., data_scale: float | None = ...) -> Dataset: ...
    @property
    def data(self) -> np.ndarray: ...
    @property
    def labels(self) -> np.ndarray | None: ...
    @property
    def data_dtype(self) -> np.dtype: ...
    @property
    def label_dtype(self) -> np.dtype | None: ...
    @property
    def class_labels(self) -> bool: ...
    @property
    def data_scale(self) -> float: ...
    @property
    def permutation(self) -> npt.NDArray[np.int64]: ...
    def __len__(self) -> int: ...
    def __reduce__(self) -> tuple: ...
    def shuffle(self, rng_or_ctx: np.random.Generator | int | Any, idata: int = ...) -> None: ...
    def get_batch(self, data_batch: np.ndarray, labels_batch: np.ndarray | None,
                  ibatch: int) -> None: ...
