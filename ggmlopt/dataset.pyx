# cython: language_level=3
"""Dataset: datapoints and labels in owned aligned memory, cut into shards.

As in ggml's ``ggml_opt_dataset``: the data is ``ndata`` datapoints of
``ne_datapoint`` elements, the labels ``ndata`` rows of ``ne_label`` elements,
and both are split into ``nshards = ndata / ndata_shard`` shards of
``ndata_shard`` consecutive datapoints.  ``shuffle`` permutes shards, not
datapoints, and ``get_batch`` copies the shards of one batch, in permuted order,
into caller-owned batch arrays with one gather kernel call that runs without the
GIL.  Data stored as uint8 or float16 can be gathered straight into a float32
batch, scaled on the fly (MNIST as uint8 with scale 1/255 takes a quarter of the
memory of float32).
"""
import numbers

import numpy as np

from ggmlopt._dtypes import dtype_or_ggml_name

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uintptr_t

from ggmlopt._memory cimport AlignedBuffer
from ggmlopt.kernels cimport gather_shards_bytes, gather_shards_f16_f32, gather_shards_u8_f32

cnp.import_array()

_DATA_DTYPES = {
    np.dtype(np.float32): STORAGE_F32,
    np.dtype(np.float16): STORAGE_F16,
    np.dtype(np.uint8): STORAGE_U8,
    np.dtype(np.int32): STORAGE_I32,
}
_LABEL_DTYPES = {
    np.dtype(np.float32): STORAGE_F32,
    np.dtype(np.int32): STORAGE_I32,
}
_KIND_DTYPES = {
    STORAGE_F32: np.dtype(np.float32),
    STORAGE_F16: np.dtype(np.float16),
    STORAGE_U8: np.dtype(np.uint8),
    STORAGE_I32: np.dtype(np.int32),
}
_MAX_BYTES = (1 << 62)
_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1


