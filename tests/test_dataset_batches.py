"""get_batch gathers whole shards in permuted order; shuffle permutes shards."""
import numpy as np
import pytest

import ggmlopt as go

NDATA = 60            # a multiple of every ndata_shard from 1 to 6
NE = 3
NE_LABEL = 2

# (storage dtype, batch dtype, data_scale): plain copies and the converting paths
STORAGE_TO_BATCH = [
    (np.float32, np.float32, None),
    (np.int32, np.int32, None),
    (np.uint8, np.uint8, None),
    (np.float16, np.float16, None),
    (np.uint8, np.float32, 0.5),
    (np.float16, np.float32, 0.25),
]


def identified_dataset(ndata_shard, data_dtype, label_dtype, data_scale=None):
    """Datapoint i holds i*NE + [0, NE) and labels -(i + 1) * [1, 1000]: every row says
    which datapoint it came from."""
    ds = go.Dataset(NE, NE_LABEL, NDATA, ndata_shard, data_dtype=data_dtype,
                    label_dtype=label_dtype, data_scale=data_scale)
    ds.data[:] = np.arange(NDATA * NE).reshape(NDATA, NE)
    ds.labels[:] = -(np.arange(NDATA)[:, None] + 1) * np.array([1, 1000])
    return ds


def check_batches(ds, batch_size, batch_dtype, scale, shuffled):
    s = ds.ndata_shard
    spb = batch_size // s
    nbatches = ds.nshards // spb
    seen = []
    perm = ds.permutation
    for ibatch in range(nbatches):
        data_batch = np.full((batch_size, NE), 99, batch_dtype)
        labels_batch = np.full(batch_size * NE_LABEL, 7, ds.label_dtype)   # any shape
        ds.get_batch(data_batch, labels_batch, ibatch)
        labels_batch = labels_batch.reshape(batch_size, NE_LABEL)
        # the source datapoint of each row, from its first value
        first = data_batch[:, 0].astype(np.float64) / (scale or 1.0)
        src = (first // NE).astype(np.int64)
        expected_rows = np.arange(NDATA * NE).reshape(NDATA, NE)[src] * (scale or 1.0)
        np.testing.assert_array_equal(data_batch.astype(np.float64), expected_rows)
        np.testing.assert_array_equal(labels_batch, -(src[:, None] + 1) * np.array([1, 1000]))
        # slot j holds shard perm[ibatch * spb + j], its datapoints in order
        shards = perm[ibatch * spb:(ibatch + 1) * spb]
        np.testing.assert_array_equal(src, (shards[:, None] * s + np.arange(s)).ravel())
        seen.append(src)
    seen = np.concatenate(seen)
    covered = nbatches * spb * s
    # every datapoint of the covered shards exactly once
    np.testing.assert_array_equal(np.sort(seen),
                                  np.sort((perm[:nbatches * spb, None] * s + np.arange(s)).ravel()))
    assert len(np.unique(seen)) == covered
    if not shuffled:
        np.testing.assert_array_equal(seen, np.arange(covered))
    return seen


@pytest.mark.parametrize("ndata_shard", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("storage, batch_dtype, scale", STORAGE_TO_BATCH)
@pytest.mark.parametrize("shuffled", [False, True])
def test_every_batch_size_gathers_whole_shards(ndata_shard, storage, batch_dtype, scale,
                                               shuffled):
    label_dtype = np.int32 if storage == np.int32 else np.float32
    ds = identified_dataset(ndata_shard, storage, label_dtype, scale)
    if shuffled:
        ds.shuffle(ndata_shard * 17)
        assert not np.array_equal(ds.permutation, np.arange(ds.nshards))
    for batch_size in range(ndata_shard, NDATA + 1, ndata_shard):
        check_batches(ds, batch_size, batch_dtype, scale, shuffled)


def test_batch_arrays_of_any_contiguous_shape():
    ds = identified_dataset(2, np.float32, np.float32)
    ref_d = np.zeros((4, NE), np.float32)
    ref_l = np.zeros((4, NE_LABEL), np.float32)
    ds.get_batch(ref_d, ref_l, 3)
    for dshape, lshape in [((4 * NE,), (8,)), ((2, 2, NE), (1, 8)), ((NE, 4), (2, 2, 2)),
                           ((1, 12, 1), (8, 1))]:
        d = np.zeros(dshape, np.float32)
        lab = np.zeros(lshape, np.float32)
        ds.get_batch(d, lab, 3)
        np.testing.assert_array_equal(d.ravel(), ref_d.ravel())
        np.testing.assert_array_equal(lab.ravel(), ref_l.ravel())


def test_unaligned_batch_memory():
    ds = identified_dataset(3, np.uint8, np.float32, 2.0)
    raw = np.zeros(6 * NE * 4 + 4, np.uint8)
    d = raw[1:1 + 6 * NE * 4].view(np.float32)      # float32 at an odd address
    ds.get_batch(d, np.zeros(6 * NE_LABEL, np.float32), 1)
    np.testing.assert_array_equal(d, 2.0 * np.arange(6 * NE, 12 * NE))


def test_dataset_without_labels():
    ds = go.Dataset(5, 0, 20, 4, data_dtype=np.int32)
    ds.data[:] = np.arange(100).reshape(20, 5)
    ds.shuffle(3)
    perm = ds.permutation
    b = np.zeros((8, 5), np.int32)
    ds.get_batch(b, None, 1)
    rows = (perm[2:4, None] * 4 + np.arange(4)).ravel()
    np.testing.assert_array_equal(b, ds.data[rows])


def test_large_batch_uses_the_threaded_gather():
    # 3 MB of float32 output: above the size where the gather kernel splits work
    rng = np.random.default_rng(0)
    ds = go.Dataset.from_arrays(rng.integers(0, 256, (2000, 500), dtype=np.uint8),
                                rng.random((2000, 3), dtype=np.float32), ndata_shard=5,
                                data_scale=1 / 255)
    ds.shuffle(rng)
    threads = go.get_num_threads()
    go.set_num_threads(2)
    try:
        b = np.empty((1500, 500), np.float32)
        lab = np.empty((1500, 3), np.float32)
        ds.get_batch(b, lab, 0)
    finally:
        go.set_num_threads(threads)
    rows = (ds.permutation[:300, None] * 5 + np.arange(5)).ravel()
    np.testing.assert_array_equal(b, ds.data[rows].astype(np.float32) * np.float32(1 / 255))
    np.testing.assert_array_equal(lab, ds.labels[rows])


# ---- shuffle ------------------------------------------------------------------------

def test_same_seed_same_permutation_and_different_seeds_differ():
    a, b, c = (go.Dataset(1, 0, 6000) for _ in range(3))
    a.shuffle(42)
    b.shuffle(42)
    c.shuffle(43)
    np.testing.assert_array_equal(a.permutation, b.permutation)
    assert not np.array_equal(a.permutation, c.permutation)
    np.testing.assert_array_equal(np.sort(a.permutation), np.arange(6000))


def test_shuffle_is_the_documented_generator_call():
    ds = go.Dataset(2, 1, 40, 4)
    ds.shuffle(np.random.default_rng(9))
    expected = np.arange(10)
    np.random.default_rng(9).shuffle(expected)
    np.testing.assert_array_equal(ds.permutation, expected)
    ds.shuffle(9, idata=20)                  # then permutes the current order's head
    head = expected[:5].copy()
    np.random.default_rng(9).shuffle(head)
    np.testing.assert_array_equal(ds.permutation, np.concatenate([head, expected[5:]]))


def test_a_generator_advances_across_shuffles():
    rng = np.random.default_rng(1)
    ds = go.Dataset(1, 0, 100)
    ds.shuffle(rng)
    first = ds.permutation
    ds.shuffle(rng)
    assert not np.array_equal(ds.permutation, first)


def test_context_like_object_supplies_its_rng():
    class Ctx:
        def __init__(self, seed):
            self.rng = np.random.default_rng(seed)

    ctx = Ctx(5)
    a = go.Dataset(1, 0, 50, 5)
    a.shuffle(ctx)
    b = go.Dataset(1, 0, 50, 5)
    b.shuffle(5)
    np.testing.assert_array_equal(a.permutation, b.permutation)
    a.shuffle(ctx)                           # ctx.rng moved on
    b.shuffle(Ctx(5))
    assert not np.array_equal(a.permutation, b.permutation)


@pytest.mark.parametrize("ndata_shard", [1, 2, 3, 4, 5, 6])
def test_shuffle_with_idata_leaves_the_tail_untouched(ndata_shard):
    ds = go.Dataset(1, 1, 60 * ndata_shard, ndata_shard)
    ds.shuffle(0)                             # a non-trivial starting order
    for k in (0, 1, 7, 30, 59, 60):
        before = ds.permutation
        ds.shuffle(k + 100, idata=k * ndata_shard)
        after = ds.permutation
        np.testing.assert_array_equal(after[k:], before[k:])
        np.testing.assert_array_equal(np.sort(after[:k]), np.sort(before[:k]))
        if k >= 30:
            assert not np.array_equal(after[:k], before[:k])


def test_negative_idata_shuffles_everything():
    a, b = go.Dataset(1, 0, 30, 3), go.Dataset(1, 0, 30, 3)
    a.shuffle(4, idata=-1)
    b.shuffle(4, idata=-7)
    np.testing.assert_array_equal(a.permutation, b.permutation)
    assert not np.array_equal(a.permutation[5:], np.arange(5, 10))


def test_shuffle_moves_labels_with_their_data():
    ds = go.Dataset(4, 1, 24, 2, data_dtype=np.int32, label_dtype=np.int32)
    ds.data[:] = np.arange(24)[:, None] * 10 + np.arange(4)
    ds.labels[:] = np.arange(24)[:, None]
    ds.shuffle(11)
    b = np.zeros((24, 4), np.int32)
    lab = np.zeros((24, 1), np.int32)
    ds.get_batch(b, lab, 0)
    np.testing.assert_array_equal(b[:, 0] // 10, lab[:, 0])
    assert not np.array_equal(lab[:, 0], np.arange(24))
    np.testing.assert_array_equal(np.sort(lab[:, 0]), np.arange(24))
