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
