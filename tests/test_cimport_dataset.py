"""The Dataset's C level: a separate Cython extension cimports ggmlopt.dataset,
calls Dataset.get_batch_c without the GIL (and the class-index cross-entropy
kernel from ggmlopt.kernels), and gets what the Python methods give."""
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import ggmlopt

USER_PYX = """\
# cython: language_level=3
# Takes C-contiguous arrays of the right dtypes only (RUN_PY makes them).
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

from ggmlopt.dataset cimport (GET_BATCH_LABELS_MISMATCH, GET_BATCH_NO_CONVERSION, GET_BATCH_OK,
                              GET_BATCH_OUT_OF_RANGE, Dataset)
from ggmlopt.kernels cimport cross_entropy_index_f32

cnp.import_array()


def get_batch(Dataset ds, cnp.ndarray data, bint to_f32, object labels, int64_t shards,
              int64_t ibatch):
    cdef void *pd = cnp.PyArray_DATA(data)
    cdef void *pl = NULL if labels is None else cnp.PyArray_DATA(<cnp.ndarray>labels)
    cdef int rc
    with nogil:
        rc = ds.get_batch_c(pd, to_f32, pl, shards, ibatch)
    return rc


def codes():
    return (GET_BATCH_OK, GET_BATCH_OUT_OF_RANGE, GET_BATCH_LABELS_MISMATCH,
            GET_BATCH_NO_CONVERSION)


def cross_entropy_index(cnp.ndarray logits, cnp.ndarray classes, cnp.ndarray grad):
    cdef int64_t rows = logits.shape[0], cols = logits.shape[1]
    cdef float *px = <float *>cnp.PyArray_DATA(logits)
    cdef int32_t *pc = <int32_t *>cnp.PyArray_DATA(classes)
    cdef float *pg = <float *>cnp.PyArray_DATA(grad)
    cdef double loss
    with nogil:
        loss = cross_entropy_index_f32(rows, cols, px, pc, pg, 1.0)
    return loss
"""

SETUP_PY = """\
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension("user_dataset", ["user_dataset.pyx"],
                include_dirs=[{include!r}, numpy.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=["-O0"] if {posix!r} else [])
setup(ext_modules=cythonize([ext], include_path=[{package_parent!r}], quiet=True))
"""

RUN_PY = """\
import numpy as np
import user_dataset
import ggmlopt as go
from ggmlopt import kernels

ok, out_of_range, mismatch, no_conversion = user_dataset.codes()
rng = np.random.default_rng(2)
images = rng.integers(0, 256, (12, 5), dtype=np.uint8)
classes = rng.integers(0, 4, 12)
ds = go.Dataset.from_arrays(images, classes, ndata_shard=2, data_scale=0.5)
ds.shuffle(7)
c_data, c_lab = np.empty((4, 5), np.float32), np.empty((4, 1), np.int32)
p_data, p_lab = np.empty_like(c_data), np.empty_like(c_lab)
rcs = [user_dataset.get_batch(ds, c_data, True, c_lab, 2, 2)]
ds.get_batch(p_data, p_lab, 2)
raw, lab0, spare = np.empty((4, 5), np.uint8), np.empty_like(c_lab), np.empty_like(c_data)
rcs.append(user_dataset.get_batch(ds, raw, False, lab0, 2, 0))
rcs.append(user_dataset.get_batch(ds, spare, True, lab0, 2, 3))      # past the end
rcs.append(user_dataset.get_batch(ds, spare, True, None, 2, 0))      # labels missing
plain = go.Dataset.from_arrays(images.astype(np.int32))
rcs.append(user_dataset.get_batch(plain, raw, True, None, 1, 0))      # int32: no conversion

logits = rng.standard_normal((9, 10)).astype(np.float32)
cls = rng.integers(0, 10, 9).astype(np.int32)
grad, grad_hot = np.zeros_like(logits), np.zeros_like(logits)
loss = user_dataset.cross_entropy_index(logits, cls, grad)
loss_hot = kernels.cross_entropy(logits, np.eye(10, dtype=np.float32)[cls], grad_hot)
np.savez("results.npz", c_data=c_data, c_lab=c_lab, p_data=p_data, p_lab=p_lab, raw=raw,
         lab0=lab0, images=images, classes=classes, perm=ds.permutation, rcs=np.array(rcs),
         want=np.array([ok, ok, out_of_range, mismatch, no_conversion]),
         loss=loss, loss_hot=loss_hot, grad=grad, grad_hot=grad_hot)
"""


def c_compiler():
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(cc[0]) if cc else None


@pytest.fixture(scope="module")
def results(tmp_path_factory, package_parent):
    if not c_compiler():
        pytest.skip("no C compiler available to build a Cython extension against ggmlopt")
    folder = tmp_path_factory.mktemp("cimport_dataset")
    (folder / "user_dataset.pyx").write_text(USER_PYX)
    (folder / "setup.py").write_text(SETUP_PY.format(include=ggmlopt.get_include(),
                                                     package_parent=package_parent,
                                                     posix=os.name == "posix"))
    env = dict(os.environ)
    env.pop("GGMLOPT_SIMD", None)
    env["PYTHONPATH"] = package_parent
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=folder,
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env["PYTHONPATH"] = os.pathsep.join([str(folder), package_parent])
    proc = subprocess.run([sys.executable, "-c", RUN_PY], cwd=folder, env=env, check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(folder / "results.npz")


def test_get_batch_c_returns_its_status_codes(results):
    np.testing.assert_array_equal(results["rcs"], results["want"])


def test_get_batch_c_gathers_what_get_batch_gathers(results):
    np.testing.assert_array_equal(results["c_data"], results["p_data"])
    np.testing.assert_array_equal(results["c_lab"], results["p_lab"])
    # batch 2 of 2-shard batches: shards perm[4], perm[5], converted and scaled by 0.5
    perm = results["perm"]
    rows = np.concatenate([np.arange(2 * s, 2 * s + 2) for s in perm[4:6]])
    np.testing.assert_array_equal(results["c_data"], results["images"][rows] * np.float32(0.5))
    rows0 = np.concatenate([np.arange(2 * s, 2 * s + 2) for s in perm[0:2]])
    np.testing.assert_array_equal(results["raw"], results["images"][rows0])
    np.testing.assert_array_equal(results["lab0"][:, 0], results["classes"][rows0])


def test_cimported_class_index_cross_entropy_matches_one_hot(results):
    assert float(results["loss"]) == pytest.approx(float(results["loss_hot"]), rel=1e-6)
    np.testing.assert_allclose(results["grad"], results["grad_hot"], rtol=1e-6, atol=1e-9)
