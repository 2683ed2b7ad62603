"""Dataset construction, views, ownership, and every misuse as a clear error."""
import gc
import os

import numpy as np
import pytest

import ggmlopt as go

DATA_DTYPES = [np.float32, np.float16, np.uint8, np.int32]
LABEL_DTYPES = [np.float32, np.int32]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("data_dtype", DATA_DTYPES)
@pytest.mark.parametrize("label_dtype", LABEL_DTYPES)
def test_views_have_the_shapes_and_dtypes_asked(data_dtype, label_dtype):
    ds = go.Dataset(7, 3, 12, 4, data_dtype=data_dtype, label_dtype=label_dtype)
    assert (ds.ne_datapoint, ds.ne_label, ds.ndata, ds.ndata_shard, ds.nshards) == (7, 3, 12, 4, 3)
    assert len(ds) == 12
    assert ds.data.shape == (12, 7) and ds.data.dtype == data_dtype
    assert ds.labels.shape == (12, 3) and ds.labels.dtype == label_dtype
    assert ds.data_dtype == data_dtype and ds.label_dtype == label_dtype
    assert ds.data.flags.c_contiguous and ds.data.flags.writeable
    assert ds.labels.flags.c_contiguous and ds.labels.flags.writeable
    assert not ds.data.any() and not ds.labels.any()       # zero-filled
    assert ds.data.ctypes.data % 64 == 0 and ds.labels.ctypes.data % 64 == 0


def test_views_are_zero_copy_and_stable():
    ds = go.Dataset(5, 2, 6)
    ds.data[2, 3] = 7.5
    ds.labels[4, 1] = -1.0
    assert ds.data[2, 3] == 7.5 and ds.labels[4, 1] == -1.0
    assert ds.data.ctypes.data == ds.data.ctypes.data
    assert not np.shares_memory(ds.data, ds.labels)


def test_no_labels_when_ne_label_is_zero():
    ds = go.Dataset(4, 0, 8, 2)
    assert ds.labels is None and ds.label_dtype is None and ds.ne_label == 0


def test_permutation_starts_as_identity_and_is_read_only():
    ds = go.Dataset(1, 0, 30, 5)
    p = ds.permutation
    assert p.dtype == np.int64
    np.testing.assert_array_equal(p, np.arange(6))
    assert not p.flags.writeable
    with pytest.raises(ValueError):
        p[0] = 3
    ds.shuffle(1)
    assert not np.array_equal(ds.permutation, np.arange(6))
    np.testing.assert_array_equal(p, np.arange(6))   # a copy: it does not follow


def test_view_outlives_its_dataset():
    ds = go.Dataset(1000, 3, 50, data_dtype=np.uint8, label_dtype=np.int32)
    ds.data[:] = np.arange(1000, dtype=np.uint8)
    ds.labels[:] = 9
    data, labels = ds.data, ds.labels
    del ds
    gc.collect()
    for _ in range(20):      # churn the allocator: freed memory would be reused
        go.Dataset(1000, 3, 50, data_dtype=np.uint8).data[:] = 77
    np.testing.assert_array_equal(data, np.broadcast_to(np.arange(1000, dtype=np.uint8), (50, 1000)))
    assert (labels == 9).all()
    data[0, 0] = 5           # still writable memory of its own
    assert data[0, 0] == 5


def test_creating_and_dropping_many_datasets_does_not_grow_memory():
    def churn(n):
        for i in range(n):
            ds = go.Dataset(256, 10, 64, 4, data_dtype=np.float32)   # ~ 68 KiB each
            ds.data[0, 0] = i
            ds.get_batch(np.empty((4, 256), np.float32), np.empty((4, 10), np.float32), 0)
            ds.shuffle(i)
            _ = ds.data, ds.labels, ds.permutation
    churn(500)
    gc.collect()
    before = rss_bytes()
    churn(10_000)              # would hold ~ 680 MB if anything leaked
    gc.collect()
    assert rss_bytes() - before < 32 << 20


def test_from_arrays_copies_and_takes_dtypes():
    data = np.arange(24, dtype=np.float16).reshape(6, 2, 2)
    labels = np.arange(12, dtype=np.int32).reshape(6, 2)
    ds = go.Dataset.from_arrays(data, labels, ndata_shard=3, data_scale=0.5)
    assert (ds.ne_datapoint, ds.ne_label, ds.ndata, ds.nshards) == (4, 2, 6, 2)
    assert ds.data_dtype == np.float16 and ds.label_dtype == np.int32
    assert ds.data_scale == 0.5
    np.testing.assert_array_equal(ds.data, data.reshape(6, 4))
    np.testing.assert_array_equal(ds.labels, labels)
    data[0, 0, 0] = 100
    labels[0, 0] = 100
    assert ds.data[0, 0] == 0 and ds.labels[0, 0] == 0   # copies, not views


def test_from_arrays_accepts_non_contiguous_input():
    base = np.arange(40, dtype=np.int32).reshape(10, 4)
    ds = go.Dataset.from_arrays(base[::2, ::2])
    np.testing.assert_array_equal(ds.data, base[::2, ::2])
    assert ds.labels is None


