"""Runs python -m ggmlopt.finetune with Ctrl-C reaching rank 1 only, as it
starts training: the other ranks are then in fit, waiting for it."""
import sys

import ggmlopt
from ggmlopt import finetune


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


if __name__ == "__main__":
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 1:
        ggmlopt.fit = _interrupted
    sys.exit(finetune.main(sys.argv[1:]))
