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
(padding and separator ids, add_eos, fill-in-the-middle ids...).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["GgufMetadata"]

# computed by the writer from the model and its tensors
_NOT_CARRIED = frozenset({"general.architecture", "general.file_type",
                          "general.quantization_version", "general.alignment"})
_ARRAY = 9   # GGUF's array value type


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

    def add_to(self, writer, tokens: list[str]) -> list[str]:
        """Add to a gguf-py GGUFWriter every carried key it does not hold yet;
        the tokenizer's only when tokens (the written vocabulary) are the
        source's.  Returns the keys added."""
        import gguf
        same_vocabulary = self._values.get("tokenizer.ggml.tokens") == list(tokens)
        written = set().union(*(set(kv) for kv in writer.kv_data))
        added = []
        for key, value in self._values.items():
            if key in written or (key.startswith("tokenizer.") and not same_vocabulary):
                continue
            vtype, item = self._types[key]
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                 gguf.GGUFValueType(item) if vtype == _ARRAY and item is not None
                                 else None)
            added.append(key)
        return added
