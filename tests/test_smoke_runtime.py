"""The run-time surface: SIMD paths, threads, the header."""
import os

import pytest

import ggmlopt
from ggmlopt import kernels


def test_simd_info_lists_scalar_and_an_active_path():
    info = ggmlopt.simd_info()
    assert "scalar" in info["compiled"]
    assert info["active"] in info["compiled"]


def test_use_simd_pins_and_restores():
    before = kernels.use_simd("scalar")
    try:
        assert ggmlopt.simd_info()["active"] == "scalar"
    finally:
        kernels.use_simd(before)
    assert ggmlopt.simd_info()["active"] == before


def test_unknown_path_is_a_value_error():
    with pytest.raises(ValueError, match="unknown"):
        kernels.use_simd("sse9")


def test_threads_round_trip():
    n = ggmlopt.get_num_threads()
    ggmlopt.set_num_threads(1)
    assert ggmlopt.get_num_threads() == 1
    ggmlopt.set_num_threads(n)
    assert ggmlopt.get_num_threads() == n
    with pytest.raises(ValueError):
        ggmlopt.set_num_threads(0)


def test_header_is_shipped():
    assert os.path.isfile(os.path.join(ggmlopt.get_include(), "ggmlopt.h"))
