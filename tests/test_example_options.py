"""The mnist example checks --save, --plot and --load before any work, and --load
takes the model from the file."""
import os
import sys

import numpy as np
import pytest

from ggmlopt.examples import mnist
from ggmlopt.nn import Linear, Sequential


@pytest.fixture
def no_work(monkeypatch):
    """Loading data or training fails the test: the checks must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the example started working before checking its options")

    for name in ("digits_as_mnist", "synthetic"):
        monkeypatch.setattr(mnist, name, forbidden)
    monkeypatch.setattr(mnist.go, "fit", forbidden)


def _fails(argv, capsys, *messages):
    with pytest.raises(SystemExit) as info:
        mnist.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for message in messages:
        assert message in err, err


def test_bad_output_paths_stop_before_training(tmp_path, capsys, no_work):
    missing = tmp_path / "no" / "such"
    _fails(["--save", str(missing / "m.gguf")], capsys,
           f"--save: the folder {missing} does not exist")
    _fails(["--plot", str(missing / "c.png")], capsys,
           f"--plot: the folder {missing} does not exist")
    (tmp_path / "file").write_text("")
    _fails(["--save", str(tmp_path / "file" / "m.gguf")], capsys, "does not exist")
    _fails(["--save", str(tmp_path)], capsys, "is a directory")
    _fails(["--save", str(tmp_path / "m.txt")], capsys,
           "--save: expected a FILE.gguf (ggml's GGUF) or FILE.safetensors")
    _fails(["--save", str(tmp_path / "m.safetensors"), "--save-f16"], capsys,
           "--save-f16 goes with a .gguf file")
    # every problem at once
    _fails(["--save", str(missing / "m.txt"), "--plot", str(missing / "c.png")], capsys,
           "expected a FILE.gguf", "--save: the folder", "--plot: the folder")


def test_plot_format_is_checked_before_training(tmp_path, capsys, no_work):
    pytest.importorskip("matplotlib")
    _fails(["--plot", str(tmp_path / "curves.xyz")], capsys,
           "--plot: matplotlib does not write .xyz files")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_unwritable_folder_is_checked_before_training(tmp_path, capsys, no_work):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        _fails(["--save", str(folder / "m.gguf")], capsys, "is not writable")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize(("argv", "package", "extra"), [
    (["--save", "m.gguf"], "gguf", "interop"),
    (["--save", "m.safetensors"], "safetensors", "interop"),
    (["--plot", "c.png"], "matplotlib", "plot"),
])
def test_missing_packages_are_named_before_training(argv, package, extra, tmp_path, capsys,
                                                     monkeypatch, no_work):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    argv = [argv[0], str(tmp_path / argv[1])]
    _fails(argv, capsys, f"needs the '{package}' package: pip install ggmlopt[{extra}]")


# ---- --load picks the model from the file ------------------------------------------------

def _evaluate(model):
    _, test = mnist.digits_as_mnist(0)
    result = mnist.evaluate(model, test, 10)
    return result.loss()[0], result.accuracy()[0]


def _saved(tmp_path, name, how):
    """An untrained mnist-<name> (seed 5, not the example's seed 0) saved as how."""
    from ggmlopt.io import save_gguf, save_safetensors

    model = mnist.MODELS[name][0](5)
    path = tmp_path / f"{name}-{how}.{'safetensors' if how == 'safetensors' else 'gguf'}"
    if how == "ggml":
        pytest.importorskip("gguf")
        save_gguf(model, path, arch=mnist.GGML_ARCHS[name])
    elif how == "generic":
        pytest.importorskip("gguf")
        save_gguf(model, path)
    else:
        pytest.importorskip("safetensors")
        save_safetensors(model, path)
    return model, path


@pytest.mark.parametrize("how", ["ggml", "generic", "safetensors"])
@pytest.mark.parametrize("name", ["cnn", "fc"])
def test_load_without_model_takes_the_files_model(tmp_path, capsys, name, how):
    pytest.importorskip("sklearn")
    model, path = _saved(tmp_path, name, how)
    loss, acc = mnist.main(["--load", str(path)])
    out = capsys.readouterr().out
    assert f"loaded {mnist.GGML_ARCHS[name]} weights from {path}" in out
    expected = _evaluate(model)
    assert loss == pytest.approx(expected[0], rel=1e-5) and acc == expected[1]
    # naming the file's own model works as before
    assert mnist.main(["--load", str(path), "--model", name]) == pytest.approx((loss, acc))


def test_load_with_the_wrong_model_says_what_to_pass(tmp_path, capsys):
    _, path = _saved(tmp_path, "cnn", "ggml")
    _fails(["--load", str(path), "--model", "fc"], capsys,
           "holds mnist-cnn (general.architecture=mnist-cnn), not mnist-fc: pass --model cnn")


def test_load_of_another_model_says_what_to_pass(tmp_path, capsys):
    pytest.importorskip("gguf")
    from ggmlopt.io import save_gguf

    path = tmp_path / "other.gguf"
    save_gguf(Sequential(Linear(3, 2)), path)
    _fails(["--load", str(path)], capsys, "holds neither ggml's mnist-fc nor mnist-cnn",
           "pass --model fc or --model cnn")
    _fails(["--load", str(tmp_path / "absent.gguf")], capsys, "--load: no such file")
    (tmp_path / "m.pt").write_bytes(b"")
    _fails(["--load", str(tmp_path / "m.pt")], capsys, "expected a FILE.gguf or FILE.safetensors")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    _fails(["--load", str(tmp_path / "bad.gguf")], capsys, "--load: cannot read")


def test_save_safetensors_then_load(tmp_path, capsys):
    pytest.importorskip("safetensors")
    pytest.importorskip("sklearn")
    path = tmp_path / "model.safetensors"
    trained = mnist.main(["--epochs", "1", "--silent", "--save", str(path)])
    assert f"saved the model to {path} (mnist-fc, float32 weights)" in capsys.readouterr().out
    np.testing.assert_allclose(mnist.main(["--load", str(path)]), trained, rtol=1e-6)


def test_load_takes_no_training_batch_sizes(tmp_path, capsys):
    """--load trains nothing: a --nbatch-logical fit would refuse is not checked."""
    pytest.importorskip("sklearn")
    model, path = _saved(tmp_path, "fc", "generic")
    loss, acc = mnist.main(["--load", str(path), "--nbatch-logical", "70"])
    assert (loss, acc) == pytest.approx(_evaluate(model), rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-3"], "--epochs: expected an integer >= 1, got -3"),
    (["--epochs", "0"], "--epochs: expected an integer >= 1, got 0"),
    (["--nbatch-logical", "0"], "--nbatch-logical: expected an integer >= 1"),
    (["--nbatch-physical", "-5"], "--nbatch-physical: expected an integer >= 1"),
    (["--seed", "-1"], "--seed: expected an integer >= 0"),
    (["--threads", "0"], "--threads: expected an integer >= 1"),
    (["--shard-optimizer"], "--shard-optimizer shards over the processes of --mpi"),
    (["--plot", "curves"], "--plot: give the image format by the file's suffix"),
])
def test_bad_values_exit_2_with_a_message_before_any_work(argv, message, capsys, no_work):
    """(tracebacks with status 1 before: a ZeroDivisionError, numpy's seed error;
    --plot curves wrote curves.png and said it wrote curves)"""
    _fails(argv, capsys, message)


def test_a_data_folder_it_cannot_read_is_said_by_name(tmp_path, capsys):
    _fails(["--data", str(tmp_path / "none")], capsys, "--data:")
    _fails(["--data", str(tmp_path)], capsys, "--data:")


def test_the_offline_test_images_do_not_depend_on_the_seed(monkeypatch):
    """A model trained with --seed 1 and loaded with the default seed was tested
    on 251 images it trained on (100% accuracy): the split is fixed."""
    seen = []

    class Stop(Exception):
        pass

    def digits(seed):
        seen.append(seed)
        raise Stop
    monkeypatch.setattr(mnist, "digits_as_mnist", digits)
    for seed in ("0", "7"):
        with pytest.raises(Stop):
            mnist.main(["--seed", seed, "--silent"])
    assert seen == [mnist.SPLIT_SEED] * 2


def test_python_m_ggmlopt_help_is_help():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "ggmlopt", "--help"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0 and "python -m ggmlopt finetune" in done.stdout
