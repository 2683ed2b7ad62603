"""Non-finite float data: refused by Dataset.from_arrays unless allow_nonfinite=True,
and named by its datapoint when it reaches training anyway."""
import re

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.nn import Linear, ReLU, Sequential


def _data(n=40, ne=6, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, ne)).astype(dtype), np.eye(3)[rng.integers(0, 3, n)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_from_arrays_refuses_nonfinite_data_naming_the_first_datapoint(dtype, bad):
    x, y = _data(dtype=dtype)
    x[31, 0] = bad
    x[17, 4] = bad  # the first one is named
    with pytest.raises(ValueError, match=rf"^data: datapoint 17 holds {re.escape(str(bad))} "
                                         r"\(element 4\).*allow_nonfinite=True"):
        go.Dataset.from_arrays(x, y)
    ds = go.Dataset.from_arrays(x, y, allow_nonfinite=True)
    np.testing.assert_array_equal(ds.data, x.astype(ds.data_dtype))


def test_from_arrays_refuses_nonfinite_labels_and_overflows():
    x, y = _data()
    y[5, 2] = np.nan
    with pytest.raises(ValueError, match=r"^labels: datapoint 5 holds nan \(element 2\)"):
        go.Dataset.from_arrays(x, y)
    assert np.isnan(go.Dataset.from_arrays(x, y, allow_nonfinite=True).labels[5, 2])
    # a float64 value too large for float32 storage
    x64, y = _data(dtype=np.float64)
    x64[3, 1] = -1e39
    with pytest.raises(ValueError, match=r"^data: datapoint 3 holds -inf \(element 1: -1e\+39 "
                                         r"does not fit float32\)"):
        go.Dataset.from_arrays(x64, y)
    # images of any shape: the datapoint, and the element of the flattened datapoint
    images = np.zeros((4, 3, 5), np.float32)
    images[2, 1, 3] = np.inf
    with pytest.raises(ValueError, match=r"datapoint 2 holds inf \(element 8\)"):
        go.Dataset.from_arrays(images)


def test_finite_and_integer_data_pass():
    x, y = _data()
    x[0, 0] = np.finfo(np.float32).max
    go.Dataset.from_arrays(x, y)
    go.Dataset.from_arrays(np.full((4, 3), 255, np.uint8), np.arange(4) % 2)
    go.Dataset.from_arrays(np.ones((4, 3), np.int64), np.ones((4, 2), np.int64))


@pytest.mark.parametrize("where", ["data", "labels"])
def test_fit_on_allowed_nonfinite_data_names_the_datapoint_and_the_value(where):
    """inf in the data makes the loss NaN (inf - inf): the error says inf, and which
    datapoint of the (shuffled) dataset holds it."""
    x, y = _data()
    if where == "data":
        x[23, 2] = np.inf
    else:
        y[23, 1] = np.nan
    ds = go.Dataset.from_arrays(x, y, ndata_shard=2, allow_nonfinite=True)
    model = Sequential(Linear(6, 8, rng=0), ReLU(), Linear(8, 3, rng=1))
    value = "inf" if where == "data" else "nan"
    with np.errstate(invalid="ignore"), pytest.raises(FloatingPointError) as info:
        go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=1, nbatch_logical=10,
               silent=True, seed=3)
    what = "inputs" if where == "data" else "labels"
    message = str(info.value)
    assert re.search(rf"the {what} hold {value} in row \d of the batch", message), message
    assert message.endswith(f": its datapoint 23 holds {value} in its {where}]"), message
