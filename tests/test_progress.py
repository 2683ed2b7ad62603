"""progress_bar: the reference's line on a terminal (pty), final lines in a pipe."""
import os
import pty
import subprocess
import sys
import textwrap

import numpy as np

import ggmlopt as go
from ggmlopt.progress import format_hms, format_progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_format_matches_reference_printf():
    r = go.Result()
    for loss, nc in ((0.5, 400), (0.25, 450)):
        r._add(500, np.float32(loss), True, 1, None, nc)
    line = format_progress(True, 500, r, 3, 8, 0, now_us=1_500_000)
    loss, unc = r.loss()
    acc, acc_unc = r.accuracy()
    expected = ("train: [\u2588\u2588\u2589     ] data=0001500/0004000 "
                f"loss={loss:.5f}\u00b1{unc:.5f} acc={100 * acc:.2f}\u00b1{100 * acc_unc:.2f}% t=00:00:01 ETA=00:00:02 ")
    assert line == expected
    assert "loss=0.37500\u00b10.12500 acc=85.00\u00b11.13%" in line


def test_format_empty_phase_and_nan():
    line = format_progress(False, 10, go.Result(), 8, 8, 0, now_us=3_725_000_000)
    # at ibatch == ibatch_max the reference leaves the last cell 7/8 filled
    # an empty Result says so instead of ggml's loss=0.00000 (read as a perfect loss)
    assert line == ("val:   [\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u2589] data=0000080/0000080 "
                    "no batches t=01:02:05 ETA=00:00:00 ")


def test_format_without_a_result():
    line = format_progress(True, 4, None, 2, 4, 0, now_us=0)
    assert "data=0000008/0000016 no result t=" in line and "loss=" not in line


def test_format_nan_loss_of_a_result():
    r = go.Result()
    r._check(2, True, 1)
    r._add(2, np.float32(np.nan), True, 1, None, None)
    line = format_progress(False, 2, r, 1, 1, 0, now_us=0)
    assert "loss=nan\u00b1nan acc=nan\u00b1nan%" in line


def test_bar_fill_levels():
    cells = [format_progress(True, 1, None, i, 64, 0, now_us=0)[8:16] for i in range(1, 65)]
    assert cells[0] == " " * 8  # strict '<' in the reference: one step behind
    assert cells[1] == "\u258F" + " " * 7
    assert cells[7] == "\u2589" + " " * 7
    assert cells[8] == "\u2588" + " " * 7
    assert cells[63] == "\u2588" * 7 + "\u2589"
    assert format_hms(3_599_999_999) == "00:59:59"


SCRIPT = textwrap.dedent("""
    import numpy as np, ggmlopt as go
    x = np.zeros((40, 2), np.float32); y = np.zeros((40, 2), np.float32); y[:, 0] = 1
    ds = go.Dataset.from_arrays(x, y)
    model = go.nn.Sequential(go.nn.Linear(2, 2, rng=0))
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=2, loss_type=go.LossType.CROSS_ENTROPY)
    go.epoch(ctx, ds, go.Result(), go.Result(), 20, go.progress_bar, go.progress_bar)
""")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_terminal_gets_carriage_return_updates():
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.DEVNULL,
                            stderr=slave, cwd=ROOT, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode()
    assert out.count("train: [") == 2 and out.count("val:   [") == 2  # every batch
    assert "data=0000010/0000020" in out
    # the last line of each phase ends with " \r" and a newline (the pty maps \n to \r\n)
    assert out.count(" \r\r\n") == 2 or out.count(" \r\n") == 2
    assert "[\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u2589]" in out


def test_pipe_gets_one_final_line_per_phase():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, cwd=ROOT, check=False,
                          env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    lines = err.splitlines()
    assert "\r" not in err
    assert len(lines) == 2
    assert lines[0].startswith("train: [\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u2589] "
                               "data=0000020/0000020 loss=")
    assert lines[1].startswith("val:   [\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u2589] "
                               "data=0000020/0000020 loss=")
