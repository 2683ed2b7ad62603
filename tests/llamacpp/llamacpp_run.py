"""llama.cpp (through llama-cpp-python) run as the tests compare with it: every
position's logits, one thread, and a float32 KV cache (the default float16 one
is worth about 2e-4 of the logits)."""
import numpy as np

F32 = 0   # GGML_TYPE_F32, for llama.cpp's KV cache


def open_llama(path, adapter=None, n_ctx=64):
    """A llama_cpp.Llama over the GGUF at path, with the LoRA adapter file adapter
    applied when given."""
    import llama_cpp
    kw = {"lora_path": str(adapter)} if adapter is not None else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           logits_all=True, type_k=F32, type_v=F32, n_threads=1,
                           verbose=False, **kw)


def logits_of(llm, ids):
    """llm's logits at every position of ids, float64 (len(ids), vocab)."""
    llm.reset()
    llm.eval([int(i) for i in ids])
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def relative(a, b):
    """The largest difference of a from b over b's largest magnitude."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def eight_bit_error(model, ids):
    """How far rounding every matrix of the float model to Q8_0 moves its logits at
    ids: the scale of the error llama.cpp's 8-bit activations add over a Q8_0 file."""
    import copy

    import gguf
    rounded = copy.deepcopy(model)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, p in rounded.named_parameters():
        if p.data.ndim == 2:
            rows = p.data if name == "embed_tokens.weight" else p.data.T
            r = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), q8), q8)
            p.data[...] = r if name == "embed_tokens.weight" else r.T
    return relative(rounded(ids[None])[0], model(ids[None])[0])
