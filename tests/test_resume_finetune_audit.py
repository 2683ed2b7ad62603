"""A fine-tuning run resumed from its checkpoint: bit for bit the uninterrupted run
(LoRA dropout, a kept QLoRA base, bf16, gradient checkpointing, packed chats, a
warmup-cosine schedule, gradient accumulation, the finetune command), a
checkpoint that holds only what trains, and a resume into a model that differs
where the trainable parameters' names and shapes do not tell (other frozen base
weights, another alpha or dropout through OptContext.load) refused."""
import json
import math
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import finetune, lora
from ggmlopt.checkpoint import FitCheckpoint, load_state
from ggmlopt.models import Llama, LlamaConfig
from ggmlopt.text import ByteTokenizer

CFG = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                  max_seq_len=16)
# the columns of an EpochStats row that are timings, not results
TIMINGS = [9, 10, 11]


def _tokens(n=48, t=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (n, t)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = -1
    return go.Dataset.from_arrays(x, y)


def _adapted(seed=2, **options):
    model = Llama(CFG, seed=seed)
    lora.apply(model, **{"rank": 4, "alpha": 8.0, "seed": 0, **options})
    return model


class _Stop(Exception):
    pass


def _interrupted_after(monkeypatch, nsaves, error=_Stop):
    """FitCheckpoint.save raises error once it wrote its nsaves-th file (a run
    killed right after a checkpoint)."""
    original, count = FitCheckpoint.save, [0]

    def save(self, *args, **kwargs):
        original(self, *args, **kwargs)
        count[0] += 1
        if count[0] == nsaves:
            raise error
    monkeypatch.setattr(FitCheckpoint, "save", save)
    return lambda: monkeypatch.setattr(FitCheckpoint, "save", original)


def _assert_same_files(a, b):
    sa, sb = load_state(a), load_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        va, vb = sa[key], sb[key]
        if key == "fit.history":
            va, vb = np.delete(va, TIMINGS, axis=1), np.delete(vb, TIMINGS, axis=1)
        if isinstance(va, np.ndarray):
            assert np.array_equal(va, vb, equal_nan=va.dtype.kind == "f"), key
        else:
            assert va == vb or (isinstance(va, float) and math.isnan(va) and math.isnan(vb)), key


# ---- bit for bit -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_q8(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from finetune_files import write_files
    folder = write_files(tmp_path_factory.mktemp("chat"))
    base, tok = go.io.load_gguf(folder / "base.gguf")
    go.io.save_gguf(base, folder / "q8.gguf", tokenizer=tok, dtype="q8_0")
    return folder


def test_a_qlora_run_with_every_option_resumes_bit_for_bit(chat_q8, tmp_path, monkeypatch):
    # LoRA dropout, a Q8_0 base kept in its type, gradient checkpointing, packed
    # chats, a warmup-cosine schedule by step, 2 physical batches a step, bf16:
    # killed after its third mid-epoch checkpoint, resumed, it ends as the run
    # that was never stopped (parameters, moments, generator, history)
    from finetune_files import CHATML
    tok = ByteTokenizer(chat_template=CHATML)
    chats = [{"messages": [{"role": "user", "content": "Capital of Zorblax?"[:6 + i % 7]},
                           {"role": "assistant", "content": "Quimby."}]} for i in range(16)]

    def model():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m, _ = go.io.load_gguf(chat_q8 / "q8.gguf", keep_types=True)
        lora.apply(m, rank=4, dropout=0.2, targets="all-linear", seed=0)
        m.gradient_checkpointing_enable()
        return m

    def run(path, resume=False):
        m = model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # bf16: the kept base multiplies in float32
            go.fit(m, go.Dataset.from_chat(chats, tok, 128, packing=True), "cross_entropy",
                   go.schedules.WarmupCosine(2, 12, unit="step"), nepoch=2, nbatch_logical=2,
                   nbatch_physical=1, seed=3, checkpoint=path, resume=resume,
                   checkpoint_every=1, precision="bf16", drop_last=True, silent=True)
        return m

    assert go.Dataset.from_chat(chats, tok, 128, packing=True).ndata < len(chats)   # packed
    straight = run(tmp_path / "a.npz")
    restore = _interrupted_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        run(tmp_path / "b.npz")
    restore()
    resumed = run(tmp_path / "b.npz", resume=True)
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert np.array_equal(p.data, q.data), n
    _assert_same_files(tmp_path / "a.npz", tmp_path / "b.npz")


def test_the_finetune_command_killed_and_resumed_writes_the_same_adapter(chat_q8, tmp_path,
                                                                          monkeypatch):
    def args(ck, out):
        return ["-m", str(chat_q8 / "q8.gguf"), "--data", str(chat_q8 / "train.jsonl"),
                "--keep-types", "--gradient-checkpointing", "--lora-rank", "4",
                "--lora-dropout", "0.1", "-c", "128", "--packing", "--batch", "2",
                "--micro-batch", "1", "--epochs", "2", "-lr", "1e-2", "--lr-schedule",
                "cosine", "--warmup", "2", "--checkpoint", str(ck), "--checkpoint-every", "1",
                "-val-split", "0.25", "--eval-every", "2", "--out", str(out), "--silent"]

    assert finetune.main(args(tmp_path / "a.npz", tmp_path / "a.gguf")) == 0
    restore = _interrupted_after(monkeypatch, 2, KeyboardInterrupt)
    assert finetune.main(args(tmp_path / "b.npz", tmp_path / "b.gguf")) == 130
    restore()
    assert finetune.main(args(tmp_path / "b.npz", tmp_path / "b.gguf") + ["--resume"]) == 0
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    _assert_same_files(tmp_path / "a.npz", tmp_path / "b.npz")


def test_a_qlora_checkpoint_holds_the_adapters_only(chat_q8, tmp_path):
    m, _ = go.io.load_gguf(chat_q8 / "q8.gguf", keep_types=True)
    lora.apply(m, rank=4, seed=0)
    go.fit(m, _chat_tokens(), "cross_entropy", nbatch_logical=4, seed=0, silent=True,
           checkpoint=tmp_path / "c.npz", max_steps=1, nepoch=None)
    sd = load_state(tmp_path / "c.npz")
    adapters = sum(p.data.size for n, p in m.named_parameters() if ".lora_" in n)
    arrays = sum(v.size for k, v in sd.items() if k.split(".")[0] in
                 ("param", "grad", "adamw_m", "adamw_v"))
    assert arrays == 4 * adapters   # the adapters, their gradients and AdamW moments
    # beside them only small entries (a zip header each): no room for the base
    base = (chat_q8 / "q8.gguf").stat().st_size
    room = (tmp_path / "c.npz").stat().st_size - 4 * 4 * adapters
    assert room < 400 * len(sd) < base


def _chat_tokens():
    ids = np.random.default_rng(1).integers(0, 257, size=17 * 32 + 1).astype(np.int32)
    return go.Dataset.from_tokens(ids, 32, stride=32)


# ---- a resume into a model built otherwise -----------------------------------------------

def test_a_resume_over_other_frozen_base_weights_is_refused(tmp_path):
    # the adapters' names and shapes are those of any base of the architecture: the
    # checkpoint says which base weights they were trained over
    ck = tmp_path / "c.npz"
    go.fit(_adapted(seed=2), _tokens(), "cross_entropy", nbatch_logical=8, seed=1,
           silent=True, checkpoint=ck, max_steps=2, nepoch=None)
    other = _adapted(seed=7)   # another base
    before = [p.data.copy() for p in other.parameters()]
    with pytest.raises(ValueError, match="frozen_digest.*other frozen weights"):
        go.fit(other, _tokens(), "cross_entropy", nbatch_logical=8, seed=1, silent=True,
               checkpoint=ck, resume=True)
    assert all(np.array_equal(p.data, b) for p, b in zip(other.parameters(), before))
    with pytest.raises(ValueError, match="frozen_digest"):
        go.OptContext.load(ck, _adapted(seed=7))
    ctx = go.OptContext(_adapted(seed=7), loss_type="cross_entropy")
    with pytest.raises(ValueError, match="frozen_digest"):
        ctx.load_state_dict({k: v for k, v in load_state(ck).items()
                             if not k.startswith("fit.")})
    # the same base resumes; a state written before the entry loads as before
    go.fit(_adapted(seed=2), _tokens(), "cross_entropy", nbatch_logical=8, seed=1,
           silent=True, checkpoint=ck, resume=True)
    sd = {k: v for k, v in load_state(ck).items() if not k.startswith("fit.")}
    del sd["frozen_digest"]
    go.OptContext(_adapted(seed=7), loss_type="cross_entropy").load_state_dict(sd)


def test_a_resume_over_another_kept_base_file_of_the_same_type_is_refused(tmp_path):
    pytest.importorskip("gguf")
    cfg = LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    for seed in (0, 1):
        go.io.save_gguf(Llama(cfg, seed=seed), tmp_path / f"{seed}.gguf", dtype="q8_0",
                        tokenizer=ByteTokenizer())

    def run(seed, **kwargs):
        m, _ = go.io.load_gguf(tmp_path / f"{seed}.gguf", keep_types=True)
        lora.apply(m, rank=4, seed=0)
        go.fit(m, _chat_tokens(), "cross_entropy", nbatch_logical=4, seed=0, silent=True,
               checkpoint=tmp_path / "c.npz", **kwargs)

    run(0, max_steps=1, nepoch=None)
    with pytest.raises(ValueError, match="frozen_digest"):
        run(1, resume=True)
    run(0, resume=True)


@pytest.mark.parametrize("change, match", [
    ({"alpha": 4.0}, "alpha=8.0 dropout=0.0 over float32, this model has LoRA rank=4 alpha=4.0"),
    ({"dropout": 0.3}, ("dropout=0.0 over float32, this model has LoRA rank=4 alpha=8.0 "
                        "dropout=0.3")),
])
def test_optcontext_load_refuses_adapters_of_another_alpha_or_dropout(tmp_path, change, match):
    # fit refused them; OptContext.load of fit's checkpoint and of ctx.save's took them
    ck = tmp_path / "fit.npz"
    go.fit(_adapted(), _tokens(), "cross_entropy", nbatch_logical=8, seed=1, silent=True,
           checkpoint=ck)
    with pytest.raises(ValueError, match=match):
        go.OptContext.load(ck, _adapted(**change))
    ctx = go.OptContext(_adapted(), batch_size=8, ne_datapoint=8, loss_type="cross_entropy",
                        class_labels=True, inputs_dtype=np.int32)
    ds = _tokens()
    ctx.alloc(True)
    ctx.eval(None, ds.data[:8], ds.labels[:8])
    ctx.save(tmp_path / "ctx.npz")
    with pytest.raises(ValueError, match="model_info.*" + match):
        go.OptContext.load(tmp_path / "ctx.npz", _adapted(**change))
    go.OptContext.load(tmp_path / "ctx.npz", _adapted())   # the same adapters load


def test_adapters_on_other_layers_of_the_same_count_are_named(tmp_path):
    # q, k, v, o adapters against q, k, v, up: the same count and total of
    # parameters; the error named a norm "trainable in the state"
    ck = tmp_path / "c.npz"
    go.fit(_adapted(), _tokens(), "cross_entropy", nbatch_logical=8, seed=1, silent=True,
           checkpoint=ck)
    other = _adapted(targets=("q_proj", "k_proj", "v_proj", "up_proj"))
    with pytest.raises(ValueError, match=r"the state's parameter 6 is "
                                         r"'layers\.0\.self_attn\.o_proj\.lora_a', this "
                                         r"model's is 'layers\.0\.mlp\.up_proj\.lora_a'"):
        go.OptContext.load(ck, other)
    with pytest.raises(ValueError, match=r"o_proj\.lora_a', this model's is .*up_proj"):
        go.fit(other, _tokens(), "cross_entropy", nbatch_logical=8, seed=1, silent=True,
               checkpoint=ck, resume=True, nepoch=2)


def test_the_finetune_command_interrupted_without_a_checkpoint_says_so(chat_q8, monkeypatch,
                                                                       capsys, tmp_path):
    # Ctrl-C without --checkpoint raised TypeError (os.path.exists(None))
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(go, "fit", interrupted)
    assert finetune.main(["-m", str(chat_q8 / "base.gguf"), "--data",
                          str(chat_q8 / "train.jsonl"), "-c", "96", "--batch", "5",
                          "--out", str(tmp_path / "a.gguf"), "--silent"]) == 130
    assert "finetune: interrupted\n" in capsys.readouterr().err


def test_the_state_records_the_model_as_json(tmp_path):
    ctx = go.OptContext(_adapted(dropout=0.1), loss_type="cross_entropy")
    sd = ctx.state_dict()
    info = json.loads(sd["model_info"])
    assert info["layers.1.self_attn.v_proj"] == "LoRA rank=4 alpha=8.0 dropout=0.1 over float32"
    assert sd["frozen_digest"].startswith("crc-") and len(sd["frozen_digest"]) == 20


def test_a_base_that_differs_in_a_few_embedding_rows_is_another_base():
    # the digest sampled 16 stretches of 4 KiB an array: ten re-initialised rows of
    # an embedding between them resumed without a word
    cfg = LlamaConfig(vocab_size=4096, dim=16, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_dim=24, max_seq_len=16)

    def adapted():
        model = Llama(cfg, seed=2)
        lora.apply(model, rank=4, seed=0)
        return model

    sd = go.OptContext(adapted(), loss_type="cross_entropy").state_dict()
    other = adapted()
    table = other.embed_tokens.weight.data
    assert table.nbytes > 16 * 4096           # more than the stretches covered
    table[1000:1010] = np.random.default_rng(5).standard_normal((10, table.shape[1]))
    with pytest.raises(ValueError, match="frozen_digest.*other frozen weights"):
        go.OptContext(other, loss_type="cross_entropy").load_state_dict(sd)
    go.OptContext(adapted(), loss_type="cross_entropy").load_state_dict(sd)   # the same base


def test_a_state_with_the_older_sampled_digest_still_resumes(tmp_path):
    # states written before every byte counted hold 16 hex digits of the sampled
    # digest: they resume over their own base and not over another
    from ggmlopt.checkpoint import frozen_digest
    model = _adapted()
    ctx = go.OptContext(model, loss_type="cross_entropy")
    sd = ctx.state_dict()
    sd["frozen_digest"] = frozen_digest(model, ctx.frozen_parameters(), sampled=True)
    assert len(sd["frozen_digest"]) == 16
    go.OptContext(_adapted(), loss_type="cross_entropy").load_state_dict(sd)
    with pytest.raises(ValueError, match="frozen_digest"):
        go.OptContext(_adapted(seed=7), loss_type="cross_entropy").load_state_dict(sd)
