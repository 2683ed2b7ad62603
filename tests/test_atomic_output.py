"""Files written atomically (checkpoints and every exporter): names as long as
the file system takes, symbolic links written through, a path that is no regular
file refused rather than replaced, errors naming the path asked for."""
import os

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt._atomic import atomic_output
from ggmlopt.checkpoint import load_state


def _write(path, text="new"):
    with atomic_output(str(path)) as tmp, open(tmp, "w") as f:
        f.write(text)


@pytest.mark.parametrize("length", [1, 200, 237, 255])
def test_a_name_as_long_as_the_file_system_takes_is_written(tmp_path, length):
    """The temporary name is the target's plus 18 characters: past 237 it would
    pass the 255-byte limit, so a long name gets a short temporary one."""
    path = tmp_path / ("c" * length)
    _write(path)
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no leftover


def _context():
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=0))
    return model, go.OptContext(model, loss_type=go.LossType.MEAN_SQUARED_ERROR)


def test_a_checkpoint_of_a_long_name_saves_and_loads(tmp_path):
    path = tmp_path / ("k" * 250)
    _, ctx = _context()
    ctx.save(path)
    assert load_state(path)["format"] == "ggmlopt.OptContext"
    go.OptContext.load(path, _context()[0])


def test_a_symbolic_link_is_written_through(tmp_path):
    target = tmp_path / "real.npz"
    target.write_text("old")
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    _write(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_path_that_is_no_regular_file_is_refused_not_replaced(tmp_path):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match="exists and is no regular file"):
        _write(pipe)
    assert pipe.is_fifo()
    _, ctx = _context()
    with pytest.raises(ValueError, match="no regular file"):
        ctx.save(pipe)
    assert pipe.is_fifo()


def test_an_error_of_the_writing_names_the_path_asked_for(tmp_path):
    """A directory where no file can be made: the OSError names the path given,
    not the hidden temporary file."""
    path = "/proc/self/ggmlopt-cannot-be-here.npz"
    with pytest.raises(OSError) as info:
        _write(path)
    assert info.value.filename == path and ".tmp" not in str(info.value)


def _saved(tmp_path):
    path = tmp_path / "c.npz"
    _context()[1].save(path)
    return path


def test_a_flipped_encrypted_flag_is_a_corrupted_file(tmp_path):
    """One bit of a member's central-directory flags makes zipfile ask for a
    password (RuntimeError): for a checkpoint that is a corrupted file."""
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")
    raw[at + 8] |= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not a readable ggmlopt checkpoint"):
        load_state(path)


def test_a_member_name_listed_twice_is_a_corrupted_file(tmp_path):
    """A name corrupted into another's would hide one of the two entries."""
    import warnings
    import zipfile
    path = _saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        members = [(n, z.read(n)) for n in z.namelist()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # zipfile's "Duplicate name"
        with zipfile.ZipFile(path, "w") as z:
            for name, data in members + [members[-1]]:
                z.writestr(name, data)
    with pytest.raises(ValueError, match="member name twice"):
        load_state(path)


def test_a_directory_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_state(tmp_path)
    with pytest.raises(ValueError, match="is a directory"):
        go.OptContext.load(tmp_path, _context()[0])


def test_fit_checks_the_folder_a_linked_checkpoint_lands_in_before_training(tmp_path):
    """A checkpoint path that is a link into a folder that does not exist: refused
    before the first epoch (it failed after it)."""
    link = tmp_path / "ckpt.npz"
    link.symlink_to(tmp_path / "no" / "such" / "ckpt.npz")
    model = go.nn.Sequential(go.nn.Linear(3, 2, rng=0))
    rng = np.random.default_rng(0)
    ds = go.Dataset.from_arrays(rng.normal(size=(8, 3)).astype(np.float32),
                                rng.normal(size=(8, 2)).astype(np.float32))
    before = model[0].weight.data.copy()
    with pytest.raises(ValueError, match="does not exist"):
        go.fit(model, ds, go.LossType.MEAN_SQUARED_ERROR, nbatch_logical=4, silent=True,
               checkpoint=link)
    np.testing.assert_array_equal(model[0].weight.data, before)
