"""Dataset views: what one caller does to the view object it was handed (reshape
it, mark it read-only, retype it) must not change what the next caller gets."""
import numpy as np
import pytest

import ggmlopt as go


def _reshape(a):
    a.shape = (-1,)


def _freeze(a):
    a.flags.writeable = False


def _retype(a):
    a.dtype = np.uint8


@pytest.mark.parametrize("mutate", [_reshape, _freeze, _retype])
@pytest.mark.parametrize("which", ["data", "labels"])
def test_a_mutated_view_does_not_change_the_next_one(which, mutate):
    ds = go.Dataset(3, 2, 4, label_dtype=np.int32)
    mutate(getattr(ds, which))
    fresh = getattr(ds, which)
    expected = (4, 3) if which == "data" else (4, 2)
    assert fresh.shape == expected
    assert fresh.dtype == (np.float32 if which == "data" else np.int32)
    assert fresh.flags.writeable and fresh.flags.c_contiguous
    fresh[1, 1] = 5
    assert getattr(ds, which)[1, 1] == 5            # still the dataset's memory


def test_views_share_the_dataset_memory():
    ds = go.Dataset(3, 2, 4)
    assert np.shares_memory(ds.data, ds.data)
    assert ds.data.ctypes.data == ds.data.ctypes.data
    ds.data[0, 0] = 1.5
    out = np.empty((1, 3), np.float32)
    ds.get_batch(out, np.empty((1, 2), np.float32), 0)
    assert out[0, 0] == 1.5


@pytest.mark.parametrize("order", [">", "<"])
def test_from_arrays_takes_either_byte_order(order):
    # big-endian float32 (IDX files, np.fromfile(..., '>f4')) is float32 data: it is
    # stored in native order, the values unchanged
    data = (np.arange(12, dtype=np.float32).reshape(4, 3) / 3).astype(order + "f4")
    labels = (np.arange(8, dtype=np.int32).reshape(4, 2) - 3).astype(order + "i4")
    assert data.dtype.byteorder in "<>="
    ds = go.Dataset.from_arrays(data, labels, ndata_shard=2)
    assert ds.data_dtype == np.dtype("=f4") and ds.label_dtype == np.dtype("=i4")
    assert ds.data.dtype.isnative and ds.labels.dtype.isnative
    np.testing.assert_array_equal(ds.data, data)
    np.testing.assert_array_equal(ds.labels, labels)
    out, lab = np.empty((2, 3), np.float32), np.empty((2, 2), np.int32)
    ds.get_batch(out, lab, 1)
    np.testing.assert_array_equal(out, data[2:])
    np.testing.assert_array_equal(lab, labels[2:])


def test_from_arrays_still_refuses_what_is_not_real():
    with pytest.raises(TypeError, match="^data: expected real numbers.*c16"):
        go.Dataset.from_arrays(np.zeros((2, 2), ">c16"))
    with pytest.raises(TypeError, match="^labels: expected class indices"):
        go.Dataset.from_arrays(np.zeros((2, 2), np.float32), np.array(["a", "b"]))


def test_repr_says_a_dataset_without_labels_has_no_label_dtype():
    assert "label_dtype=None" in repr(go.Dataset(3, 0, 4))
    assert "label_dtype=int32" in repr(go.Dataset(3, 1, 4, label_dtype=np.int32))