def _count(value, str name, int64_t minimum):
    """value as an int64 >= minimum; TypeError for non-integers (bools included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v}")
    if v >= _MAX_BYTES:
        raise ValueError(f"{name}: {v} is too large")
    return v


def _storage_dtype(dtype, str name, dict allowed):
    dt = dtype_or_ggml_name(dtype, name)   # np.float32, "float32" or llama.cpp's "f32"
    if dt not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name}: {dt} is not supported; expected one of {names}")
    return dt


def _rng_from(rng_or_ctx):
    """A numpy Generator from a Generator, an int seed, or anything with a Generator .rng."""
    if isinstance(rng_or_ctx, np.random.Generator):
        return rng_or_ctx
    if isinstance(rng_or_ctx, numbers.Integral) and not isinstance(rng_or_ctx, bool):
        if rng_or_ctx < 0:
            raise ValueError(f"rng_or_ctx: a seed must be >= 0, got {rng_or_ctx}")
        return np.random.default_rng(int(rng_or_ctx))
    rng = getattr(rng_or_ctx, "rng", None)
    if isinstance(rng, np.random.Generator):
        return rng
    raise TypeError("rng_or_ctx: expected a numpy.random.Generator, an int seed, or an "
                    "OptContext (an object whose .rng is a numpy.random.Generator), got "
                    f"{type(rng_or_ctx).__name__}")


def _from_array_dtype(a, str name, dict stored):
    """The storage dtype for array a: its own when stored as is, float32 for any
    other real dtype (converted once by from_arrays)."""
    dt = a.dtype.newbyteorder("=")  # the byte order is a storage detail
    if dt in stored:
        return dt
    if dt.kind not in "biuf":
        raise TypeError(f"{name}: expected real numbers (float, int, uint or bool), got "
                        f"dtype {a.dtype}")
    return np.dtype(np.float32)


def _labels_for_storage(labels, int64_t ndata):
    """(labels as a 2-D array, storage dtype) for from_arrays: integer labels are
    stored as int32 ((ndata,) or (ndata, 1): class indices, which must be >= 0),
    every other real dtype as float32."""
    if not isinstance(labels, np.ndarray):
        raise TypeError(f"labels: expected a numpy.ndarray or None, got "
                        f"{type(labels).__name__}")
    if labels.dtype.kind not in "biuf":
        raise TypeError(f"labels: expected class indices (integers of shape ({ndata},)) or "
                        f"real targets (ndata, ne_label), got dtype {labels.dtype}")
    if labels.ndim == 0 or labels.ndim > 2 or labels.shape[0] != ndata:
        raise ValueError(f"labels: expected class indices of shape ({ndata},) or ({ndata}, 1), "
                         f"or targets of shape ({ndata}, ne_label) (one row per datapoint of "
                         f"data), got shape {labels.shape}")
    if labels.ndim == 1:
        labels = labels.reshape(ndata, 1)
    if labels.shape[1] == 0:
        raise ValueError("labels: expected at least one label element per datapoint "
                         "(pass labels=None for a dataset without labels)")
    if labels.dtype.kind in "iu":
        lo = 0 if labels.shape[1] == 1 else -_INT32_MAX - 1
        if labels.size and (labels.min() < lo or labels.max() > _INT32_MAX):
            what = "class indices" if lo == 0 else "integer labels"
            raise ValueError(f"labels: {what} must lie in [{lo}, {_INT32_MAX}], got values "
                             f"from {labels.min()} to {labels.max()}")
        return labels, np.dtype(np.int32)
    return labels, np.dtype(np.float32)


def _refuse_nonfinite(stored, source, str name):
    """ValueError naming the first datapoint (row) of stored, a 2-D float array, that
    holds NaN or inf; source: what it was copied from, for values that overflowed."""
    # rows in chunks, so the temporary mask stays small for a large dataset
    step = max(1, (1 << 22) // max(1, stored.shape[1]))
    for start in range(0, stored.shape[0], step):
        bad = ~np.isfinite(stored[start:start + step])
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            value, was = stored[start + row, col], source[start + row, col]
            why = (f": {float(was):g} does not fit {stored.dtype.name}"
                   if np.isfinite(was) else "")
            raise ValueError(f"{name}: datapoint {start + row} holds {value} (element {col}"
                             f"{why}); a non-finite value makes the loss NaN only after "
                             "optimizer steps have changed the model: clean the data, or "
                             "pass allow_nonfinite=True to keep it")


cdef inline bint _overlaps(cnp.ndarray a, AlignedBuffer buf):
    """Whether a's memory range meets buf's."""
    if buf is None:
        return False
    cdef uintptr_t a0 = <uintptr_t>cnp.PyArray_DATA(a)
    cdef uintptr_t a1 = a0 + <uintptr_t>cnp.PyArray_NBYTES(a)
    cdef uintptr_t b0 = <uintptr_t>buf.data
    cdef uintptr_t b1 = b0 + <uintptr_t>buf.nbytes
    return a0 < b1 and b0 < a1


cdef cnp.ndarray _batch_array(object a, str name):
    """a as a C-contiguous writable ndarray (its dtype is checked by the caller)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    if not a.flags.writeable:
        raise ValueError(f"{name}: the array is read-only, it must be writable")
    return <cnp.ndarray>a


