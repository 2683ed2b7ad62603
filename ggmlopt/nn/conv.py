"""Conv2d: 2-D convolution on NCHW float32 images, im2col + NumPy's BLAS."""
from __future__ import annotations

import math
import threading

import numpy as np

from .. import kernels
from ._buffers import add_into, empty, trains
from ._images import as_grad, as_images
from .module import Module
from .parameter import Parameter

__all__ = ["Conv2d", "conv_kaiming_uniform"]

# Columns of this many bytes at a time: they stay in a core's L2 cache between
# im2col and the products (packing the whole batch at once was memory-bound).
_CHUNK_BYTES = 1 << 20


def conv_kaiming_uniform(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Conv2d's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = in_channels*kh*kw (weight is (out_channels, in_channels, kh, kw)).
    Fills the arrays in place."""
    fan_in = int(np.prod(weight.shape[1:]))
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    weight[...] = rng.uniform(-bound, bound, size=weight.shape)
    if bias is not None:
        bias[...] = rng.uniform(-bound, bound, size=bias.shape)


def _direct_fits(in_channels, out_channels, stride):
    """Whether the direct kernels beat im2col + BLAS: stride 1 and thin channel
    counts (measured on one thread: 0.56-0.95x of im2col up to 16 channels, or
    8 to 32 input with up to 32 output channels; 1.2-1.9x for 64 and more, or
    for 32 output channels from 1 to 3 input channels)."""
    if stride != (1, 1):
        return False
    widest = max(in_channels, out_channels)
    return widest <= 16 or (in_channels >= 8 and widest <= 32)


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


class Conv2d(Module):
    """Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True, *,
    init=None, rng=None)

    y[n, o] = bias[o] + sum over c, ky, kx of weight[o, c, ky, kx] *
    x[n, c, oy*sh - ph + ky, ox*sw - pw + kx] (zero outside the image): torch's
    Conv2d (a cross-correlation) on NCHW float32.
    x: (batch, in_channels, h, w) -> y: (batch, out_channels, oh, ow) with
    oh = (h + 2*ph - kh)//sh + 1, ow = (w + 2*pw - kw)//sw + 1.
    kernel_size, stride (>= 1) and padding (>= 0): an int or a pair (height, width).
    weight: Parameter (out_channels, in_channels, kh, kw), bias: Parameter
    (out_channels,) or None: torch's layout and names.  A frozen one
    (``requires_grad=False``) gets no gradient (im2col skips the weight's
    products; the direct kernels' one pass computes it and it is dropped); the
    input gradient is still returned.
    init(weight, bias, rng) fills the float32 arrays in place (bias None without
    one); default conv_kaiming_uniform (torch's default).  rng: None, an int seed
    or a numpy Generator.

    Stride 1 with thin channel counts (at most 16 channels each way, or 8 to 32
    input and at most 32 output channels; any kernel and padding) runs the
    direct convolution of kernels.conv2d_direct: one C pass per image over
    zero-padded planes, the images shared among the kernel threads, no BLAS.
    Wider layers and other strides pack the
    receptive fields (im2col, col2im) in the C kernels and hand the products to
    NumPy's BLAS, one per image, a chunk of images at a time (about 1 MiB of
    columns, packed again in backward rather than kept); with
    ggmlopt.set_num_threads(n > 1) the chunks are shared among n Python threads.
    Either way the results do not depend on the number of threads.
    backward reads the last forward's input, so that array must not change in
    between (as for every layer here).  ``forward`` returns a buffer
    the layer reuses (the next forward overwrites it); ``conv(x)`` returns a copy
    the caller owns.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 *, init=None, rng=None):
        self.in_channels = _count(in_channels, "in_channels")
        self.out_channels = _count(out_channels, "out_channels")
        self.kernel_size = kernels.pair(kernel_size, "kernel_size")
        self.stride = kernels.pair(stride, "stride")
        self.padding = kernels.pair(padding, "padding", 0)
        if init is not None and not callable(init):
            raise TypeError(f"init: expected a callable init(weight, bias, rng), got "
                            f"{type(init).__name__}")
        if rng is not None and not isinstance(rng, (int, np.integer, np.random.Generator)) \
                or isinstance(rng, bool):
            raise TypeError(f"rng: expected None, an int seed or a numpy Generator, got "
                            f"{type(rng).__name__}")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        kh, kw = self.kernel_size
        w = np.zeros((self.out_channels, self.in_channels, kh, kw), dtype=np.float32)
        b = np.zeros(self.out_channels, dtype=np.float32) if bias else None
        (init or conv_kaiming_uniform)(w, b, gen)
        self.weight = Parameter(w, name="weight")
        self.bias = Parameter(b, name="bias") if bias else None
        self._shape = None
        self._out_shape = None
        self._has_forward = False
        self._scratch = {}
        self._direct = _direct_fits(self.in_channels, self.out_channels, self.stride)
        self._work = None
        self._work_threads = 0

    def _buffers(self, shape):
        n, c, h, w = shape
        oh, ow = kernels.conv2d_output_size(h, w, self.kernel_size, self.stride, self.padding)
        rows = c * self.kernel_size[0] * self.kernel_size[1]
        chunk = max(1, min(n, _CHUNK_BYTES // (4 * rows * oh * ow)))
        # allocate everything before replacing anything: a MemoryError leaves the
        # layer as it was
        out = empty((n, self.out_channels, oh, ow), dtype=np.float32)
        self._out, self._chunk, self._rows = out, chunk, rows
        self._cols, self._dcols = [], []  # scratch per thread, made on first use
        self._grad_in = None  # the backward buffers come with the first backward
        self._out_shape = out.shape
        self._shape = tuple(shape)

    def _backward_buffers(self):
        n = self._shape[0]
        p = self._out_shape[2] * self._out_shape[3]
        rows = self._rows
        self._grad_in = empty(self._shape, dtype=np.float32)
        if self._direct:
            return
        self._dw_images = empty((n, self.out_channels, rows), dtype=np.float32)
        self._db_images = empty((n, self.out_channels), dtype=np.float32)
        self._ones_plane = np.ones(p, dtype=np.float32)
        self._ones_batch = np.ones(n, dtype=np.float32)

    def _scratch_for(self, group, backward):
        """The column buffer (and for backward the column-gradient buffer) of one
        thread's group of chunks."""
        shape = (self._chunk, self._rows, self._out_shape[2] * self._out_shape[3])
        while len(self._cols) <= group:
            self._cols.append(empty(shape, dtype=np.float32))
        if not backward:
            return self._cols[group], None
        while len(self._dcols) <= group:
            self._dcols.append(empty(shape, dtype=np.float32))
        return self._cols[group], self._dcols[group]

    def _run_chunks(self, step, backward):
        """step(i, j, col, dcol) over the batch, a chunk of images at a time (each
        chunk's columns stay in the cache between the packing and the products).
        With more than one kernel thread the chunks are split into contiguous
        groups run on as many Python threads: BLAS runs these small products on
        one thread, and NumPy and the kernels release the GIL.  Every image is
        computed alone, so the split does not change any result."""
        n, size = self._shape[0], self._chunk
        starts = list(range(0, n, size))
        groups = max(1, min(kernels.get_num_threads(), len(starts)))
        scratch = [self._scratch_for(g, backward) for g in range(groups)]
        errors = []

        def run(g):
            col, dcol = scratch[g]
            try:
                for i in starts[g * len(starts) // groups:(g + 1) * len(starts) // groups]:
                    j = min(n, i + size)
                    step(i, j, col[:j - i], None if dcol is None else dcol[:j - i])
            except Exception as e:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(e)

        workers = [threading.Thread(target=run, args=(g,)) for g in range(1, groups)]
        for w in workers:
            w.start()
        run(0)
        for w in workers:
            w.join()
        if errors:
            raise errors[0]

    def _workspace(self):
        """The direct kernels' scratch, sized again when the thread count grows."""
        threads = kernels.get_num_threads()
        if self._work is None or threads > self._work_threads:
            self._work = empty(kernels.conv2d_direct_workspace(
                self._shape, self.out_channels, self.kernel_size, self.padding, threads),
                dtype=np.float32)
            self._work_threads = threads
        return self._work

    def forward(self, x):
        """x: (batch, in_channels, h, w) -> (batch, out_channels, oh, ow) float32 (a
        buffer this layer reuses: the next forward overwrites it)."""
        x = as_images(x, "x", self.in_channels)
        if x.shape != self._shape:
            self._buffers(x.shape)
            self._work = None
        if self._direct:
            bias = None if self.bias is None else self.bias.data
            kernels.conv2d_direct(x, self.weight.data, bias, self.padding, out=self._out,
                                  workspace=self._workspace())
            self._x = x
            self._has_forward = True
            return self._out
        oc = self.out_channels
        out = self._out
        out3 = out.reshape(x.shape[0], oc, out.shape[2] * out.shape[3])
        w2 = self.weight.data.reshape(oc, -1)
        ks, st, pd = self.kernel_size, self.stride, self.padding
        bias = None if self.bias is None else self.bias.data

        def step(i, j, col, _):
            kernels.im2col(x[i:j], ks, st, pd, out=col)
            np.matmul(w2, col, out=out3[i:j])
            if bias is not None:  # while the chunk's output is in the cache
                kernels.add_bias_planes(out[i:j], bias)

        self._run_chunks(step, backward=False)
        self._x = x
        self._has_forward = True
        return self._out

    def backward(self, grad_out):
        """grad_out: (batch, out_channels, oh, ow) like the last forward output.
        Adds into weight.grad and bias.grad; returns d loss / d x (batch,
        in_channels, h, w), a buffer this layer reuses, or None when
        needs_input_grad is False."""
        if not self._has_forward:
            raise RuntimeError("backward: call forward first")
        g = as_grad(grad_out, self._out_shape)
        if self._grad_in is None:
            self._backward_buffers()
        if self._direct:
            return self._backward_direct(g)
        n, oc = g.shape[0], self.out_channels
        g3 = g.reshape(n, oc, g.shape[2] * g.shape[3])
        x, w2 = self._x, self.weight.data.reshape(oc, -1)
        ks, st, pd = self.kernel_size, self.stride, self.padding
        input_grad = self.needs_input_grad
        weight_grad = trains(self.weight)
        # one pass over the chunks: the columns (packed again, which costs less
        # than keeping the whole batch's) feed the weight gradient per image and,
        # through the transposed product and col2im, the input gradient
        def step(i, j, col, dcol):
            if weight_grad:
                kernels.im2col(x[i:j], ks, st, pd, out=col)
                np.matmul(g3[i:j], col.transpose(0, 2, 1), out=self._dw_images[i:j])
            if input_grad:
                np.matmul(w2.T, g3[i:j], out=dcol)
                kernels.col2im(dcol, (j - i, *self._shape[1:]), ks, st, pd,
                               out=self._grad_in[i:j])

        if weight_grad or input_grad:
            self._run_chunks(step, backward=True)
        add_into(self.weight,
                 lambda out: np.sum(self._dw_images, axis=0, out=out.reshape(oc, -1)),
                 self, "weight")
        if self.bias is not None:
            def bias_grad(out):
                np.matmul(g3, self._ones_plane, out=self._db_images)
                np.matmul(self._ones_batch, self._db_images, out=out)

            add_into(self.bias, bias_grad, self, "bias")
        return self._grad_in if input_grad else None

    def _forward_relu_maxpool(self, x, pool):
        """pool.forward_relu(self.forward(x)) without the full-size convolution
        output (each image's is pooled while in the cache): what a Sequential
        runs for Conv2d, ReLU, MaxPool2d when this layer takes the direct
        kernels.  Returns the pool's output buffer; the next backward goes
        through _backward_relu_maxpool.  This layer's own output buffer is not
        filled."""
        x = as_images(x, "x", self.in_channels)
        oh, ow = kernels.conv2d_output_size(x.shape[2], x.shape[3], self.kernel_size,
                                            self.stride, self.padding)
        pool._prepare((x.shape[0], self.out_channels, oh, ow))  # raises before any change here
        if x.shape != self._shape:
            self._buffers(x.shape)
            self._work = None
        bias = None if self.bias is None else self.bias.data
        kernels.conv2d_direct_relu_maxpool(x, self.weight.data, bias, self.padding,
                                           pool.kernel_size, pool.stride, out=pool._out,
                                           indices=pool._idx, workspace=self._workspace())
        self._x = x
        self._has_forward = True
        pool._relu = True
        pool._has_forward = True
        return pool._out

    def _backward_relu_maxpool(self, grad_out, pool):
        """The gradients through MaxPool2d, ReLU and this layer after
        _forward_relu_maxpool: grad_out is the pool's output gradient; adds into
        weight.grad and bias.grad and returns d loss / d x (or None when
        needs_input_grad is False)."""
        if not self._has_forward or not pool._has_forward:
            raise RuntimeError("backward: call forward first")
        g = as_grad(grad_out, pool._out_shape)
        if self._grad_in is None:
            self._backward_buffers()

        def run(grad_weight, grad_bias, grad_input):
            kernels.conv2d_direct_relu_maxpool_backward(
                self._x, self.weight.data, g, pool._idx, pool._out, self.padding,
                pool.kernel_size, pool.stride, grad_weight=grad_weight, grad_bias=grad_bias,
                grad_input=grad_input, bias=self.bias is not None,
                input_grad=grad_input is not None, workspace=self._workspace())

        return self._into_grads(run)

    def _backward_direct(self, g):
        """backward for the direct kernels: one C pass gives every gradient."""
        def run(grad_weight, grad_bias, grad_input):
            kernels.conv2d_direct_backward(
                self._x, self.weight.data, g, self.padding, grad_weight=grad_weight,
                grad_bias=grad_bias, grad_input=grad_input, bias=self.bias is not None,
                input_grad=grad_input is not None, workspace=self._workspace())

        return self._into_grads(run)

    def _into_grads(self, run):
        """run(grad_weight, grad_bias, grad_input) overwrites its arguments; the
        parameter gradients go straight into grad when it is known to be zero,
        else through scratch and an add."""
        targets = []
        for p, key in ((self.weight, "weight"), (self.bias, "bias")):
            if p is None:
                targets.append(None)
            elif trains(p) and p.grad_is_zero:
                targets.append(p.grad)
            else:  # added below, or thrown away for a frozen parameter
                targets.append(self._scratch_grad(key, p.shape))
        input_grad = self.needs_input_grad
        run(targets[0], targets[1], self._grad_in if input_grad else None)
        for p, t in zip((self.weight, self.bias), targets):
            if not trains(p):
                continue
            if t is not p.grad:
                np.add(p.grad, t, out=p.grad)
            p.grad_is_zero = False
        return self._grad_in if input_grad else None

    def _scratch_grad(self, key, shape):
        """A buffer of a parameter's shape for the direct kernels' sums (added into
        the gradient, or thrown away for a frozen parameter)."""
        scratch = self._scratch.get(key)
        if scratch is None or scratch.shape != shape:
            scratch = empty(shape, dtype=np.float32)
            self._scratch[key] = scratch
        return scratch

    def __repr__(self):
        return (f"Conv2d({self.in_channels}, {self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None})")
