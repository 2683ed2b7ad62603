"""ggmlopt._pool_linger: holds of the kernel threads' linger from any thread in
any order; the longest held is in force, the setting before the first comes
back after the last (a decode step in a thread while another trains, two
threads decoding)."""
from ggmlopt import _pool_linger, kernels


def test_interleaved_holds_put_back_the_setting_before_the_first():
    before = kernels.set_pool_linger(0.0125)
    try:
        _pool_linger.hold(0.002)
        assert kernels.set_pool_linger(0.002) == 0.002   # (reading it sets it again)
        _pool_linger.hold(0.05)
        assert kernels.set_pool_linger(0.05) == 0.05     # the longest held
        _pool_linger.release(0.002)                      # the first to come, leaving first
        assert kernels.set_pool_linger(0.05) == 0.05
        _pool_linger.hold(0.002)
        _pool_linger.release(0.05)
        assert kernels.set_pool_linger(0.002) == 0.002
        _pool_linger.release(0.002)
        assert kernels.set_pool_linger(before) == 0.0125
    finally:
        kernels.set_pool_linger(before)
