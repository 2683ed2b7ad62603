"""AlignedBuffer.view / as_array: every view lies inside the buffer, whatever the
shape, dtype or offset asked; nothing that holds Python objects is handed out."""
import sys

import numpy as np
import pytest

from ggmlopt._memory import AlignedBuffer


@pytest.mark.parametrize("dtype, shape, offset", [
    (np.uint8, (16,), 2**63 - 8),          # offset + size wraps past 2^63
    (np.uint8, (1,), 2**63 - 1),
    (np.float64, (2**61,), 0),             # count * itemsize wraps to 0
    (np.float32, (2**62, 2), 0),
    (np.uint8, (2**32, 2**32), 0),         # count wraps to 0
    (np.uint8, (2**64,), 0),               # a dimension past int64
    (np.uint8, (65,), 0),
    (np.uint8, (1,), 64),
    (np.uint8, (0,), 65),                  # an empty view must still start inside
])
def test_views_that_do_not_fit_are_refused(dtype, shape, offset):
    buf = AlignedBuffer(64)
    with pytest.raises(ValueError, match="does not fit|shape"):
        buf.as_array(dtype, shape, offset)


def test_views_that_fit_exactly_are_given():
    buf = AlignedBuffer(64)
    assert buf.as_array(np.float32, (4, 4)).shape == (4, 4)
    assert buf.as_array(np.uint8, (1,), 63).shape == (1,)
    assert buf.as_array(np.uint8, (0,), 64).size == 0
    assert buf.as_array(np.float64, (0, 2**40)).size == 0



@pytest.mark.parametrize("dtype", [object, np.dtype([("a", np.int64), ("b", object)])])
def test_object_views_are_refused(dtype):
    # object references written into buffer memory would never be released, and a
    # second view of the same bytes could forge pointers
    buf = AlignedBuffer(64)
    before = sys.getrefcount(buf)
    with pytest.raises(TypeError, match="dtype"):
        buf.as_array(dtype, (2,))
    assert sys.getrefcount(buf) == before


@pytest.mark.parametrize("dtype", [">f4", "<i8", ">u2", "S4", np.dtype([("a", "<i4"), ("b", ">f8")])])
def test_views_keep_the_dtype_asked(dtype):
    # the whole descriptor (byte order, fields, string length), not just its type number
    buf = AlignedBuffer(64)
    view = buf.as_array(dtype, (3,), 8)
    assert view.dtype == np.dtype(dtype)
    assert view.shape == (3,) and view.flags.c_contiguous and view.flags.writeable
    assert view.__array_interface__["data"][0] == buf.address + 8
