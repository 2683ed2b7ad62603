"""Dataset.get_batch and Dataset.shuffle against the NumPy a user would write.

Targets (from the issue): get_batch of 500 datapoints of 784 float32 with
ndata_shard 10 from a 60,000-datapoint dataset reaches at least 0.8x the
throughput of one contiguous np.copyto of the same bytes (ratio <= 1.25) and is
never slower than np.take(data, rows, axis=0, out=batch); the uint8 -> float32
path takes at most 1.5x the float32 path; shuffle of 6,000 shards under 0.2 ms.
"""
import numpy as np
import pytest
from conftest import measure

import ggmlopt as go

NDATA, NE, NLABEL, SHARD, BATCH = 60_000, 784, 10, 10, 500


@pytest.fixture(scope="module")
def datasets():
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (NDATA, NE), dtype=np.uint8)
    labels = np.eye(NLABEL, dtype=np.float32)[rng.integers(0, NLABEL, NDATA)]
    f32 = go.Dataset.from_arrays(images.astype(np.float32) / 255, labels, ndata_shard=SHARD)
    u8 = go.Dataset.from_arrays(images, labels, ndata_shard=SHARD, data_scale=1 / 255)
    f32.shuffle(1)
    u8.shuffle(1)
    return {"f32": f32, "u8": u8}


def batches(ds):
    """A get_batch call walking through the epoch, as training does."""
    data = np.empty((BATCH, NE), np.float32)
    labels = np.empty((BATCH, NLABEL), np.float32)
    nbatches = NDATA // BATCH
    state = [0]

    def call():
        ds.get_batch(data, labels, state[0])
        state[0] = (state[0] + 1) % nbatches
    return call


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("side", ["ggmlopt", "copyto", "take"])
def test_get_batch_f32(benchmark, datasets, threads, nthreads, side):
    threads(nthreads)
    ds = datasets["f32"]
    nbytes = BATCH * (NE + NLABEL) * 4
    case = f"get_batch 500x784 f32, shard 10, {nthreads} thread{'s' if nthreads > 1 else ''}"
    if side == "ggmlopt":
        measure(benchmark, batches(ds), case=case, role="ggmlopt",
                label="Dataset.get_batch (data + labels)", items=BATCH, bytes_moved=2 * nbytes)
    elif side == "copyto":
        # one contiguous copy of the same number of bytes (data + labels), walking
        # through the dataset's memory as get_batch does, so neither side reads from
        # a cache-hot source
        flat = ds.data.reshape(-1)
        n = BATCH * (NE + NLABEL)
        dst = np.empty(n, np.float32)
        nbatches = flat.size // n
        state = [0]

        def copy():
            np.copyto(dst, flat[state[0] * n:(state[0] + 1) * n])
            state[0] = (state[0] + 1) % nbatches
        measure(benchmark, copy, case=case, role="baseline",
                label="np.copyto (same bytes, contiguous)", target=1.25, items=BATCH,
                bytes_moved=2 * nbytes)
    else:
        perm = ds.permutation
        data, labels = ds.data, ds.labels
        out_d = np.empty((BATCH, NE), np.float32)
        out_l = np.empty((BATCH, NLABEL), np.float32)
        state = [0]
        spb = BATCH // SHARD
        nbatches = NDATA // BATCH

        def take():
            shards = perm[state[0] * spb:(state[0] + 1) * spb]
            rows = (shards[:, None] * SHARD + np.arange(SHARD)).ravel()
            np.take(data, rows, axis=0, out=out_d)
            np.take(labels, rows, axis=0, out=out_l)
            state[0] = (state[0] + 1) % nbatches
        measure(benchmark, take, case=case, role="baseline",
                label="np.take(axis=0, out=) x2", target=1.0, items=BATCH,
                bytes_moved=2 * nbytes)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("side", ["u8", "f32"])
def test_get_batch_u8_to_f32(benchmark, datasets, threads, nthreads, side):
    threads(nthreads)
    case = f"get_batch 500x784 u8->f32 vs f32, {nthreads} thread{'s' if nthreads > 1 else ''}"
    if side == "u8":
        measure(benchmark, batches(datasets["u8"]), case=case, role="ggmlopt",
                label="get_batch, uint8 storage x 1/255", items=BATCH,
                bytes_moved=BATCH * (NE * 5 + NLABEL * 8))
    else:
        measure(benchmark, batches(datasets["f32"]), case=case, role="baseline",
                label="get_batch, float32 storage", target=1.5, items=BATCH,
                bytes_moved=BATCH * (NE + NLABEL) * 8)


@pytest.mark.parametrize("side", ["ggmlopt", "numpy"])
def test_shuffle_6000_shards(benchmark, side):
    case = "shuffle 6000 shards"
    rng = np.random.default_rng(3)
    if side == "ggmlopt":
        ds = go.Dataset(NE, 0, 60_000, SHARD, data_dtype=np.uint8)
        # target: 0.2 ms for 6000 shards
        measure(benchmark, lambda: ds.shuffle(rng), case=case, role="ggmlopt",
                label="Dataset.shuffle(rng)", items=6000, ns_per_item_max=0.2e6 / 6000)
    else:
        perm = np.arange(6000, dtype=np.int64)
        measure(benchmark, lambda: rng.shuffle(perm), case=case, role="reference",
                label="rng.shuffle(int64 array)", items=6000)
