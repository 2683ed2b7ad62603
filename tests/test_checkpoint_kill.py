"""A writer killed (SIGKILL) at random moments while saving checkpoints in a loop
leaves a file that loads and is one of the complete checkpoints it wrote."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ggmlopt as go

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Checkpoint k has every parameter, gradient and moment equal to k and iter == k, so a
# mix of two checkpoints, or a partly written one, is easy to see.
WRITER = textwrap.dedent("""
    import sys
    import ggmlopt as go
    path, first = sys.argv[1], int(sys.argv[2])
    ctx = go.OptContext(go.nn.Sequential(go.nn.Linear(600, 400), go.nn.ReLU(),
                                         go.nn.Linear(400, 10)))
    k = first
    while True:
        for section in ("weights", "grads", "m", "v"):
            ctx.arena.flat(section)[:] = k
        ctx.iter = k
        ctx.save(path)
        if k == first:
            print("saved", flush=True)
        k += 1
""")


def check_complete(path):
    sd = go.checkpoint.load_state(path)
    k = sd["iter"]
    for key, value in sd.items():
        if isinstance(value, np.ndarray) and value.dtype == np.float32:
            assert np.all(value == k), f"{key} is not from checkpoint {k}"
    ctx = go.OptContext.load(path, go.nn.Sequential(go.nn.Linear(600, 400), go.nn.ReLU(),
                                                    go.nn.Linear(400, 10)))
    assert ctx.iter == k and np.all(ctx.parameters()[0].data == k)
    return k


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_killed_writer_leaves_a_complete_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.npz")
    rng = np.random.default_rng(1)
    first = 1
    seen = []
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(first)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "saved", proc.stderr.read()
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the middle of a later save
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        k = check_complete(path)
        assert k >= first  # at least the first save of this writer went through
        seen.append(k)
        first = k + 1000  # the next writer's checkpoints are told apart from this one's
    # every kill left the newest or the one before it, never an older one
    assert seen == sorted(seen)
    # the only other files are the killed writers' temporaries, never the checkpoint name
    for name in os.listdir(tmp_path):
        assert name == "ckpt.npz" or (name.startswith(".ckpt.npz.") and name.endswith(".tmp"))
