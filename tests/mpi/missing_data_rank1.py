"""Runs python -m ggmlopt.finetune with rank 1's --data a file its host lacks:
rank 1 refuses its input while the others go on into fit."""
import sys

from ggmlopt import finetune

if __name__ == "__main__":
    from mpi4py import MPI
    argv = sys.argv[1:]
    if MPI.COMM_WORLD.Get_rank() == 1:
        argv[argv.index("--data") + 1] = "/nonexistent/train.jsonl"
    sys.exit(finetune.main(argv))
