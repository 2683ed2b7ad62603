"""Resources: memory that plateaus over repeated rounds of the common work
(RSS: the arenas are aligned C allocations tracemalloc does not see), file
descriptors and maps of a GGUF file given back when what read it is gone (at
once, not when the garbage collector runs), a model that maps its file kept
whole when the file is written over by ggmlopt or the model copied, and no
kernel thread left spinning."""
import contextlib
import copy
import gc
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import lora
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

gguf = pytest.importorskip("gguf")
from ggmlopt.io import load_gguf, load_gguf_tokenizer, save_gguf, save_gguf_lora
from ggmlopt.io.gguf_reader import GgufFile

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="reads /proc (Linux)")

CFG = LlamaConfig(vocab_size=257, dim=128, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=64)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(path) in line)


@contextlib.contextmanager
def _gc_off():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("res")
    model = Llama(CFG, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # K rows that are not whole blocks fall back
        save_gguf(model, d / "q8.gguf", dtype="q8_0", tokenizer=ByteTokenizer())
        save_gguf(model, d / "q4k.gguf", dtype="q4_k", tokenizer=ByteTokenizer())
    return d


def _data():
    ids = np.random.default_rng(1).integers(0, 257, size=8 * 32 + 33).astype(np.int32)
    return go.Dataset.from_tokens(ids, 32, stride=32)


def _kept(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_gguf(path, keep_types=True)


def _plateaus(work, per_round: int, rounds: int = 24, tail: int = 12) -> list[int]:
    """RSS after each of rounds calls of work (and a collection).  A leak of what a
    round allocates (per_round bytes) adds that every round, so the lowest RSS of
    the last tail/2 rounds would stand at least tail/2 rounds' allocation above the
    lowest of the tail/2 before them; it must stay below half of that.  (The
    lowest, not the last: the allocator keeps freed arenas for a while, which
    lifts single readings by more than a round, never the floor.)"""
    rss = []
    for _ in range(rounds):
        work()
        gc.collect()
        rss.append(_rss())
    half = tail // 2
    growth = min(rss[-half:]) - min(rss[-tail:-half])
    assert growth < half * per_round / 2, (
        f"RSS's floor grew {growth} bytes over the last {half} rounds, one round "
        f"allocates ~{per_round}: {rss}")
    return rss


def test_the_plateau_check_sees_a_leak():
    # the control: work that keeps what it allocates each round is caught.  Its
    # pages are mapped anew (an array could reuse the allocator's freed, still
    # resident memory of earlier tests, which RSS does not see grow)
    import mmap
    kept = []

    def leak():
        pages = mmap.mmap(-1, 4 << 20)
        pages.write(b"\1" * (4 << 20))   # touched: resident
        kept.append(pages)

    with pytest.raises(AssertionError, match="floor grew"):
        _plateaus(leak, 4 << 20, rounds=12, tail=8)


def _trained_bytes(model) -> int:
    """A fit's allocation for model: each trainable float as weight, gradient
    and AdamW's two moments, plus the frozen weights."""
    params = model.parameters()
    trained = sum(p.data.size for p in params if p.requires_grad)
    return 4 * (4 * trained + sum(p.data.size for p in params if not p.requires_grad))


def test_fit_with_lora_plateaus():
    data = _data()
    per_round = _trained_bytes(Llama(CFG, seed=0))   # the model, as built before apply

    def work():
        model = Llama(CFG, seed=0)
        lora.apply(model, rank=4, seed=0)
        go.fit(model, data, "cross_entropy", nbatch_logical=4, nbatch_physical=2,
               silent=True, seed=0)

    assert per_round > 2 << 20
    _plateaus(work, per_round)


@pytest.mark.parametrize("name", ["q8.gguf", "q4k.gguf"])
def test_kept_file_plateaus_and_gives_back_its_map_and_fd(files, name):
    path = files / name
    data = _data()
    gc.collect()
    fds, maps = _fds(), _maps(path)

    def work():
        model, _ = _kept(path)
        assert _maps(path) == maps + 1 and _fds() == fds + 1   # one map, its fd
        lora.apply(model, rank=4, seed=0)
        go.fit(model, data, "cross_entropy", nbatch_logical=4, silent=True, seed=0)
        go.generate(model, [1, 2, 3], 8, temperature=0)

    _plateaus(work, os.path.getsize(path) + _trained_bytes(Llama(CFG, seed=0)) // 8)
    assert (_fds(), _maps(path)) == (fds, maps)


def test_generate_from_chat_and_checkpoints_plateau(tmp_path):
    model = Llama(CFG, seed=0)
    # generate: the cache of 60 positions, keys and values of every layer
    cache = 2 * CFG.n_layers * 60 * CFG.dim * 4
    _plateaus(lambda: go.generate(model, [1, 2, 3], 57, temperature=0.8, seed=0),
              max(cache, 1 << 20))
    tok = ByteTokenizer(chat_template=CHATML)
    chats = [[{"role": "user", "content": f"question {i} " * 3},
              {"role": "assistant", "content": "an answer " * 4}] for i in range(300)]
    per_round = 2 * 300 * 128 * 4   # int32 windows and labels
    _plateaus(lambda: go.Dataset.from_chat(chats, tok, n_ctx=128), per_round, rounds=16,
              tail=8)
    data = _data()
    ck = tmp_path / "ck.npz"

    def resume():
        ck.unlink(missing_ok=True)
        go.fit(Llama(CFG, seed=0), data, "cross_entropy", nepoch=1, nbatch_logical=4,
               silent=True, seed=0, checkpoint=ck)
        go.fit(Llama(CFG, seed=0), data, "cross_entropy", nepoch=2, nbatch_logical=4,
               silent=True, seed=0, checkpoint=ck, resume=True)

    fds = _fds()
    _plateaus(resume, _trained_bytes(model), rounds=16, tail=8)
    assert _fds() == fds


def test_a_gguf_read_gives_back_its_map_and_fd_at_once(files, tmp_path):
    """GgufFile's key-value reader was a closure calling itself: a reference cycle
    through the file's map, so each read kept the file mapped and open (an fd)
    until the garbage collector ran; with it off (or just not run yet) 250 reads
    ran out of a 256-descriptor limit."""
    path = files / "q8.gguf"
    bad = tmp_path / "bad.gguf"
    # one key-value of an unknown type: refused while the key-values are read
    bad.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"a" + struct.pack("<I", 99))
    with _gc_off():
        fds, maps = _fds(), _maps(path)
        assert GgufFile(str(path)).fields["general.architecture"] == "llama"
        assert (_fds(), _maps(path)) == (fds, maps)
        load_gguf_tokenizer(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # Q8_0 dequantized
            model, tok = load_gguf(path)   # float32: the file is done with once loaded
        assert (_fds(), _maps(path)) == (fds, maps)
        del model, tok
        model, tok = _kept(path)   # mapped while the model lives
        assert (_fds(), _maps(path)) == (fds + 1, maps + 1)
        lora.apply(model, rank=2, seed=0)
        del model, tok
        assert (_fds(), _maps(path)) == (fds, maps)
        for _ in range(5):
            with pytest.raises(ValueError, match="unknown value type 99"):
                GgufFile(str(bad))
        assert _fds() == fds and _maps(bad) == 0


def _logits(model):
    return np.array(model(np.arange(8, dtype=np.int32)[None]), copy=True)


def _randomised(model):
    rng = np.random.default_rng(0)
    for _, layer in lora.named_adapters(model):
        layer.lora_b.data[...] = rng.normal(0, 0.3, layer.lora_b.shape)
    return model


def test_writing_over_the_mapped_file_keeps_the_model(files, tmp_path):
    """ggmlopt's writers replace a file by a rename: a model mapping the old one
    keeps its weights, and the new file is what a write elsewhere gives."""
    path = tmp_path / "base.gguf"
    path.write_bytes((files / "q4k.gguf").read_bytes())
    model, tok = _kept(path)
    before = _logits(model)
    save_gguf(model, tmp_path / "other.gguf", tokenizer=tok)
    save_gguf(model, path, tokenizer=tok)
    assert path.read_bytes() == (tmp_path / "other.gguf").read_bytes()
    np.testing.assert_array_equal(_logits(model), before)
    lora.apply(model, rank=4, seed=0)
    _randomised(model)
    adapted = _logits(model)
    save_gguf_lora(model, path)   # an adapter file over its own base's
    np.testing.assert_array_equal(_logits(model), adapted)
    again, _ = _kept(tmp_path / "other.gguf")
    go.io.load_gguf_lora(path, again)
    np.testing.assert_array_equal(_logits(again), adapted)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_mapped_model_outlives_the_file(files, tmp_path, how):
    path = tmp_path / "base.gguf"
    path.write_bytes((files / "q8.gguf").read_bytes())
    model, _ = _kept(path)
    lora.apply(model, rank=4, seed=0)
    _randomised(model)
    ids = go.generate(model, [1, 2, 3], 12, temperature=0, stop_ids=())
    logits = _logits(model)
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    del model
    gc.collect()
    path.unlink()
    assert _maps(path) == 0   # the copy holds its own bytes
    np.testing.assert_array_equal(go.generate(twin, [1, 2, 3], 12, temperature=0,
                                              stop_ids=()), ids)
    np.testing.assert_array_equal(_logits(twin), logits)


def test_no_thread_spins_after_fit_and_generate(files):
    """Every thread but the main one parked after a two-thread fit and a
    generation: a thread that spins (polls) is runnable ("R" in /proc) whenever
    it is looked at, however busy the machine is, and a parked one sleeps ("S");
    the states are sampled, not the CPU time, so the machine's load cannot hide
    a spinning thread (the pool lingers 2 ms by design, OpenBLAS's threads some
    tenths of a second: the sampling starts after a second)."""
    code = textwrap.dedent(f"""
        import glob, os, time, warnings
        import numpy as np
        import ggmlopt as go
        from ggmlopt import lora
        from ggmlopt.io import load_gguf
        warnings.simplefilter("ignore")
        go.set_num_threads(2)

        def runnable_samples(n=40):
            time.sleep(1.0)
            seen = {{}}
            for _ in range(n):
                for d in glob.glob("/proc/self/task/*/stat"):
                    tid = int(d.split("/")[-2])
                    if tid == os.getpid():
                        continue   # the main thread: the one sampling
                    try:
                        with open(d) as f:
                            state = f.read().rsplit(")", 1)[1].split()[0]
                    except OSError:   # a thread that ended meanwhile
                        continue
                    seen[tid] = seen.get(tid, 0) + (state == "R")
                time.sleep(0.005)
            return max(seen.values(), default=0), len(seen)

        ids = np.random.default_rng(1).integers(0, 257, size=8 * 32 + 33).astype(np.int32)
        data = go.Dataset.from_tokens(ids, 32, stride=32)
        model, _ = load_gguf({str(files / "q4k.gguf")!r}, keep_types=True)
        lora.apply(model, rank=4, seed=0)
        go.fit(model, data, "cross_entropy", nepoch=2, nbatch_logical=4, silent=True)
        after_fit = runnable_samples()
        go.generate(model, [1, 2, 3], 40, temperature=0)
        after_generate = runnable_samples()
        linger = go.kernels.set_pool_linger(0)
        # the control: a thread that does spin is seen runnable
        import threading
        stop = threading.Event()
        threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)],
                         daemon=True).start()
        spinning = runnable_samples()
        stop.set()
        print(*after_fit, *after_generate, linger, spinning[0])
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    fit_runnable, fit_threads, gen_runnable, gen_threads, linger, spinning = \
        proc.stdout.split()
    assert int(spinning) >= 30, proc.stdout   # the sampling sees a thread that spins
    assert int(fit_threads) >= 1 and int(gen_threads) >= 1   # the pool's workers were seen
    # of 40 looks, a spinning thread is runnable at (nearly) all, a parked one at none;
    # half leaves room for a thread woken by the system now and then
    assert int(fit_runnable) < 20 and int(gen_runnable) < 20, proc.stdout
    assert float(linger) == 0.0   # the holds of the passes and decode steps all released

