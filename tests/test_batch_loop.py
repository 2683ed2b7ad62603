"""One loop over an epoch's batches (ggmlopt.epoch_loop.run_batches over a
BatchPlan) for epoch, fit and the ranks; the ranks reach the context through
its public seam only."""
import ast
import os
import subprocess
import sys

import pytest

import ggmlopt as go
from ggmlopt.batch_plan import BatchPlan
from ggmlopt.epoch_loop import plan_batches, run_batches

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from dist_problem import make_problem
from thread_comm import results

PACKAGE = os.path.dirname(go.__file__)


def _tree(module):
    with open(os.path.join(PACKAGE, *module.split(".")) + ".py", encoding="utf-8") as f:
        return ast.parse(f.read())


def _names_used(module):
    tree = _tree(module)
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


def test_only_the_one_loop_evaluates_a_batch():
    modules = [f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")]
    users = sorted(m for m in modules if "eval_batch" in _names_used(m))
    assert users == ["epoch_loop"], users


def _context_privates():
    """The private attributes OptContext sets on itself."""
    out = set()
    for node in ast.walk(_tree("context")):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            out.add(node.attr)
    return out


@pytest.mark.parametrize("module", ["distributed", "rank_rng", "_global_pred", "_buckets"])
def test_the_ranks_use_the_contexts_public_seam(module):
    private = _context_privates()
    reads = sorted({n.attr for n in ast.walk(_tree(module))
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id in ("ctx", "c") and n.attr in private})
    assert not reads, f"{module} reads OptContext's private {reads}"


@pytest.mark.parametrize("module", ["batch_plan", "optimizers", "epoch_loop"])
def test_each_new_module_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import ggmlopt.{module}"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def _fit(comm=None, **fit_kwargs):
    model, ds = make_problem(0)
    kw = {} if comm is None else {"comm": comm}
    go.fit(model, ds, go.LossType.CROSS_ENTROPY, nepoch=2, nbatch_logical=60,
           nbatch_physical=10, val_split=0.3, seed=0, silent=False, **kw, **fit_kwargs)


@pytest.fixture
def progress_calls(monkeypatch):
    """The (rank, train, ibatch, ibatch_max) of every call of fit's progress bar."""
    from ggmlopt import training
    seen = []

    def record(train, ctx, dataset, result, ibatch, ibatch_max, t_start):
        rank = 0 if ctx.distributed is None else ctx.distributed.rank
        seen.append((rank, train, ibatch, ibatch_max))

    monkeypatch.setattr(training, "progress_bar", record)
    return seen


def test_fit_paused_or_not_shows_the_same_progress(progress_calls, capsys):
    _fit()
    straight = list(progress_calls)
    progress_calls.clear()
    _fit(eval_every=1)   # the epoch runs in parts, one per step
    assert progress_calls == straight
    # every physical batch of the 4 training steps, counted 1 .. 24 of 24, per epoch
    assert [c for c in straight if c[1]] == [(0, True, i, 24) for i in range(1, 25)] * 2
    assert [c for c in straight if not c[1]] == [(0, False, i, 12) for i in range(1, 13)] * 2


def test_over_ranks_progress_shows_whole_steps(progress_calls, capsys):
    results(2, _fit)
    # rank 0 alone shows progress: once per optimizer step (6 physical batches over
    # the ranks), then once after the validation
    steps = [(0, True, 6 * j, 24) for j in range(1, 5)] + [(0, False, 12, 12)]
    assert progress_calls == steps * 2


def test_a_plan_of_ones_own_runs_through_the_loop():
    model, ds = make_problem(0)
    ctx = go.OptContext(model, batch_size=10, ne_datapoint=13,
                        loss_type=go.LossType.CROSS_ENTROPY)
    plan = BatchPlan(False, 0, 0, ds.ndata // 10)
    plan.groups = [(3, 1), (2,)]    # any batches, in any groups
    shown = []
    result = go.Result()
    run_batches(ctx, ds, result, plan,
                lambda *a: shown.append((a[4], a[5], a[3].ndata)))
    assert shown == [(1, 0, 20), (2, 0, 30)] and result.ndata == 30
    # the same batches one at a time: the same losses
    again = go.Result()
    run_batches(ctx, ds, again, plan_batches(ctx, False, 1, 4, ds.ndata // 10), None)
    # (sums in double over the same three batches in another order)
    assert again.loss()[0] == pytest.approx(result.loss()[0], rel=1e-12)
    assert again.accuracy() == result.accuracy()
