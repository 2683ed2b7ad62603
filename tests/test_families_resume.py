"""Every model family through fit's checkpoints: three epochs straight and one
epoch, then a resume to three from its checkpoint, give the same parameters bit
for bit (the same shuffles, dropout-free models, the AdamW state restored); the
families are those of the data-parallel problem (tests/lm_dist_problem.py),
whose equality over ranks tests/test_distributed_ranks.py checks."""
import lm_dist_problem as lm
import numpy as np
import pytest

import ggmlopt as go


@pytest.mark.parametrize("kind", list(lm.CONFIGS))
def test_a_resumed_fit_of_every_family_is_bit_exact(tmp_path, kind):
    x, y = lm.token_windows(ndata=48)
    pars = go.OptimizerParams(go.AdamWParams(alpha=1e-2))

    def run(nepoch, ckpt, resume=False):
        model = lm.make_model(kind)
        go.fit(model, go.Dataset.from_arrays(x, y), go.LossType.CROSS_ENTROPY,
               lambda ep: pars, nepoch=nepoch, nbatch_logical=12, nbatch_physical=6,
               val_split=0.25, silent=True, seed=3, checkpoint=str(ckpt), resume=resume)
        return model

    straight = run(3, tmp_path / "a.npz")
    once = lm.params(run(1, tmp_path / "b.npz"))
    resumed = run(3, tmp_path / "b.npz", resume=True)
    assert np.abs(lm.params(straight) - once).max() > 1e-4   # epochs two and three trained
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
