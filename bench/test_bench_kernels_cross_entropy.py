"""Cross-entropy loss plus its gradient: ggmlopt against torch's
F.cross_entropy with probability targets followed by backward(), and against
its own avx2 path when avx512 is active."""
import numpy as np
import pytest
from conftest import measure

from ggmlopt import kernels

# (rows, cols, threads or None for the default) -> (ratio target, ns per logit target)
CASES = {
    (500, 10, None): (0.1, None),
    (64, 32000, 1): (0.2, 1.3),
    (64, 32000, None): (None, None),  # for scale: both libraries on every thread
}


def case_name(rows, cols, nthreads):
    name = f"cross_entropy {rows}x{cols}"
    return name if nthreads is None else f"{name}, {nthreads} thread"


def make_batch(rows, cols, rng):
    logits = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    labels = rng.random((rows, cols), dtype=np.float32)
    labels /= labels.sum(axis=1, keepdims=True)
    return logits, labels


@pytest.mark.parametrize("rows, cols, nthreads", list(CASES))
def test_cross_entropy_ggmlopt(benchmark, rows, cols, nthreads, rng, threads):
    if nthreads:
        threads(nthreads)
    logits, labels = make_batch(rows, cols, rng)
    grad = np.empty_like(logits)
    measure(benchmark, lambda: kernels.cross_entropy(logits, labels, grad=grad),
            case=case_name(rows, cols, nthreads), role="ggmlopt",
            label="ggmlopt.cross_entropy(grad=)", items=logits.size,
            ns_per_item_max=CASES[rows, cols, nthreads][1])


@pytest.mark.parametrize("rows, cols, nthreads", list(CASES))
def test_cross_entropy_ggmlopt_on_avx2(benchmark, rows, cols, nthreads, rng, threads,
                                       avx2_instead_of_avx512):
    """The same call on the avx2 path: the ratio is avx512 / avx2."""
    if nthreads:
        threads(nthreads)
    logits, labels = make_batch(rows, cols, rng)
    grad = np.empty_like(logits)
    measure(benchmark, lambda: kernels.cross_entropy(logits, labels, grad=grad),
            case=case_name(rows, cols, nthreads), role="baseline",
            label="ggmlopt.cross_entropy(grad=) on the avx2 path", items=logits.size)


@pytest.mark.parametrize("rows, cols, nthreads", list(CASES))
def test_cross_entropy_torch(benchmark, rows, cols, nthreads, rng, threads):
    torch = pytest.importorskip("torch")
    if nthreads:
        threads(nthreads)
    logits, labels = make_batch(rows, cols, rng)
    x = torch.from_numpy(logits).requires_grad_()
    y = torch.from_numpy(labels)

    def loss_and_grad():
        x.grad = None
        torch.nn.functional.cross_entropy(x, y).backward()

    measure(benchmark, loss_and_grad, case=case_name(rows, cols, nthreads), role="baseline",
            label="torch F.cross_entropy + backward", items=logits.size,
            target=CASES[rows, cols, nthreads][0])


def test_torch_baseline_matches_kernel(rng):
    """Both sides compute the same loss and gradient (else the comparison is moot)."""
    torch = pytest.importorskip("torch")
    logits, labels = make_batch(33, 17, rng)
    grad = np.empty_like(logits)
    loss = kernels.cross_entropy(logits, labels, grad=grad)
    x = torch.from_numpy(logits.copy()).requires_grad_()
    ref = torch.nn.functional.cross_entropy(x, torch.from_numpy(labels))
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-4, atol=1e-7)
