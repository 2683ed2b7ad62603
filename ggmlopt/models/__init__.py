"""Decoder-only language models: Llama, Mistral, Phi-3, Qwen2, Qwen3, SmolLM3, Gemma,
Gemma 2, Gemma 3 and GPT2, and their configurations.

The models' parameter names are those of Hugging Face's checkpoints; their
Linear weights keep ggmlopt's (in, out) layout, the transpose of torch's.
"""
from ._causal_lm import CausalLM, KVCache
from .config import GPT2Config, LlamaConfig, llama_ffn_dim
from .gemma import Gemma, GemmaConfig
from .gemma2 import Gemma2, Gemma2Config
from .gemma3 import Gemma3, Gemma3Config
from .gpt2 import GPT2
from .llama import Llama
from .mistral import Mistral, MistralConfig
from .phi3 import Phi3, Phi3Config
from .qwen2 import Qwen2, Qwen2Config
from .qwen3 import Qwen3, Qwen3Config
from .smollm3 import SmolLM3, SmolLM3Config

__all__ = ["GPT2", "CausalLM", "GPT2Config", "Gemma", "Gemma2", "Gemma2Config", "Gemma3",
           "Gemma3Config", "GemmaConfig", "KVCache", "Llama", "LlamaConfig", "Mistral",
           "MistralConfig", "Phi3", "Phi3Config", "Qwen2",
           "Qwen2Config", "Qwen3", "Qwen3Config", "SmolLM3", "SmolLM3Config", "llama_ffn_dim"]
