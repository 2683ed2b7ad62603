"""The C-level API: a separate Cython extension cimports ggmlopt.kernels, calls
the AdamW step and the cross-entropy kernel inside `with nogil:`, and gets the
same numbers as NumPy."""
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
# Takes C-contiguous float32 arrays only (RUN_PY makes them); nothing is checked here.
cimport numpy as cnp
from ggmlopt.kernels cimport adamw_step_f32, cross_entropy_f32

cnp.import_array()


cdef float *data(cnp.ndarray a):
    return <float *>cnp.PyArray_DATA(a)


def adamw(cnp.ndarray w, cnp.ndarray g, cnp.ndarray m, cnp.ndarray v, cnp.ndarray params):
    cdef long long n = w.size
    cdef float *pw = data(w)
    cdef float *pg = data(g)
    cdef float *pm = data(m)
    cdef float *pv = data(v)
    cdef float *pp = data(params)
    with nogil:
        adamw_step_f32(n, pw, pg, pm, pv, pp)


def cross_entropy(cnp.ndarray logits, cnp.ndarray labels, cnp.ndarray grad, float grad_scale):
    cdef long long rows = logits.shape[0], cols = logits.shape[1]
    cdef float *px = data(logits)
    cdef float *pl = data(labels)
    cdef float *pg = data(grad)
    cdef double loss
    with nogil:
        loss = cross_entropy_f32(rows, cols, px, pl, pg, grad_scale)
    return loss
"""

SETUP_PY = """\
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension("user_kernels", ["user_kernels.pyx"],
                include_dirs=[{include!r}, numpy.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=["-O0"] if {posix!r} else [])
setup(ext_modules=cythonize([ext], include_path=[{package_parent!r}], quiet=True))
"""

RUN_PY = """\
import numpy as np
import user_kernels
from ggmlopt import kernels

rng = np.random.default_rng(5)
n = 1001
w = rng.standard_normal(n).astype(np.float32)
w0 = w.copy()
g = rng.standard_normal(n).astype(np.float32)
m = np.zeros(n, np.float32)
v = np.zeros(n, np.float32)
b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, 1)
params = np.array([1e-2, 0.9, 0.999, 1e-8, 0.1, b1h, b2h], np.float32)
user_kernels.adamw(w, g, m, v, params)

logits = rng.standard_normal((7, 17)).astype(np.float32)
labels = rng.random((7, 17)).astype(np.float32)
labels /= labels.sum(axis=1, keepdims=True)
grad = np.zeros_like(logits)
loss = user_kernels.cross_entropy(logits, labels, grad, 2.0)
np.savez("results.npz", w0=w0, g=g, w=w, m=m, v=v, params=params, logits=logits,
         labels=labels, grad=grad, loss=loss)
"""


def c_compiler():
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(cc[0]) if cc else None


@pytest.fixture(scope="module")
def built_extension(tmp_path_factory, package_parent):
    if not c_compiler():
        pytest.skip("no C compiler available to build a Cython extension against ggmlopt")
    folder = tmp_path_factory.mktemp("cimport_user")
    (folder / "user_kernels.pyx").write_text(USER_PYX)
    (folder / "setup.py").write_text(SETUP_PY.format(include=ggmlopt.get_include(),
                                                     package_parent=package_parent,
                                                     posix=os.name == "posix"))
    env = dict(os.environ)
    env["PYTHONPATH"] = package_parent
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=folder,
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


def test_extension_builds_against_the_package(built_extension):
    assert any(p.name.startswith("user_kernels") and p.suffix in (".so", ".pyd")
               for p in built_extension.iterdir())


def test_cimported_kernels_run_without_the_gil_and_match_numpy(built_extension,
                                                              package_parent):
    env = dict(os.environ)
    env.pop("GGMLOPT_SIMD", None)
    env["PYTHONPATH"] = os.pathsep.join([str(built_extension), package_parent])
    proc = subprocess.run([sys.executable, "-c", RUN_PY], cwd=built_extension, env=env,
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = np.load(built_extension / "results.npz")

    # AdamW, t = 1, in float64
    alpha, beta1, beta2, eps, wd, b1h, b2h = (float(p) for p in r["params"])
    g = r["g"].astype(np.float64)
    m = (1 - beta1) * g
    v = (1 - beta2) * g * g
    w = r["w0"] * (1 - alpha * wd) - alpha * (m * b1h) / (np.sqrt(v * b2h) + eps)
    np.testing.assert_allclose(r["m"], m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r["v"], v, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(r["w"], w, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(r["w"], r["w0"])

    # cross-entropy with its gradient, grad_scale 2
    x = r["logits"].astype(np.float64)
    lab = r["labels"].astype(np.float64)
    log_p = x - x.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    rows = x.shape[0]
    assert float(r["loss"]) == pytest.approx(-(lab * log_p).sum() / rows, rel=1e-6)
    np.testing.assert_allclose(r["grad"], (np.exp(log_p) - lab) * 2.0 / rows,
                               rtol=1e-4, atol=1e-7)