def test_data_scale_defaults_to_one():
    assert go.Dataset(1, 0, 1, data_dtype=np.uint8).data_scale == 1.0


# ---- bad construction --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, name", [
    ({"ne_datapoint": 0}, ValueError, "ne_datapoint"),
    ({"ne_datapoint": -3}, ValueError, "ne_datapoint"),
    ({"ne_label": -1}, ValueError, "ne_label"),
    ({"ndata": 0}, ValueError, "ndata"),
    ({"ndata": -4}, ValueError, "ndata"),
    ({"ndata_shard": 0}, ValueError, "ndata_shard"),
    ({"ndata_shard": -1}, ValueError, "ndata_shard"),
    ({"ndata": 10, "ndata_shard": 3}, ValueError, "ndata"),
    ({"ndata": 2.0}, TypeError, "ndata"),
    ({"ne_datapoint": True}, TypeError, "ne_datapoint"),
    ({"ne_datapoint": 1 << 40, "ndata": 1 << 40}, ValueError, "ndata"),
    ({"data_dtype": np.float64}, TypeError, "data_dtype"),
    ({"data_dtype": np.int64}, TypeError, "data_dtype"),
    ({"data_dtype": ">f4"}, TypeError, "data_dtype"),
    ({"data_dtype": "nonsense"}, TypeError, "data_dtype"),
    ({"label_dtype": np.uint8}, TypeError, "label_dtype"),
    ({"label_dtype": np.float16}, TypeError, "label_dtype"),
    ({"data_scale": 0.5}, ValueError, "data_scale"),          # float32 data: no scale
    ({"data_dtype": np.int32, "data_scale": 2}, ValueError, "data_scale"),
    ({"data_dtype": np.uint8, "data_scale": "x"}, TypeError, "data_scale"),
    ({"data_dtype": np.uint8, "data_scale": float("nan")}, ValueError, "data_scale"),
    ({"data_dtype": np.uint8, "data_scale": 1e300}, ValueError, "data_scale"),
])
def test_bad_construction_names_the_argument(kwargs, exc, name):
    args = {"ne_datapoint": 3, "ne_label": 2, "ndata": 6, "ndata_shard": 1}
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        go.Dataset(**args)


@pytest.mark.parametrize("data, labels, exc, name", [
    ([[1.0, 2.0]], None, TypeError, "data"),
    (np.zeros(5, np.float32), None, ValueError, "data"),
    (np.zeros((0, 3), np.float32), None, ValueError, "data"),
    (np.zeros((3, 0), np.float32), None, ValueError, "data"),
    (np.zeros((3, 2), np.complex64), None, TypeError, "data"),
    (np.zeros((3, 2), np.float32), np.zeros(4, np.int32), ValueError, "labels"),
    (np.zeros((3, 2), np.float32), np.zeros((3, 1), object), TypeError, "labels"),
    (np.zeros((3, 2), np.float32), np.zeros((3, 1, 1), np.int32), ValueError, "labels"),
    (np.zeros((3, 2), np.float32), np.array([0, -1, 2]), ValueError, "labels: class"),
    (np.zeros((3, 2), np.float32), np.array([0, 2**31, 2]), ValueError, "labels: class"),
    (np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32), ValueError, "labels"),
    (np.zeros((3, 2), np.float32), np.zeros((3, 0), np.float32), ValueError, "labels"),
    (np.zeros((3, 2), np.float32), [[1.0]] * 3, TypeError, "labels"),
])
def test_bad_from_arrays_names_the_argument(data, labels, exc, name):
    with pytest.raises(exc, match=name):
        go.Dataset.from_arrays(data, labels)


def test_from_arrays_checks_sharding():
    with pytest.raises(ValueError, match="ndata_shard"):
        go.Dataset.from_arrays(np.zeros((7, 2), np.float32), ndata_shard=2)


# ---- bad get_batch ------------------------------------------------------------------

@pytest.fixture
def labelled():
    ds = go.Dataset(3, 2, 12, 2, data_dtype=np.uint8, label_dtype=np.int32, data_scale=0.5)
    ds.data[:] = np.arange(36).reshape(12, 3)
    ds.labels[:] = np.arange(24).reshape(12, 2)
    return ds


def _unchanged(ds, snapshot):
    np.testing.assert_array_equal(ds.data, snapshot[0])
    np.testing.assert_array_equal(ds.labels, snapshot[1])
    np.testing.assert_array_equal(ds.permutation, snapshot[2])


