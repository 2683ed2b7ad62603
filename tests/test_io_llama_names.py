"""The Llama <-> llama.cpp tensor names and the Q/K row permutation."""
import numpy as np
import pytest

from ggmlopt.io.llama_names import gguf_name, hf_name, permute_qk, unpermute_qk
from ggmlopt.models import Llama, LlamaConfig


def _convert_hf_permute(weights, n_head):
    # convert_hf_to_gguf.py's LlamaModel.permute, written out independently
    w = weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def test_every_llama_parameter_has_a_gguf_name_and_back():
    cfg = LlamaConfig(vocab_size=11, dim=8, n_layers=3, n_heads=2, ffn_dim=12, max_seq_len=8)
    names = [n for n, _ in Llama(cfg).named_parameters()]
    mapped = [gguf_name(n) for n in names]
    assert len(set(mapped)) == len(names)
    assert "blk.2.attn_q.weight" in mapped and "token_embd.weight" in mapped
    assert "output.weight" in mapped and "output_norm.weight" in mapped
    assert [hf_name(m) for m in mapped] == names


@pytest.mark.parametrize("bad", ["layers.0.self_attn.o_proj.bias", "wte.weight", "layers.x.mlp"])
def test_unknown_names_raise_key_error(bad):
    with pytest.raises(KeyError):
        gguf_name(bad)
    with pytest.raises(KeyError):
        hf_name("blk.0.attn_qkv.weight")


@pytest.mark.parametrize("n_heads,head_dim,cols", [(1, 2, 3), (3, 6, 5), (4, 8, 1), (2, 4, 7)])
def test_permutation_matches_convert_hf_to_gguf_and_inverts(n_heads, head_dim, cols):
    rows = np.random.default_rng(0).standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    permuted = permute_qk(rows, n_heads)
    np.testing.assert_array_equal(permuted, _convert_hf_permute(rows, n_heads))
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), rows)
    assert not np.shares_memory(permuted, rows)
    # within each head, llama.cpp's pair (2i, 2i+1) is Hugging Face's (i, i + head_dim/2)
    np.testing.assert_array_equal(permuted[1], rows[head_dim // 2])


def test_permutation_refuses_rows_not_split_in_head_pairs():
    with pytest.raises(ValueError, match="rows"):
        permute_qk(np.zeros((6, 2), np.float32), 2)
    with pytest.raises(ValueError, match="rows"):
        unpermute_qk(np.zeros((6,), np.float32), 4)
