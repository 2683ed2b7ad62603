"""The key-values a model's GGUF file says about itself (``general.*``: name,
license, author, base model, tags...; ``tokenizer.*``: special token ids, the
chat template, flags), carried from the file a model was read from into the
files written from it, so that a fine-tuned model goes back to llama.cpp
with what the original said.

What a writer computes itself is never carried: the architecture and its
hyperparameters (``<arch>.*``, from the model's config), the file type and
quantization version (from the tensors written), the alignment.  The
tokenizer's keys are carried only when the file is written with the same
vocabulary (the same tokens) and fill what the writer does not set itself
(padding and separator ids, add_eos, fill-in-the-middle ids...), never
one the written tokenizer holds itself and no longer has (a chat template,
an end-of-turn or padding id set to None after loading).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["GgufMetadata"]

# computed by the writer from the model and its tensors
_NOT_CARRIED = frozenset({"general.architecture", "general.file_type",
                          "general.quantization_version", "general.alignment"})
_ARRAY = 9   # GGUF's array value type
# tokenizer keys load_gguf reads into the tokenizer (its attribute): the writer
# writes the tokenizer's value, and where it holds none (cleared after loading)
# the source's key no longer describes the file, so it is not carried either
_HELD = {"tokenizer.chat_template": "chat_template",
         "tokenizer.ggml.eot_token_id": "eot_id", "tokenizer.ggml.eom_token_id": "eom_id",
         "tokenizer.ggml.padding_token_id": "pad_id",
         "tokenizer.ggml.unknown_token_id": "unk_id"}
_NAMED = "tokenizer.chat_template."   # tokenizer.chat_template.<name>: named_chat_templates


class GgufMetadata(Mapping[str, Any]):
    """A read-only mapping of the carried keys to their values (str, int,
    float, bool or list), each with its GGUF value type (``type_of``), as
    ``model.gguf_metadata`` holds them after ``load_gguf``."""

    def __init__(self, values: Mapping[str, Any], types: Mapping[str, tuple[int, int | None]],
                 file_type: int | None = None):
        self._values = dict(values)
        self._types = {k: types[k] for k in self._values}
        # the source's general.file_type (not carried: a writer labels what it
        # writes, with this label when it writes the source's weights as they were)
        self.file_type = file_type

    @classmethod
    def from_file(cls, file) -> GgufMetadata:
        """The carried keys of a GgufFile (ggmlopt.io.gguf_reader)."""
        keep = [k for k in file.fields
                if k.startswith(("general.", "tokenizer.")) and k not in _NOT_CARRIED]
        file_type = file.fields.get("general.file_type")
        return cls({k: file.fields[k] for k in keep}, file.field_types,
                   file_type if isinstance(file_type, int) else None)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"GgufMetadata({len(self)} keys: {', '.join(list(self)[:6])}{', ...' if len(self) > 6 else ''})"

    def type_of(self, key: str) -> tuple[int, int | None]:
        """(GGUF value type, an array's item type or None) of key."""
        return self._types[key]

    def add_to(self, writer, tokens: list[str], tokenizer=None) -> list[str]:
        """Add to a gguf-py GGUFWriter every carried key it does not hold yet;
        the tokenizer's only when tokens (the written vocabulary) are the
        source's, and none that tokenizer (the one written) holds itself: its
        chat templates, end-of-turn, padding and unknown ids, which it may have
        dropped since it was read.  Returns the keys added."""
        import gguf
        same_vocabulary = self._values.get("tokenizer.ggml.tokens") == list(tokens)
        written = set().union(*(set(kv) for kv in writer.kv_data))
        added = []
        for key, value in self._values.items():
            if key in written or (key.startswith("tokenizer.") and not same_vocabulary) \
                    or _dropped_by(tokenizer, key):
                continue
            vtype, item = self._types[key]
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                 gguf.GGUFValueType(item) if vtype == _ARRAY and item is not None
                                 else None)
            added.append(key)
        return added


def _dropped_by(tokenizer, key: str) -> bool:
    """Whether tokenizer holds key's value itself and holds none: a source's key
    it was read from and no longer has (the writer writes the ones it has)."""
    if tokenizer is None:
        return False
    if key == "tokenizer.chat_templates" or key.startswith(_NAMED):
        named = getattr(tokenizer, "named_chat_templates", None)
        return hasattr(tokenizer, "named_chat_templates") and \
            (key == "tokenizer.chat_templates" or key[len(_NAMED):] not in (named or {}))
    attribute = _HELD.get(key)
    if attribute is None or not hasattr(tokenizer, attribute):
        return False
    from ..hf_tokenizer import HFTokenizer
    if isinstance(tokenizer, HFTokenizer) and attribute in ("eot_id", "eom_id"):
        return False   # a Hugging Face tokenizer has no such ids: the file's stand
    return getattr(tokenizer, attribute) is None