@pytest.mark.parametrize("make, exc, name", [
    (lambda: ([0] * 12, np.zeros((4, 2), np.int32), 0), TypeError, "data_batch"),
    (lambda: (np.zeros((4, 3), np.float64), np.zeros((4, 2), np.int32), 0), TypeError, "data_batch"),
    (lambda: (np.zeros((4, 3), np.int32), np.zeros((4, 2), np.int32), 0), TypeError, "data_batch"),
    (lambda: (np.zeros((4, 3), np.float16), np.zeros((4, 2), np.int32), 0), TypeError, "data_batch"),
    (lambda: (np.zeros((3, 3), np.uint8), np.zeros((3, 2), np.int32), 0), ValueError, "data_batch"),
    (lambda: (np.zeros((0, 3), np.uint8), np.zeros((0, 2), np.int32), 0), ValueError, "data_batch"),
    (lambda: (np.zeros((4, 6), np.uint8)[:, ::2], np.zeros((4, 2), np.int32), 0), ValueError,
     "contiguous"),
    (lambda: (np.zeros((4, 3), np.uint8).T, np.zeros((4, 2), np.int32), 0), ValueError,
     "contiguous"),
    (lambda: (_ro(np.zeros((4, 3), np.uint8)), np.zeros((4, 2), np.int32), 0), ValueError,
     "read-only"),
    (lambda: (np.zeros((4, 3), np.uint8), None, 0), ValueError, "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 2), np.float32), 0), TypeError,
     "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((2, 2), np.int32), 0), ValueError,
     "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((6, 2), np.int32), 0), ValueError,
     "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), _ro(np.zeros((4, 2), np.int32)), 0), ValueError,
     "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 4), np.int32)[:, :2], 0), ValueError,
     "labels_batch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 2), np.int32), 3), IndexError, "ibatch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 2), np.int32), -1), IndexError, "ibatch"),
    (lambda: (np.zeros((12, 3), np.uint8), np.zeros((12, 2), np.int32), 1), IndexError, "ibatch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 2), np.int32), 1.0), TypeError, "ibatch"),
    (lambda: (np.zeros((4, 3), np.uint8), np.zeros((4, 2), np.int32), None), TypeError, "ibatch"),
])
def test_bad_get_batch_names_the_argument(labelled, make, exc, name):
    snap = (labelled.data.copy(), labelled.labels.copy(), labelled.permutation)
    data_batch, labels_batch, ibatch = make()
    before_d = np.array(data_batch, copy=True)
    with pytest.raises(exc, match=name):
        labelled.get_batch(data_batch, labels_batch, ibatch)
    _unchanged(labelled, snap)
    if isinstance(data_batch, np.ndarray):
        np.testing.assert_array_equal(data_batch, before_d)   # nothing written


def _ro(a):
    a.flags.writeable = False
    return a


def test_labels_given_to_a_dataset_without_labels():
    ds = go.Dataset(3, 0, 4)
    with pytest.raises(ValueError, match="labels_batch"):
        ds.get_batch(np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32), 0)
    ds.get_batch(np.zeros((2, 3), np.float32), None, 1)


def test_batch_may_not_alias_the_dataset(labelled):
    snap = (labelled.data.copy(), labelled.labels.copy(), labelled.permutation)
    with pytest.raises(ValueError, match="share memory"):
        labelled.get_batch(labelled.data[4:8], np.zeros((4, 2), np.int32), 0)
    with pytest.raises(ValueError, match="share memory"):
        labelled.get_batch(np.zeros((4, 3), np.uint8), labelled.labels[:4], 0)
    _unchanged(labelled, snap)


def test_data_and_labels_batch_may_not_overlap():
    ds = go.Dataset(2, 2, 4, data_dtype=np.int32, label_dtype=np.int32)
    buf = np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="overlap"):
        ds.get_batch(buf[:4], buf[2:6], 0)


# ---- bad shuffle --------------------------------------------------------------------

@pytest.mark.parametrize("rng, idata, exc, name", [
    (0, 13, ValueError, "idata"),         # > ndata
    (0, 3, ValueError, "idata"),          # not a multiple of ndata_shard
    (0, 2.0, TypeError, "idata"),
    ("seed", -1, TypeError, "rng_or_ctx"),
    (np.random.RandomState(0), -1, TypeError, "rng_or_ctx"),
    (object(), -1, TypeError, "rng_or_ctx"),
    (-5, -1, ValueError, "rng_or_ctx"),
    (True, -1, TypeError, "rng_or_ctx"),
])
def test_bad_shuffle_names_the_argument(labelled, rng, idata, exc, name):
    snap = (labelled.data.copy(), labelled.labels.copy(), labelled.permutation)
    with pytest.raises(exc, match=name):
        labelled.shuffle(rng, idata)
    _unchanged(labelled, snap)


def test_bad_idata_does_not_consume_the_generator(labelled):
    rng = np.random.default_rng(3)
    state = rng.bit_generator.state
    with pytest.raises(ValueError):
        labelled.shuffle(rng, 3)
    assert rng.bit_generator.state == state


@pytest.mark.parametrize("name, dtype", [("f32", np.float32), ("F16", np.float16),
                                         ("i32", np.int32), ("float16", np.float16)])
def test_llama_cpp_type_names_choose_the_storage(name, dtype):
    ds = go.Dataset(4, 1, 6, data_dtype=name, label_dtype="f32")
    assert ds.data.dtype == dtype and ds.labels.dtype == np.float32
    with pytest.raises(TypeError, match="data_dtype: bf16 is not supported"):
        go.Dataset(4, 1, 6, data_dtype="bf16")
    with pytest.raises(TypeError, match="data_dtype: expected a NumPy dtype or one of"):
        go.Dataset(4, 1, 6, data_dtype="f99")
