# The Dataset's C level, for other Cython code (the training loop):
#
#     from ggmlopt.dataset cimport Dataset, GET_BATCH_OK
#     cdef Dataset ds = dataset
#     with nogil:
#         rc = ds.get_batch_c(inputs_ptr, True, labels_ptr, shards_per_batch, ibatch)
#
# get_batch_c checks only what it can without the GIL (the batch range, labels
# present exactly when the dataset has them, the conversion being supported) and
# returns one of the GET_BATCH_* codes; dtypes, sizes, contiguity and
# writability of the batch memory are the caller's job (Dataset.get_batch, the
# Python method, checks them all).
from libc.stdint cimport int64_t

from ggmlopt._memory cimport AlignedBuffer

# Storage kinds of the data (labels use F32 and I32 only).
cpdef enum StorageKind:
    STORAGE_F32 = 0
    STORAGE_F16 = 1
    STORAGE_U8 = 2
    STORAGE_I32 = 3

# Return codes of Dataset.get_batch_c.
cpdef enum GetBatchStatus:
    GET_BATCH_OK = 0
    GET_BATCH_OUT_OF_RANGE = -1      # ibatch < 0, shards_per_batch < 1 or past nshards
    GET_BATCH_LABELS_MISMATCH = -2   # labels_batch NULL for a labelled dataset, or the reverse
    GET_BATCH_NO_CONVERSION = -3     # to_f32 asked of float32/int32 storage


cdef class Dataset:
    cdef AlignedBuffer _data_buf      # (ndata, ne_datapoint) of the data dtype
    cdef AlignedBuffer _labels_buf    # (ndata, ne_label) of the label dtype; None if ne_label == 0
    cdef AlignedBuffer _perm_buf      # nshards int64 shard indices
    cdef char *_data
    cdef char *_labels
    cdef int64_t *_perm
    cdef object __weakref__           # MPI ranks keep digests of datasets, not the datasets
    cdef readonly int64_t ndata
    """Number of datapoints (int; ggml_opt_dataset_ndata); also len(dataset)."""
    cdef readonly int64_t ndata_shard
    """Datapoints per shard (int): the unit shuffle permutes and get_batch copies."""
    cdef readonly int64_t nshards
    """Number of shards (int): ndata // ndata_shard."""
    cdef readonly int64_t ne_datapoint
    """Elements per datapoint (int): the width of data, (ndata, ne_datapoint)."""
    cdef readonly int64_t ne_label
    """Label elements per datapoint (int): the width of labels, (ndata, ne_label);
    0 for a dataset without labels, 1 for class indices."""
    cdef StorageKind _data_kind
    cdef StorageKind _label_kind
    cdef int64_t _shard_data_bytes    # bytes of one shard of data in storage
    cdef int64_t _shard_label_bytes   # bytes of one shard of labels (0 without labels)
    cdef float _data_scale            # applied only when converting to float32
    cdef object _data_view
    cdef object _labels_view
    cdef object _perm_view            # writable, private: shuffle works on it

    cdef int get_batch_c(self, void *data_batch, bint to_f32, void *labels_batch,
                         int64_t shards_per_batch, int64_t ibatch) noexcept nogil
