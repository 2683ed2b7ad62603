"""A checkpoint resumes only what wrote it: its parameters by name (adapters over a
frozen base kept in its file's types have the same shapes on every projection, so
the shapes and the trainable split cannot tell q/v adapters from q/k ones), and
only whole (a corrupted central directory that hides the archive's last members,
fit.step among them, would read as an epoch's end)."""
import json
import struct
import warnings
import zipfile

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.checkpoint import load_state
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer


@pytest.fixture(scope="module")
def q8_base(tmp_path_factory):
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("base") / "q8.gguf"
    model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, max_seq_len=16),
                  seed=0)
    go.io.save_gguf(model, path, dtype="q8_0", tokenizer=ByteTokenizer())
    return path


def _adapted(path, targets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = go.io.load_gguf(path, keep_types=True)
    lora.apply(model, rank=4, targets=targets, seed=0)
    return model


def _data():
    ids = np.random.default_rng(1).integers(0, 257, size=25 * 16 + 1).astype(np.int32)
    return go.Dataset.from_tokens(ids, 16, stride=16)


def _fit(model, **kwargs):
    return go.fit(model, _data(), "cross_entropy", nbatch_logical=4, nbatch_physical=2,
                  seed=3, silent=True, **kwargs)


def test_adapters_on_other_layers_are_refused_by_name(q8_base, tmp_path):
    ck = tmp_path / "qv.npz"
    _fit(_adapted(q8_base, ("q_proj", "v_proj")), checkpoint=ck, nepoch=1)
    assert "layers.0.self_attn.v_proj.lora_a" in json.loads(load_state(ck)["trainable_names"])
    other = _adapted(q8_base, ("q_proj", "k_proj"))
    before = [p.data.copy() for p in other.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match=r"trainable_names.*'layers\.0\.self_attn\.v_proj\."
                                         r"lora_a', this model's is 'layers\.0\.self_attn\."
                                         r"k_proj\.lora_a'"):
        _fit(other, checkpoint=ck, resume=True, nepoch=2)
    for p, b in zip([p for p in other.parameters() if p.requires_grad], before):
        np.testing.assert_array_equal(p.data, b)   # nothing was loaded
    with pytest.raises(ValueError, match="trainable_names"):
        go.OptContext.load(ck, _adapted(q8_base, ("q_proj", "k_proj")))
    # the same adapters resume
    _fit(_adapted(q8_base, ("q_proj", "v_proj")), checkpoint=ck, resume=True, nepoch=2)


def _hide_members_after(path, name, out):
    """One bit of the central directory: the comment length of the record before
    name's grows, so a reader skips the records after it."""
    raw = bytearray(path.read_bytes())
    end = raw.rfind(b"PK\x05\x06")
    _, _, offset = struct.unpack("<HII", raw[end + 10:end + 20])
    pos, prev = offset, None
    while True:
        n_name, n_extra, n_comment = struct.unpack("<HHH", raw[pos + 28:pos + 34])
        if bytes(raw[pos + 46:pos + 46 + n_name]) == name:
            break
        prev, pos = pos, pos + 46 + n_name + n_extra + n_comment
    raw[prev + 33] ^= 0x10
    out.write_bytes(bytes(raw))


def test_a_directory_hiding_members_is_refused(tmp_path):
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=16),
                  seed=0)
    ck = tmp_path / "mid.npz"
    _fit(model, checkpoint=ck, max_steps=3, nepoch=None, checkpoint_every=1)
    assert load_state(ck)["fit.step"] > 0
    bad = tmp_path / "bad.npz"
    _hide_members_after(ck, b"fit.step.npy", bad)
    with zipfile.ZipFile(bad) as z:   # what the zip reader sees: fewer members
        assert "fit.step.npy" not in z.namelist()
    with pytest.raises(ValueError, match=r"truncated or corrupted: the archive lists \d+ "
                                         r"members, its end record counts \d+"):
        load_state(bad)


def test_an_unknown_compression_method_is_a_value_error(tmp_path):
    model = Llama(LlamaConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, max_seq_len=16),
                  seed=0)
    ck = tmp_path / "c.npz"
    _fit(model, checkpoint=ck, nepoch=1)
    raw = bytearray(ck.read_bytes())
    end = raw.rfind(b"PK\x05\x06")
    _, _, offset = struct.unpack("<HII", raw[end + 10:end + 20])
    raw[offset + 10] = 99    # the first member's method in the central directory
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_state(bad)


def _small_fit(tmp_path, **kwargs):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(24, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=24).astype(np.int32)
    ds = go.Dataset.from_arrays(x, y)
    model = go.nn.Sequential(go.nn.Linear(5, 3, rng=0))
    return go.fit(model, ds, "cross_entropy", nepoch=2, nbatch_logical=4, val_split=0.25,
                  seed=0, silent=True, checkpoint=tmp_path / "c.npz", **kwargs), ds, model


