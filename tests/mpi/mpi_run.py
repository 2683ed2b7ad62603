"""Running a worker script under mpiexec for the MPI tests: where the tree and
mpiexec are, the skip marker when MPI is missing, and one run that returns what
every rank saved."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
MPIEXEC = shutil.which("mpiexec")
try:
    import mpi4py
except ImportError:
    mpi4py = None
requires_mpi = pytest.mark.skipif(
    MPIEXEC is None or mpi4py is None,
    reason="MPI tests need mpi4py and mpiexec: pip install -e '.[mpi]'")


def run_ranks(worker, nranks, out, args, timeout):
    """``mpiexec -n nranks python -m mpi4py worker *args`` with one thread per rank
    (a subprocess with a timeout, so a hang fails instead of blocking); each rank
    saves ``rank{r}.npz`` into the folder out.  Returns each rank's arrays."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS, os.environ.get("PYTHONPATH", "")]), OPENBLAS_NUM_THREADS="1",
        GGMLOPT_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(nranks), sys.executable, "-m", "mpi4py", worker, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hangs (no answer in {timeout} s): {e.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    ranks = []
    for r in range(nranks):
        with np.load(out / f"rank{r}.npz") as f:
            ranks.append({k: f[k] for k in f.files})
    return ranks
