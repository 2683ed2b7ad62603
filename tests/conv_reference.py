"""float64 NumPy references of convolution and pooling, for the tests."""
import numpy as np


def pad(x, ph, pw):
    return np.pad(np.asarray(x, dtype=np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def out_size(h, w, kh, kw, sh, sw, ph=0, pw=0):
    return (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1


def conv2d_loops(x, weight, bias, stride, padding):
    """The definition, seven loops deep (small shapes only)."""
    n, c, h, w = x.shape
    oc, _, kh, kw = weight.shape
    (sh, sw), (ph, pw) = stride, padding
    oh, ow = out_size(h, w, kh, kw, sh, sw, ph, pw)
    y = np.zeros((n, oc, oh, ow))
    for i in range(n):
        for o in range(oc):
            for oy in range(oh):
                for ox in range(ow):
                    s = 0.0 if bias is None else float(bias[o])
                    for ci in range(c):
                        for ky in range(kh):
                            for kx in range(kw):
                                iy, ix = oy * sh - ph + ky, ox * sw - pw + kx
                                if 0 <= iy < h and 0 <= ix < w:
                                    s += float(weight[o, ci, ky, kx]) * float(x[i, ci, iy, ix])
                    y[i, o, oy, ox] = s
    return y


def windows(x, kh, kw, sh, sw, ph=0, pw=0):
    """(n, c, oh, ow, kh, kw) float64 view of the (padded) input's windows."""
    xp = pad(x, ph, pw)
    oh, ow = out_size(x.shape[2], x.shape[3], kh, kw, sh, sw, ph, pw)
    v = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))
    return v[:, :, :(oh - 1) * sh + 1:sh, :(ow - 1) * sw + 1:sw]


def conv2d(x, weight, bias, stride, padding):
    """The same as conv2d_loops, vectorised, in float64."""
    kh, kw = weight.shape[2:]
    v = windows(x, kh, kw, *stride, *padding)
    y = np.einsum("ncyxij,ocij->noyx", v, np.asarray(weight, dtype=np.float64))
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)[None, :, None, None]
    return y


def im2col(x, kernel, stride, padding):
    """(n, c*kh*kw, oh*ow) float64."""
    v = windows(x, *kernel, *stride, *padding)
    n, c, oh, ow, kh, kw = v.shape
    return v.transpose(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, oh * ow)


def maxpool2d(x, kernel, stride):
    v = windows(x, *kernel, *stride)
    return v.max(axis=(4, 5))


def avgpool2d(x, kernel, stride):
    v = windows(x, *kernel, *stride)
    return v.mean(axis=(4, 5))


def numeric_grad(f, a, eps=1e-6):
    """Central differences of the scalar function f at the float64 array a."""
    a = np.array(a, dtype=np.float64)
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f(a)
        flat[i] = old - eps
        fm = f(a)
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g
