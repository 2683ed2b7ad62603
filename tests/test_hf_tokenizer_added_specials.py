"""Whether a Hugging Face tokenizer adds BOS and EOS when tokenizer_config.json's
add_bos_token / add_eos_token disagree with tokenizer.json's post-processor:
transformers (5) adds what the post-processor adds, whatever the keys say, and
llama.cpp's converter (gguf-py's SpecialVocab) opts for the post-processor too;
the keys decide only where the post-processor says nothing."""
import importlib
import json
import os
import sys
import warnings

import pytest
from llama_cpp_source import SRC

tokenizers = pytest.importorskip("tokenizers")

from ggmlopt.hf_tokenizer import load_hf_tokenizer

VOCAB = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
POSTS = ["bos", "eos", "both", "bytelevel", "bytelevel+bos", "plain-template", None]
KEYS = [True, False, None]


def _post_processor(kind):
    p = tokenizers.processors
    bos, eos = ("<s>", 0), ("</s>", 1)
    return {
        "bos": lambda: p.TemplateProcessing(single="<s> $A", special_tokens=[bos]),
        "eos": lambda: p.TemplateProcessing(single="$A </s>", special_tokens=[eos]),
        "both": lambda: p.TemplateProcessing(single="<s> $A </s>", special_tokens=[bos, eos]),
        "bytelevel": lambda: p.ByteLevel(trim_offsets=False),
        "bytelevel+bos": lambda: p.Sequence([p.ByteLevel(trim_offsets=False),
                                             p.TemplateProcessing(single="<s> $A",
                                                                  special_tokens=[bos])]),
        "plain-template": lambda: p.TemplateProcessing(single="$A", special_tokens=[]),
        None: lambda: None,
    }[kind]()


def _directory(tmp_path, post, add_bos, add_eos):
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=VOCAB, merges=[("a", "b")]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.add_special_tokens([tokenizers.AddedToken("<s>", special=True),
                           tokenizers.AddedToken("</s>", special=True)])
    processor = _post_processor(post)
    if processor is not None:
        tk.post_processor = processor
    d = tmp_path / f"{post}-{add_bos}-{add_eos}"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>"}
    for key, value in (("add_bos_token", add_bos), ("add_eos_token", add_eos)):
        if value is not None:
            config[key] = value
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


def _gguf_rule(post, key, end):
    """gguf-py's SpecialVocab, spelled out: a special token the post-processor puts
    at that end says yes, a ByteLevel post-processor no, else the config's key."""
    if post in ("both", end, "bytelevel+bos" if end == "bos" else ""):
        return True
    if post in ("bytelevel", "bytelevel+bos"):
        return False
    return bool(key)


@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize("add_bos", KEYS)
@pytest.mark.parametrize("add_eos", KEYS)
def test_the_post_processor_decides_where_it_says_something(tmp_path, post, add_bos, add_eos):
    tok = load_hf_tokenizer(_directory(tmp_path, post, add_bos, add_eos))
    assert tok.add_bos is _gguf_rule(post, add_bos, "bos")
    assert bool(tok.add_eos) is _gguf_rule(post, add_eos, "eos")


@pytest.mark.parametrize("post", [p for p in POSTS if p not in (None, "plain-template")])
@pytest.mark.parametrize("add_bos", KEYS)
@pytest.mark.parametrize("add_eos", KEYS)
def test_as_transformers_adds_them(tmp_path, post, add_bos, add_eos):
    # at an end the post-processor decides, transformers adds the token exactly
    # where ggmlopt's add_bos / add_eos say (at an end a template leaves without a
    # special token, transformers adds none and llama.cpp's converter reads the
    # key: ggmlopt follows the converter there)
    transformers = pytest.importorskip("transformers")
    d = _directory(tmp_path, post, add_bos, add_eos)
    tok = load_hf_tokenizer(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = transformers.AutoTokenizer.from_pretrained(d)("ab")["input_ids"]
    body = tok.encode("ab").tolist()
    at = want.index(body[0])
    assert want[at:at + len(body)] == body
    if post != "eos":
        assert bool(want[:at]) is tok.add_bos and want[:at] in ([], [tok.bos_id])
    if post != "bos":
        assert bool(want[at + len(body):]) is bool(tok.add_eos)


@pytest.mark.skipif(not SRC, reason="GGMLOPT_LLAMA_CPP_SRC (llama.cpp's source) is not set")
@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize("add_bos", KEYS)
def test_as_llama_cpps_converter_reads_them(tmp_path, post, add_bos):
    # the gguf-py of this llama.cpp, not the one on PyPI (an older one let the key win)
    sys.path.insert(0, os.path.join(SRC, "gguf-py"))
    saved = {k: m for k, m in sys.modules.items() if k == "gguf" or k.startswith("gguf.")}
    for k in saved:
        del sys.modules[k]
    try:
        vocab = importlib.import_module("gguf.vocab")
        d = _directory(tmp_path, post, add_bos, add_bos)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            special = vocab.SpecialVocab(d, load_merges=False).add_special_token
    finally:
        sys.path.remove(os.path.join(SRC, "gguf-py"))
        for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    tok = load_hf_tokenizer(d)
    for end, ours in (("bos", tok.add_bos), ("eos", bool(tok.add_eos))):
        if end in special:   # (unset: llama.cpp's default for the vocabulary type)
            assert ours is special[end], end