cdef class Dataset:
    """Dataset(ne_datapoint, ne_label, ndata, ndata_shard=1, data_dtype=np.float32,
    label_dtype=np.float32, data_scale=None)

    ndata datapoints of ne_datapoint elements each, with ne_label label elements
    each (no labels when ne_label == 0), zero-filled, in shards of ndata_shard
    consecutive datapoints.  Fill ``data`` and ``labels`` (writable views), then
    ``shuffle`` and ``get_batch``.

    data_dtype: float32, float16, uint8 or int32.  label_dtype: float32 or int32.
    data_scale: for uint8 or float16 data only: the factor applied when
    get_batch converts to a float32 batch (default 1).

    Read-only attributes (ints): ndata, ndata_shard, nshards (ndata /
    ndata_shard), ne_datapoint, ne_label.
    """

    def __cinit__(self, ne_datapoint, ne_label, ndata, ndata_shard=1,
                  data_dtype=np.float32, label_dtype=np.float32, data_scale=None):
        ne_datapoint = _count(ne_datapoint, "ne_datapoint", 1)
        ne_label = _count(ne_label, "ne_label", 0)
        ndata = _count(ndata, "ndata", 1)
        ndata_shard = _count(ndata_shard, "ndata_shard", 1)
        if ndata % ndata_shard != 0:
            raise ValueError(f"ndata: {ndata} is not a multiple of ndata_shard={ndata_shard}")
        ddt = _storage_dtype(data_dtype, "data_dtype", _DATA_DTYPES)
        ldt = _storage_dtype(label_dtype, "label_dtype", _LABEL_DTYPES)
        scale = 1.0
        if data_scale is not None:
            if ddt not in (np.dtype(np.uint8), np.dtype(np.float16)):
                raise ValueError(f"data_scale: only for uint8 or float16 data (converted to "
                                 f"float32 by get_batch), not for {ddt}")
            if isinstance(data_scale, bool) or not isinstance(data_scale, numbers.Real):
                raise TypeError(f"data_scale: expected a real number, got "
                                f"{type(data_scale).__name__}")
            scale = float(data_scale)
            if not abs(scale) <= _F32_MAX:  # NaN fails too
                raise ValueError(f"data_scale: expected a finite float32, got {scale}")
        data_bytes = ndata * ne_datapoint * ddt.itemsize
        label_bytes = ndata * ne_label * ldt.itemsize
        if data_bytes >= _MAX_BYTES or label_bytes >= _MAX_BYTES:
            raise ValueError(f"ndata: {ndata} datapoints of {ne_datapoint} + {ne_label} "
                             "elements do not fit in memory")

        self.ndata = ndata
        self.ndata_shard = ndata_shard
        self.nshards = ndata // ndata_shard
        self.ne_datapoint = ne_datapoint
        self.ne_label = ne_label
        self._data_kind = _DATA_DTYPES[ddt]
        self._label_kind = _LABEL_DTYPES[ldt]
        self._data_scale = <float>scale
        self._shard_data_bytes = ndata_shard * ne_datapoint * ddt.itemsize
        self._shard_label_bytes = ndata_shard * ne_label * ldt.itemsize

        self._data_buf = AlignedBuffer(data_bytes)
        self._data = self._data_buf.data
        self._data_view = self._data_buf.view(ddt, (ndata, ne_datapoint))
        if ne_label > 0:
            self._labels_buf = AlignedBuffer(label_bytes)
            self._labels = self._labels_buf.data
            self._labels_view = self._labels_buf.view(ldt, (ndata, ne_label))
        else:
            self._labels_buf = None
            self._labels = NULL
            self._labels_view = None
        self._perm_buf = AlignedBuffer(self.nshards * 8)
        self._perm = <int64_t *>self._perm_buf.data
        cdef int64_t i
        for i in range(self.nshards):
            self._perm[i] = i
        self._perm_view = self._perm_buf.view(np.int64, (self.nshards,))

    # ---- construction from arrays ------------------------------------------------

    @classmethod
    def from_arrays(cls, data, labels=None, ndata_shard=1, data_scale=None, *,
                    allow_nonfinite=False):
        """A Dataset holding copies of data and labels.

        data: (ndata, ne_datapoint) array of real numbers (more trailing axes are
        flattened: (ndata, 28, 28) gives ne_datapoint = 784).  float32, float16,
        uint8 and int32 are stored as they are (uint8/float16 at a quarter/half of
        float32's memory, converted by get_batch); every other real dtype
        (float64, int64, bool, ...) is converted to float32 once, here.
        labels: None; or class indices, an integer array of shape (ndata,) or
        (ndata, 1) with values >= 0, stored as int32 with ne_label = 1 (what
        CROSS_ENTROPY needs, at 4 bytes a datapoint); or a 2-D (ndata, ne_label)
        real array of targets (one-hot or soft probabilities, regression
        targets), stored as float32 (a 1-D float array counts as (ndata, 1));
        integer arrays of other widths are stored as int32 (training takes
        class indices or float targets).
        The copies are in native byte order.
        allow_nonfinite: False (the default) refuses float data or labels holding
        NaN or inf, also values that overflow float32/float16 in the copy
        (ValueError naming the first such datapoint); True keeps them.
        """
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data: expected a numpy.ndarray, got {type(data).__name__}")
        if data.ndim < 2:
            raise ValueError(f"data: expected shape (ndata, ne_datapoint), got {data.shape}")
        ddt = _from_array_dtype(data, "data", _DATA_DTYPES)
        ndata = data.shape[0]
        if ndata == 0:
            raise ValueError("data: expected at least one datapoint, got shape "
                             f"{data.shape}")
        ne_datapoint = data.size // ndata
        if ne_datapoint == 0:
            raise ValueError(f"data: datapoints have no elements (shape {data.shape})")
        ne_label = 0
        ldt = np.dtype(np.float32)
        if labels is not None:
            labels, ldt = _labels_for_storage(labels, ndata)
            ne_label = labels.shape[1]
        cdef Dataset ds = cls(ne_datapoint, ne_label, ndata, ndata_shard, ddt, ldt, data_scale)
        source = data.reshape(ndata, ne_datapoint)
        with np.errstate(over="ignore", invalid="ignore"):  # overflows are refused below
            np.copyto(ds._data_view, source, casting="unsafe")
            if labels is not None:
                np.copyto(ds._labels_view, labels, casting="unsafe")
        if not allow_nonfinite:
            if ds._data_view.dtype.kind == "f":
                _refuse_nonfinite(ds._data_view, source, "data")
            if labels is not None and ds._labels_view.dtype.kind == "f":
                _refuse_nonfinite(ds._labels_view, labels, "labels")
        return ds

    @classmethod
    def from_tokens(cls, tokens, n_ctx, stride=None):
        """Next-token windows of a token corpus, as llama.cpp's
        ``common_opt_dataset_init`` makes them.

        tokens: a 1-D integer array of token ids >= 0 (any integer dtype: uint16
        and uint32 files as nanoGPT and llm.c write them, through ``np.memmap`` or
        ``np.fromfile``), read window by window: the corpus is never copied whole.
        n_ctx: the tokens of one datapoint.  stride: the step between windows,
        default n_ctx // 2 (at least 1).
        Datapoint i is ``tokens[i*stride : i*stride + n_ctx]`` and its labels are
        ``tokens[i*stride + 1 : i*stride + n_ctx + 1]`` (each position's next
        token), both int32 (ne_datapoint = ne_label = n_ctx), ndata_shard 1, and
        ``ndata = (len(tokens) - n_ctx - 1) // stride``.  ValueError when that is
        0, saying how many tokens one window needs.
        """
        if not isinstance(tokens, np.ndarray):
            raise TypeError(f"tokens: expected a 1-D numpy.ndarray (or memmap) of token ids, "
                            f"got {type(tokens).__name__}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected shape (ntokens,), got {tokens.shape}")
        n_ctx = _count(n_ctx, "n_ctx", 1)
        stride = max(n_ctx // 2, 1) if stride is None else _count(stride, "stride", 1)
        ntokens = tokens.shape[0]
        ndata = (ntokens - n_ctx - 1) // stride if ntokens > n_ctx else 0
        if ndata < 1:
            raise ValueError(f"tokens: {ntokens} tokens make no window of n_ctx={n_ctx} with "
                             f"stride={stride}: ndata = (ntokens - n_ctx - 1) // stride "
                             f"needs at least {n_ctx + 1 + stride} tokens")
        used = tokens[:(ndata - 1) * stride + n_ctx + 1]
        if used.size and (used.min() < 0 or used.max() > _INT32_MAX):
            raise ValueError(f"tokens: token ids must lie in [0, {_INT32_MAX}], got values "
                             f"from {used.min()} to {used.max()}")
        cdef Dataset ds = cls(n_ctx, n_ctx, ndata, 1, np.int32, np.int32)
        windows = np.lib.stride_tricks.sliding_window_view(used, n_ctx + 1)[::stride]
        np.copyto(ds._data_view, windows[:ndata, :n_ctx], casting="unsafe")
        np.copyto(ds._labels_view, windows[:ndata, 1:], casting="unsafe")
        return ds

    @classmethod
    def from_chat(cls, conversations, tokenizer, n_ctx, *, train_on="assistant",
                  too_long="error", packing=False, **template_kwargs):
        """Token windows of conversations for supervised fine-tuning.

        conversations: an iterable of conversations, each a list of messages
        (dicts with ``role`` and ``content``) or a dict with ``messages``, or
        ShareGPT's ``conversations`` of ``from``/``value`` turns (the JSONL
        forms ggmlopt.datasets.read_jsonl reads).  Each is rendered by the
        tokenizer's chat template (``tokenizer.apply_chat_template``) and
        tokenized once; datapoint i holds its tokens but the last (int32, n_ctx,
        padded with eos) and the labels the next tokens of the trained turns, -1
        elsewhere.  train_on: "assistant" (every assistant turn, the default),
        "last" (the last one), "all".  too_long: a conversation of more than
        n_ctx + 1 tokens is an "error" (ValueError naming it), "drop"ped or
        "truncate"d, the last two with a UserWarning giving the count.
        packing: False (one conversation a datapoint) or True: several
        conversations a window, the fullest windows first (best-fit
        decreasing), each conversation's first token stored as -1 - id so the
        language models attend within it and restart its positions
        (ggmlopt.nn.positions; ``split_documents`` reads ids, positions and
        document starts back): the loss and gradients are those of the
        conversations alone, with far fewer padded positions.
        template_kwargs: further template variables, as keywords
        (``enable_thinking=False``; not chat's ``template_kwargs=`` dict, which
        is refused).  See ggmlopt.instruct.
        """
        from ggmlopt.instruct import chat_windows
        x, y = chat_windows(conversations, tokenizer, n_ctx, train_on=train_on,
                            too_long=too_long, packing=packing, **template_kwargs)
        return cls.from_arrays(x, y)

    @classmethod
    def from_completions(cls, pairs, tokenizer, n_ctx, *, too_long="error", add_eos=True,
                         packing=False):
        """Token windows of (prompt, completion) pairs (tuples or dicts with
        ``prompt`` and ``completion``), the loss on the completion only (and its
        eos, appended unless add_eos is False); otherwise (packing too) as
        from_chat.  A prompt and completion that are lists of messages (TRL's
        conversational form) are rendered by the tokenizer's chat template as
        TRL's SFTTrainer renders them (see ggmlopt.instruct.completion_windows)."""
        from ggmlopt.instruct import completion_windows
        x, y = completion_windows(pairs, tokenizer, n_ctx, too_long=too_long, add_eos=add_eos,
                                  packing=packing)
        return cls.from_arrays(x, y)

    @classmethod
    def from_texts(cls, texts, tokenizer, n_ctx, *, too_long="error", add_eos=True,
                   packing=False):
        """Token windows of texts (str, or dicts with ``text``: TRL's and MLX-LM's
        language-modelling rows), each its own document trained on whole (BOS
        first where the tokenizer adds it, its eos last unless add_eos is False):
        one a datapoint, or several with packing, each attending only within
        itself; otherwise as from_chat.  (Dataset.from_tokens cuts one long
        token stream into overlapping windows, as llama-finetune does.)"""
        from ggmlopt.instruct import text_windows
        x, y = text_windows(texts, tokenizer, n_ctx, too_long=too_long, add_eos=add_eos,
                            packing=packing)
        return cls.from_arrays(x, y)

    # ---- views and properties ---------------------------------------------------

    @property
    def data(self):
        """Writable view (ndata, ne_datapoint) of the data this Dataset owns (a new
        view object each time, so reshaping or freezing one leaves the others alone)."""
        return self._data_view.view()

    @property
    def labels(self):
        """Writable view (ndata, ne_label) of the labels, or None when ne_label == 0."""
        return None if self._labels_view is None else self._labels_view.view()

    @property
    def data_dtype(self):
        """The storage dtype of the data."""
        return _KIND_DTYPES[self._data_kind]

    @property
    def label_dtype(self):
        """The storage dtype of the labels (None when the dataset has no labels)."""
        return _KIND_DTYPES[self._label_kind] if self.ne_label > 0 else None

    @property
    def document_ids(self):
        """For token windows (int32 data): int32 (ndata, ne_datapoint), the index
        of each token's document within its window (all 0 unless the windows
        were packed: ``from_chat(..., packing=True)``); None for other data."""
        if self._data_kind != STORAGE_I32:
            return None
        from ggmlopt.nn.positions import document_ids
        return document_ids(self._data_view)

    @property
    def positions(self):
        """For token windows (int32 data): int32 (ndata, ne_datapoint), each
        token's position within its document (where RoPE and learned positions
        restart in packed windows); None for other data."""
        if self._data_kind != STORAGE_I32:
            return None
        from ggmlopt.nn.positions import split_documents
        _, pos = split_documents(self._data_view)
        if pos is None:
            return np.ascontiguousarray(np.broadcast_to(
                np.arange(self.ne_datapoint, dtype=np.int32), (self.ndata, self.ne_datapoint)))
        return pos.positions

    @property
    def class_labels(self):
        """Whether the labels are class indices: int32 storage with ne_label == 1
        (what from_arrays makes of integer labels of shape (ndata,))."""
        return self.ne_label == 1 and self._label_kind == STORAGE_I32

    @property
    def data_scale(self):
        """The factor applied to uint8/float16 data gathered into float32 batches."""
        return float(self._data_scale)

    @property
    def permutation(self):
        """A read-only copy of the shard order (int64, nshards)."""
        out = self._perm_view.copy()
        out.flags.writeable = False
        return out

    def _set_permutation(self, permutation):
        """Restore a shard order read from ``permutation`` (checkpoints use it).

        permutation: integer array of shape (nshards,) holding each shard index
        0 .. nshards-1 exactly once.  Checked before anything changes.
        """
        if not isinstance(permutation, np.ndarray):
            raise TypeError(f"permutation: expected a numpy.ndarray, got "
                            f"{type(permutation).__name__}")
        if permutation.dtype.kind not in "iu":
            raise TypeError(f"permutation: expected an integer dtype, got {permutation.dtype}")
        if permutation.shape != (self.nshards,):
            raise ValueError(f"permutation: expected shape ({self.nshards},) (one entry per "
                             f"shard), got {permutation.shape}")
        order = permutation.astype(np.int64)
        seen = np.zeros(self.nshards, dtype=bool)
        inside = (order >= 0) & (order < self.nshards)
        seen[order[inside]] = True
        if not inside.all() or not seen.all():
            raise ValueError(f"permutation: expected each shard index 0..{self.nshards - 1} "
                             "exactly once")
        self._perm_view[...] = order

    def __len__(self):
        return self.ndata

    def __reduce__(self):
        """Pickling: the shape, the dtypes, data_scale, copies of the data and
        labels, and the shard order; unpickling rebuilds an equal Dataset in new
        aligned memory."""
        scaled = self._data_kind in (STORAGE_U8, STORAGE_F16)
        return (_dataset_from_pickle,
                (type(self), self.ne_datapoint, self.ne_label, self.ndata, self.ndata_shard,
                 self.data_dtype.str, _KIND_DTYPES[self._label_kind].str,
                 self.data_scale if scaled else None, self._data_view.copy(),
                 None if self._labels_view is None else self._labels_view.copy(),
                 self._perm_view.copy()))

    def __repr__(self):
        return (f"Dataset(ne_datapoint={self.ne_datapoint}, ne_label={self.ne_label}, "
                f"ndata={self.ndata}, ndata_shard={self.ndata_shard}, "
                f"data_dtype={self.data_dtype.name}, "
                f"label_dtype={getattr(self.label_dtype, 'name', None)})")

    # ---- shuffle -----------------------------------------------------------------

    def shuffle(self, rng_or_ctx, idata=-1):
        """Permute the shards: all of them when idata < 0, else only the first
        idata / ndata_shard (idata a multiple of ndata_shard, at most ndata).

        rng_or_ctx: a numpy.random.Generator, an int seed, or an OptContext (its
        .rng).  The order is ``rng.shuffle(order[:k])`` on the current order, so a
        generator in a given state always gives the same permutation.
        """
        if isinstance(idata, bool) or not isinstance(idata, numbers.Integral):
            raise TypeError(f"idata: expected an int, got {type(idata).__name__}")
        idata = int(idata)
        if idata > self.ndata:
            raise ValueError(f"idata: expected at most ndata={self.ndata}, got {idata}")
        if idata >= 0 and idata % self.ndata_shard != 0:
            raise ValueError(f"idata: expected a multiple of ndata_shard={self.ndata_shard}, "
                             f"got {idata}")
        rng = _rng_from(rng_or_ctx)
        if idata < 0:
            rng.shuffle(self._perm_view)
        else:
            rng.shuffle(self._perm_view[:idata // self.ndata_shard])

    # ---- get_batch ---------------------------------------------------------------

    cdef int get_batch_c(self, void *data_batch, bint to_f32, void *labels_batch,
                         int64_t shards_per_batch, int64_t ibatch) noexcept nogil:
        """Copy the shards of batch ibatch into data_batch (shards_per_batch shards,
        of the storage dtype, or float32 when to_f32) and labels_batch."""
        if shards_per_batch < 1 or ibatch < 0 or ibatch > self.nshards // shards_per_batch - 1:
            return GET_BATCH_OUT_OF_RANGE
        if (labels_batch == NULL) != (self._labels == NULL):
            return GET_BATCH_LABELS_MISMATCH
        if to_f32 and self._data_kind != STORAGE_U8 and self._data_kind != STORAGE_F16:
            if self._data_kind != STORAGE_F32:
                return GET_BATCH_NO_CONVERSION
            to_f32 = False  # float32 storage: a plain copy
        cdef const int64_t *perm = self._perm + ibatch * shards_per_batch
        cdef int64_t shard_elems = self.ndata_shard * self.ne_datapoint
        if not to_f32:
            gather_shards_bytes(shards_per_batch, self._shard_data_bytes, perm,
                                self._data, data_batch)
        elif self._data_kind == STORAGE_U8:
            gather_shards_u8_f32(shards_per_batch, shard_elems, perm,
                                 <const uint8_t *>self._data, <float *>data_batch,
                                 self._data_scale)
        else:
            gather_shards_f16_f32(shards_per_batch, shard_elems, perm,
                                  <const uint16_t *>self._data, <float *>data_batch,
                                  self._data_scale)
        if labels_batch != NULL:
            gather_shards_bytes(shards_per_batch, self._shard_label_bytes, perm,
                                self._labels, labels_batch)
        return GET_BATCH_OK

    def get_batch(self, data_batch, labels_batch, ibatch):
        """Copy batch ibatch: shard ``permutation[ibatch * k + j]`` goes to slot j,
        with k = data_batch.size / (ndata_shard * ne_datapoint) shards per batch.

        data_batch: C-contiguous writable array of any shape whose size is a whole
        number k >= 1 of shards, of the data's dtype, or float32 for uint8/float16
        data (converted and multiplied by data_scale).
        labels_batch: None exactly when the dataset has no labels; else a
        C-contiguous writable array of the label dtype holding k shards of labels.
        ibatch: 0 <= ibatch and (ibatch + 1) * k <= nshards.
        """
        cdef cnp.ndarray d = _batch_array(data_batch, "data_batch")
        cdef object ddt = _KIND_DTYPES[self._data_kind]
        cdef bint to_f32 = False
        if d.dtype != ddt:
            if d.dtype == np.float32 and (self._data_kind == STORAGE_U8
                                          or self._data_kind == STORAGE_F16):
                to_f32 = True
            else:
                extra = " or float32" if self._data_kind in (STORAGE_U8, STORAGE_F16) else ""
                raise TypeError(f"data_batch: expected dtype {ddt.name}{extra} (the dataset "
                                f"stores {ddt.name}), got {d.dtype}")
        cdef int64_t shard_elems = self.ndata_shard * self.ne_datapoint
        cdef int64_t size = d.size
        if size == 0 or size % shard_elems != 0:
            raise ValueError(f"data_batch: expected a whole number (>= 1) of shards of "
                             f"{shard_elems} elements (ndata_shard={self.ndata_shard} x "
                             f"ne_datapoint={self.ne_datapoint}), got {size} elements")
        cdef int64_t shards_per_batch = size // shard_elems
        cdef cnp.ndarray lab = None
        cdef void *plab = NULL
        cdef object ldt
        if self._labels == NULL:
            if labels_batch is not None:
                raise ValueError("labels_batch: this dataset has no labels (ne_label=0); "
                                 "pass None")
        else:
            if labels_batch is None:
                raise ValueError(f"labels_batch: this dataset has labels (ne_label="
                                 f"{self.ne_label}); pass an array for them")
            lab = _batch_array(labels_batch, "labels_batch")
            ldt = _KIND_DTYPES[self._label_kind]
            if lab.dtype != ldt:
                raise TypeError(f"labels_batch: expected dtype {ldt.name}, got {lab.dtype}")
            if lab.size != shards_per_batch * self.ndata_shard * self.ne_label:
                raise ValueError(f"labels_batch: expected {shards_per_batch * self.ndata_shard} "
                                 f"x ne_label={self.ne_label} = "
                                 f"{shards_per_batch * self.ndata_shard * self.ne_label} "
                                 f"elements ({shards_per_batch} shards, as data_batch), "
                                 f"got {lab.size}")
            plab = cnp.PyArray_DATA(lab)
        if isinstance(ibatch, bool) or not isinstance(ibatch, numbers.Integral):
            raise TypeError(f"ibatch: expected an int, got {type(ibatch).__name__}")
        nbatches = self.nshards // shards_per_batch
        if ibatch < 0 or ibatch >= nbatches:
            raise IndexError(f"ibatch: expected 0 <= ibatch < {nbatches} (nshards="
                             f"{self.nshards} in batches of {shards_per_batch} shards), "
                             f"got {ibatch}")
        if _overlaps(d, self._data_buf) or _overlaps(d, self._labels_buf) or (
                lab is not None and (_overlaps(lab, self._data_buf)
                                     or _overlaps(lab, self._labels_buf))):
            raise ValueError("data_batch/labels_batch: a batch array must not share memory "
                             "with the dataset's own data or labels")
        if lab is not None and np.may_share_memory(d, lab):
            raise ValueError("data_batch and labels_batch overlap in memory; they must be "
                             "distinct arrays")
        cdef void *pd = cnp.PyArray_DATA(d)
        cdef int64_t ib = ibatch
        cdef int rc
        with nogil:
            rc = self.get_batch_c(pd, to_f32, plab, shards_per_batch, ib)
        if rc != GET_BATCH_OK:  # the checks above make this unreachable
            raise RuntimeError(f"get_batch: internal status {rc}")


def _dataset_from_pickle(cls, ne_datapoint, ne_label, ndata, ndata_shard, data_dtype,
                         label_dtype, data_scale, data, labels, permutation):
    """Dataset.__reduce__'s inverse: the arrays checked (their shapes exactly:
    np.copyto would broadcast one row into every row) as they are copied."""
    cdef Dataset ds = cls(ne_datapoint, ne_label, ndata, ndata_shard, data_dtype, label_dtype,
                          data_scale)
    for name, got, want in (("data", data, ds._data_view), ("labels", labels, ds._labels_view)):
        if (got is None) != (want is None):
            raise ValueError(f"{name}: the pickled dataset's {name} do not match its sizes")
        if got is not None and np.shape(got) != want.shape:
            raise ValueError(f"{name}: expected shape {want.shape} in the pickled dataset, got "
                             f"{np.shape(got)}")
    np.copyto(ds._data_view, data, casting="no")
    if labels is not None:
        np.copyto(ds._labels_view, labels, casting="no")
    ds._set_permutation(permutation)
    return ds
