"""Models that leave ggmlopt, and come back: GGUF (ggml's format, loaded by
ggml's own programs) and safetensors in torch's layout.

    ggmlopt.io.save_gguf(model, "model.gguf", arch="mnist-fc")
    ggmlopt.io.load_gguf("model.gguf", model)
    ggmlopt.io.save_gguf(llama, "llama.gguf", tokenizer=tok)   # llama.cpp loads it
    llama, tok = ggmlopt.io.load_gguf("llama.gguf")            # and llama.cpp's files
    tok = ggmlopt.io.load_gguf_tokenizer("llama.gguf")         # the tokenizer alone
    ggmlopt.io.save_safetensors(model, "model.safetensors")   # torch's state_dict
    ggmlopt.io.load_safetensors("model.safetensors", model)
    ggmlopt.io.save_hf(llama, "checkpoint/")    # transformers' from_pretrained loads it
    llama = ggmlopt.io.load_hf("checkpoint/")   # and save_pretrained's directories
    ggmlopt.io.save_gguf_lora(llama, "adapter.gguf")   # llama.cpp's --lora
    ggmlopt.io.load_gguf_lora("adapter.gguf", llama)
    ggmlopt.io.save_peft(llama, "adapter/")   # PEFT's PeftModel.from_pretrained loads it
    ggmlopt.io.load_peft("adapter/", llama)   # and an adapter PEFT saved

Tensor names come from ``ggmlopt.nn.named_parameters``.  The ``gguf`` and
``safetensors`` packages are the ``interop`` extra (``pip install
ggmlopt[interop]``), imported only when a function here needs them.
"""
from .gguf_format import GENERIC_ARCH, load_gguf, save_gguf
from .gguf_llama import load_gguf_tokenizer
from .gguf_lora import load_gguf_lora, save_gguf_lora
from .hf_format import load_hf, save_hf
from .peft_format import load_peft, save_peft
from .safetensors_format import load_safetensors, save_safetensors

__all__ = ["GENERIC_ARCH", "load_gguf", "load_gguf_lora", "load_gguf_tokenizer", "load_hf",
           "load_peft", "load_safetensors", "save_gguf", "save_gguf_lora", "save_hf", "save_peft",
           "save_safetensors"]