def test_run_info_refuses_another_run_by_key(tmp_path):
    # what fit cannot see (a file's digest, options outside the model's shapes)
    # the caller names, and a resume that differs in one of those keys is refused
    info = {"data": "3f2a", "lora_alpha": 16.0, "packing": False}
    _small_fit(tmp_path, run_info=info)
    assert json.loads(str(load_state(tmp_path / "c.npz")["fit.run_info"])) == info
    with pytest.raises(ValueError, match=r"fit.run_info: the checkpoint was made with "
                                         r"lora_alpha=16.0, this fit has lora_alpha=64.0"):
        _small_fit(tmp_path, resume=True, run_info={**info, "lora_alpha": 64.0})
    # the same values (and a key only one side has) resume
    history, *_ = _small_fit(tmp_path, resume=True, run_info={**info, "new": 1})
    assert len(history) == 2
    with pytest.raises(TypeError, match="run_info: 'x': expected a str, int, finite float"):
        _small_fit(tmp_path, run_info={"x": [1]})
    with pytest.raises(TypeError, match="run_info: expected a dict"):
        _small_fit(tmp_path, run_info=["x"])


def test_shuffle_false_keeps_the_dataset_s_order(tmp_path):
    # llama-finetune's epochs over a text's windows: in order, the last ones validate
    history, ds, _ = _small_fit(tmp_path, shuffle=False)
    np.testing.assert_array_equal(ds.permutation, np.arange(24))
    (tmp_path / "other").mkdir()
    _, ds2, _ = _small_fit(tmp_path / "other", shuffle=True)
    assert not np.array_equal(ds2.permutation, np.arange(24))
    # the validation part is the last windows, as they are: 4 of 6 logical batches of 4
    # train (ggml's rounding of val_split 0.25), the last 8 datapoints validate
    tail = go.evaluate(_small_fit(tmp_path, shuffle=False)[2],
                       (ds.data[16:], ds.labels[16:, 0]), "cross_entropy", batch_size=4)
    assert history.ndata_val == 8
    np.testing.assert_allclose(history[-1].val_loss, tail.loss()[0], rtol=1e-6)
    # a resume that would shuffle where the run did not is another run
    with pytest.raises(ValueError, match="fit.shuffle: the checkpoint was made with shuffle=0"):
        _small_fit(tmp_path, resume=True, shuffle=True)


def test_shuffle_train_keeps_the_last_datapoints_validating(tmp_path):
    # a validation set of its own appended to the training data (finetune --valid):
    # each epoch shuffles the training part only, never the whole dataset once
    history, ds, model = _small_fit(tmp_path, shuffle="train")
    np.testing.assert_array_equal(ds.permutation[16:], np.arange(16, 24))
    assert not np.array_equal(ds.permutation[:16], np.arange(16))
    tail = go.evaluate(model, (ds.data[16:], ds.labels[16:, 0]), "cross_entropy",
                       batch_size=4)
    np.testing.assert_allclose(history[-1].val_loss, tail.loss()[0], rtol=1e-6)
    # True takes its validation part from one shuffle of the whole dataset
    (tmp_path / "other").mkdir()
    _, shuffled, _ = _small_fit(tmp_path / "other", shuffle=True)
    assert not np.array_equal(np.sort(shuffled.permutation[16:]), np.arange(16, 24))
    # a resume that would shuffle otherwise is another run
    for other in (True, False):
        with pytest.raises(ValueError, match="fit.shuffle: the checkpoint was made with "
                                             "shuffle=2"):
            _small_fit(tmp_path, resume=True, shuffle=other)
    history, *_ = _small_fit(tmp_path, resume=True, shuffle="train")
    assert len(history) == 2
    with pytest.raises(ValueError, match="shuffle: expected True, False or 'train', got 'all'"):
        _small_fit(tmp_path / "other", shuffle="all")


def test_a_checkpoint_from_before_the_shuffle_entry_shuffled(tmp_path):
    # fit shuffled whenever nbatch_logical < ndata before shuffle= existed: such a
    # checkpoint resumes only a fit that shuffles
    from ggmlopt.checkpoint import save_state
    _small_fit(tmp_path)
    state = load_state(tmp_path / "c.npz")
    assert state.pop("fit.shuffle") == 1
    save_state(tmp_path / "c.npz", state)
    with pytest.raises(ValueError, match="fit.shuffle: the checkpoint was made with shuffle=1"):
        _small_fit(tmp_path, resume=True, shuffle=False)
    history, *_ = _small_fit(tmp_path, resume=True)
    assert len(history) == 2
