"""A count of the changes to the parts of a model that something keeps a
reading of: a decode step in one C call (models._decode_step) reads a block's
layers, their weights' arrays and their settings once, and checks this count
before each token instead of reading them all again (a few microseconds a
block, a tenth of a small model's token).

What counts: any attribute set on (or deleted from) a module marked as read
(``watch``), and any Parameter's ``data`` (or storage) assignment.  Arrays
changed in place do not count: the step reads them in place.  Nor does a class
attribute changed on the class (a layer class's default setting): a reader
that depends on one reads it again after the next counted change only."""
from __future__ import annotations

_version = 0


def parts_version() -> int:
    """The count of changes so far."""
    return _version


def parts_changed() -> None:
    global _version
    _version += 1


def watch(module) -> None:
    """Count every later attribute set on module (a Module) as a change."""
    object.__setattr__(module, "_parts_watched", True)
