"""Dataset.from_tokens: llama.cpp's next-token windows (common_opt_dataset_init)
from any integer corpus, memory-mapped files included, with clear errors."""
import numpy as np
import pytest

import ggmlopt as go


def llama_cpp_windows(tokens, n_ctx, stride):
    """common_opt_dataset_init, transcribed: ndata = (size - n_ctx - 1) / stride,
    datapoint i = tokens[i*stride ..][:n_ctx], labels one token later."""
    ndata = (len(tokens) - n_ctx - 1) // stride
    data = np.zeros((ndata, n_ctx), np.int32)
    labels = np.zeros((ndata, n_ctx), np.int32)
    for i in range(ndata):
        data[i] = tokens[i * stride: i * stride + n_ctx]
        labels[i] = tokens[i * stride + 1: i * stride + 1 + n_ctx]
    return data, labels


@pytest.mark.parametrize("ntokens,n_ctx,stride", [
    (100, 8, None), (100, 8, 1), (100, 8, 8), (100, 7, 3), (1000, 64, 17), (12, 1, None),
    (13, 5, 7), (2000, 129, 64),
])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64, np.uint8])
def test_windows_equal_llama_cpp(ntokens, n_ctx, stride, dtype):
    rng = np.random.default_rng(ntokens + n_ctx)
    tokens = rng.integers(0, np.iinfo(dtype).max if dtype == np.uint8 else 50000,
                          ntokens).astype(dtype)
    ds = go.Dataset.from_tokens(tokens, n_ctx, stride)
    step = stride if stride is not None else max(n_ctx // 2, 1)
    want_data, want_labels = llama_cpp_windows(tokens.astype(np.int64), n_ctx, step)
    assert ds.ndata == (ntokens - n_ctx - 1) // step and ds.ndata_shard == 1
    assert ds.data.dtype == ds.labels.dtype == np.int32
    np.testing.assert_array_equal(ds.data, want_data)
    np.testing.assert_array_equal(ds.labels, want_labels)


def test_a_memory_mapped_corpus_as_nanogpt_writes_it(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 10_000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    corpus = np.memmap(path, dtype=np.uint16, mode="r")
    ds = go.Dataset.from_tokens(corpus, 256, 128)
    want_data, want_labels = llama_cpp_windows(tokens, 256, 128)
    np.testing.assert_array_equal(ds.data, want_data)
    np.testing.assert_array_equal(ds.labels, want_labels)
    del corpus


def test_too_few_tokens_say_how_many_are_needed():
    with pytest.raises(ValueError, match=r"needs at least 13 tokens"):
        go.Dataset.from_tokens(np.arange(12), 8)       # 8 + 1 + stride 4
    assert go.Dataset.from_tokens(np.arange(13), 8).ndata == 1
    with pytest.raises(ValueError, match="make no window"):
        go.Dataset.from_tokens(np.arange(3), 8)


@pytest.mark.parametrize("tokens,n_ctx,stride,exc,match", [
    ([1, 2, 3] * 10, 4, None, TypeError, "tokens: expected a 1-D numpy.ndarray"),
    (np.zeros(30, np.float32), 4, None, TypeError, "expected integer token ids"),
    (np.zeros((5, 6), np.int32), 4, None, ValueError, r"expected shape \(ntokens,\)"),
    (np.arange(30), 0, None, ValueError, "n_ctx"),
    (np.arange(30), 4, 0, ValueError, "stride"),
    (np.arange(30) - 1, 4, None, ValueError, r"token ids must lie in \[0, "),
    (np.arange(30, dtype=np.uint32) + 2**31, 4, None, ValueError, "token ids must lie"),
])
def test_bad_input_is_refused(tokens, n_ctx, stride, exc, match):
    with pytest.raises(exc, match=match):
        go.Dataset.from_tokens(tokens, n_ctx, stride)


def test_batches_come_with_their_next_token_labels():
    tokens = np.arange(50, dtype=np.int32)
    ds = go.Dataset.from_tokens(tokens, 6, 3)
    ds.shuffle(0)
    x = np.zeros((4, 6), np.int32)
    y = np.zeros((4, 6), np.int32)
    ds.get_batch(x, y, 1)
    np.testing.assert_array_equal(y, x + 1)   # with ids = positions, labels are one later
