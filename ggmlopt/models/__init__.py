"""Decoder-only language models: Llama and GPT2, and their configurations.

The models' parameter names are those of Hugging Face's checkpoints; their
Linear weights keep ggmlopt's (in, out) layout, the transpose of torch's.
"""
from ._causal_lm import CausalLM, KVCache
from .config import GPT2Config, LlamaConfig, llama_ffn_dim
from .gpt2 import GPT2
from .llama import Llama

__all__ = ["GPT2", "CausalLM", "GPT2Config", "KVCache", "Llama", "LlamaConfig", "llama_ffn_dim"]
