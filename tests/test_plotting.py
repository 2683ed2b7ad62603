"""History.to_dict and History.plot: columns for pandas, a PNG drawn headless."""
import math
import subprocess
import sys

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.training import EpochStats, History

NAN = math.nan


def history(n=4, validation=True):
    return History([EpochStats(i, 1 / i, 0.1 / i, 0.5 + 0.1 * i, 0.01,
                               1.2 / i if validation else NAN, 0.2 / i if validation else NAN,
                               0.4 + 0.1 * i if validation else NAN, 0.02 if validation else NAN,
                               0.5 * i) for i in range(1, n + 1)])


def test_to_dict_columns():
    h = history(3)
    d = h.to_dict()
    assert list(d) == ["epoch", "train_loss", "train_loss_unc", "train_accuracy",
                       "train_accuracy_unc", "val_loss", "val_loss_unc", "val_accuracy",
                       "val_accuracy_unc", "seconds", "blas_threads", "exchange_wait_s"]
    assert d["epoch"] == [1, 2, 3]
    assert d["train_loss"] == h.train_loss == [1.0, 0.5, 1 / 3]
    assert d["seconds"] == [0.5, 1.0, 1.5]
    assert all(len(v) == 3 for v in d.values())
    d["epoch"].append(9)  # a copy: the history is untouched
    assert len(h) == 3 and h.to_dict()["epoch"] == [1, 2, 3]
    assert History().to_dict()["val_loss"] == []


def test_to_dict_makes_a_dataframe():
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(history(5).to_dict())
    assert df.shape == (5, 10)
    assert df["val_accuracy"].iloc[-1] == pytest.approx(0.9)


def test_fit_history_to_dict():
    rng = np.random.default_rng(0)
    x = rng.random((40, 3), np.float32)
    y = np.eye(2, dtype=np.float32)[(x[:, 0] > 0.5).astype(int)]
    ds = go.Dataset.from_arrays(x, y)
    m = go.nn.Sequential(go.nn.Linear(3, 2, rng=0))
    h = go.fit(m, ds, go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=10, val_split=0.25,
               silent=True, seed=0)
    d = h.to_dict()
    assert d["epoch"] == [1, 2]
    assert d["val_accuracy"] == h.val_accuracy and not math.isnan(d["val_loss"][1])


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("validation", [True, False])
def test_plot_writes_a_png_of_the_expected_size(tmp_path, validation):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "curves.png"
    fig = history(5, validation).plot(path)
    assert png_size(path) == (1000, 400)
    image = imread(path)
    assert image.shape[:2] == (400, 1000)
    assert image.std() > 0.05  # something is drawn
    loss_ax, acc_ax = fig.axes
    assert loss_ax.get_xlabel() == "epoch" and acc_ax.get_ylabel() == "accuracy (%)"
    lines = [line.get_label() for line in loss_ax.get_lines()]
    assert lines == (["training", "validation"] if validation else ["training"])
    np.testing.assert_allclose(acc_ax.get_lines()[0].get_ydata(), [60, 70, 80, 90, 100])
    assert len(loss_ax.collections) == len(lines)  # one band per curve

    small = tmp_path / "small.png"
    history(2).plot(small, figsize=(3, 2), dpi=50)
    assert png_size(small) == (150, 100)


def test_plot_without_path_returns_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    fig = history(1).plot()
    assert fig.get_size_inches().tolist() == [10.0, 4.0]
    fig.savefig(tmp_path / "f.svg")
    assert (tmp_path / "f.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_plot_headless_in_a_fresh_process(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "h.png"
    code = ("import ggmlopt as go; h = go.History([go.EpochStats(1, 1, .1, .5, .01, 1, .1, .5, "
            f".01, 1.0)]); h.plot({str(out)!r}); import matplotlib; print(matplotlib.get_backend())")
    env = {"PATH": "/usr/bin:/bin", "MPLBACKEND": "", "DISPLAY": "",
           "PYTHONPATH": ":".join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert png_size(out) == (1000, 400)


def test_plot_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no epochs"):
        History().plot(tmp_path / "e.png")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        history().plot(tmp_path / "no" / "c.png")
    assert list(tmp_path.iterdir()) == []


def test_plot_import_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"History.plot needs the 'matplotlib' package.*"
                                          r"pip install ggmlopt\[plot\]"):
        history().plot(tmp_path / "c.png")
    assert list(tmp_path.iterdir()) == []
