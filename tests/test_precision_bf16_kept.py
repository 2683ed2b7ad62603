"""precision="bf16" over a base kept in its file's types (QLoRA): the kept
blocks multiply in float32 and the adapters' products stay float32, so such a
model has no bf16 product at all; the context says so instead of training in
float32 silently under a bf16 setting."""
import warnings

import numpy as np
import pytest

import ggmlopt as go
from ggmlopt import gemm, lora
from ggmlopt.models import Llama, LlamaConfig

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gemm.bf16_support()[0],
                                reason=f"no native bf16 products: {gemm.bf16_support()[1]}")

NOTHING = "nothing in this model multiplies in bf16"


def _kept(tmp_path, tie):
    from ggmlopt.io import load_gguf, save_gguf
    from ggmlopt.text import ByteTokenizer
    model = Llama(LlamaConfig(vocab_size=257, dim=64, n_layers=1, n_heads=2, ffn_dim=64,
                              max_seq_len=16, tie_embeddings=tie), seed=0)
    save_gguf(model, tmp_path / "q8.gguf", tokenizer=ByteTokenizer(), dtype="q8_0")
    kept, _ = load_gguf(tmp_path / "q8.gguf", keep_types=True)
    return kept


def _messages(model):
    ids = np.random.default_rng(0).integers(0, 257, (4, 17)).astype(np.int32)
    ds = go.Dataset.from_arrays(ids[:, :-1], ids[:, 1:])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        go.fit(model, ds, "cross_entropy", nepoch=1, nbatch_logical=4, silent=True,
               precision="bf16")
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("tie", [False, True])
def test_a_kept_base_under_lora_says_it_has_no_bf16_product(tmp_path, tie):
    kept = _kept(tmp_path, tie)
    lora.apply(kept, rank=4, targets="all-linear")
    assert any(NOTHING in m for m in _messages(kept))


def test_a_float32_base_under_lora_multiplies_in_bf16_and_says_nothing(tmp_path):
    model = Llama(LlamaConfig(vocab_size=257, dim=64, n_layers=1, n_heads=2, ffn_dim=64,
                              max_seq_len=16), seed=0)
    lora.apply(model, rank=4)
    assert not any(NOTHING in m for m in _messages(model))


def test_a_float32_layer_beside_a_kept_base_multiplies_in_bf16(tmp_path):
    """An adapter merged back (a float32 Linear) is multiplied in bf16: no warning."""
    kept = _kept(tmp_path, False)
    lora.apply(kept, rank=4, targets=("q_proj", "v_proj"))
    lora.merge(kept)   # q_proj and v_proj come back as float32 Linear layers
    lora.apply(kept, rank=4, targets=("k_proj",))
    assert not any(NOTHING in m for m in _messages(kept))
