"""Freezing a layer's parameter (requires_grad = False) in the layer tests."""
from ggmlopt.nn import Parameter


class _FrozenParameter(Parameter):
    """A Parameter that can hold requires_grad, for builds whose Parameter
    has no such attribute yet (the layers read it with getattr)."""

    __slots__ = ("requires_grad",)


def freeze(owner, attr):
    """Set requires_grad False on owner.<attr> (replacing it by a parameter that
    can hold the flag when Parameter cannot)."""
    p = getattr(owner, attr)
    try:
        p.requires_grad = False
    except AttributeError:
        q = _FrozenParameter(p.data, name=p.name)
        q.requires_grad = False
        setattr(owner, attr, q)
