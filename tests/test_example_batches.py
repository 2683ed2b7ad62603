"""The mnist example's batch sizes for a number of ranks: what fit takes, or a
refusal that says which --nbatch-logical values work."""
import re

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt.examples.mnist import VAL_SPLIT, choose_batches, valid_logical_batches


def _fit_takes(ndata, shard, nranks, logical, physical):
    """fit's own conditions with comm over nranks ranks (ggmlopt.training)."""
    nbatches = ndata // logical
    ntrain = int(np.float32(np.float32(1) - np.float32(VAL_SPLIT)) * np.float32(nbatches))
    return (ndata % logical == 0 and logical % physical == 0 and physical % shard == 0
            and (logical // physical) % nranks == 0 and ntrain >= 1)


@pytest.mark.parametrize("nranks", range(1, 13))
@pytest.mark.parametrize(("ndata", "default"), [(1500, (100, 50)), (1500, (50, 10)),
                                                (2000, (100, 50)), (60000, (1000, 500))])
def test_defaults_fit_every_rank_count_the_data_allows(ndata, default, nranks):
    shard = 10
    allowed = valid_logical_batches(ndata, shard, nranks)
    if not allowed:
        with pytest.raises(ValueError, match=r"no --nbatch-logical fits .* run on .* processes"):
            choose_batches(ndata, shard, nranks, default)
        return
    logical, physical, note = choose_batches(ndata, shard, nranks, default)
    assert _fit_takes(ndata, shard, nranks, logical, physical)
    assert physical <= default[1]
    # the nearest valid logical batch to the default
    best = min(abs(np.log(v / default[0])) for v in allowed)
    assert abs(np.log(logical / default[0])) == best
    assert (note == "") == ((logical, physical) == default)
    assert note == "" or f"(one process: {default[0]}/{default[1]})" in note
    if _fit_takes(ndata, shard, nranks, *default):
        assert (logical, physical) == default  # nothing changes where nothing must


def test_valid_values_are_exactly_those_fit_takes():
    for nranks in (1, 2, 3, 4, 5):
        for physical in (None, 10, 20, 50):
            got = valid_logical_batches(1500, 10, nranks, physical)
            want = [n for n in range(1, 1501)
                    if any(_fit_takes(1500, 10, nranks, n, p) for p in
                           ([physical] if physical else range(10, n + 1, 10)))]
            assert got == want, (nranks, physical)


def test_asked_batches_are_kept_or_refused_naming_the_valid_ones():
    assert choose_batches(1500, 10, 3, (100, 50), logical=300) == (300, 50, "")
    logical, physical, note = choose_batches(1500, 10, 3, (100, 50), logical=60)
    assert (logical, physical) == (60, 20) and note.startswith("nbatch_logical=60, "
                                                               "nbatch_physical=20 so that")
    assert choose_batches(1500, 10, 2, (100, 50), physical=10)[:2] == (100, 10)
    with pytest.raises(ValueError, match=re.escape(
            "--nbatch-logical 100 does not fit ndata=1500 in shards of 10 on 3 ranks")) as e:
        choose_batches(1500, 10, 3, (100, 50), logical=100)
    assert str(e.value).endswith("valid --nbatch-logical values: 30, 60, 150, 300, 750")
    with pytest.raises(ValueError, match="valid --nbatch-logical values: 60, 300$"):
        choose_batches(1500, 10, 2, (100, 50), logical=100, physical=30)
    with pytest.raises(ValueError, match="--nbatch-physical 25 is not a whole number of "
                                         "shards of 10"):
        choose_batches(1500, 10, 1, (100, 50), physical=25)


def test_the_chosen_batches_train_in_one_process():
    """fit itself takes what choose_batches gives (the conditions are fit's)."""
    rng = np.random.default_rng(0)
    ds = go.Dataset.from_arrays(rng.standard_normal((300, 4)).astype(np.float32),
                                rng.integers(0, 3, 300), ndata_shard=10)
    logical, physical, _ = choose_batches(300, 10, 1, (70, 30))
    model = go.nn.Sequential(go.nn.Linear(4, 3, rng=0))
    history = go.fit(model, ds, "cross_entropy", nepoch=1, nbatch_logical=logical,
                     nbatch_physical=physical, val_split=VAL_SPLIT, silent=True)
    assert history.ndata_train + history.ndata_val == 300
