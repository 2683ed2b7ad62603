"""Checked by mypy, not run: the read-only attributes are read-only in the types
too.  Every ``type: ignore`` below must be needed (warn_unused_ignores turns an
unneeded one into an error), so a stub that made one writable fails the check.

    python -m mypy --config-file pyproject.toml tests/typecheck_readonly.py
"""
import ggmlopt as go

ds = go.Dataset(2, 0, 4)
ds.ndata = 5  # type: ignore[misc]
ds.ndata_shard = 2  # type: ignore[misc]
ds.nshards = 2  # type: ignore[misc]
ds.ne_datapoint = 3  # type: ignore[misc]
ds.ne_label = 1  # type: ignore[misc]
hist = go.History()
hist.train_loss = []  # type: ignore[misc]
hist.val_accuracy = []  # type: ignore[misc]
hist.seconds = []  # type: ignore[misc]
res = go.Result()
res.ndata = 3  # type: ignore[misc]
res.nbatches = 3  # type: ignore[misc]
ctx = go.OptContext(go.nn.Sequential(go.nn.Linear(2, 2)))
ctx.batch_size = 4  # type: ignore[misc]
ctx.loss_type = go.LossType.SUM  # type: ignore[misc]
n: int = ds.ndata + ds.nshards
losses: list[float] = hist.train_loss
