"""Decoder-only language models: their configurations (LlamaConfig, GPT2Config).

The models' parameter names are those of Hugging Face's checkpoints; their
Linear weights keep ggmlopt's (in, out) layout, the transpose of torch's.
"""
from .config import GPT2Config, LlamaConfig, llama_ffn_dim

__all__ = ["GPT2Config", "LlamaConfig", "llama_ffn_dim"]
