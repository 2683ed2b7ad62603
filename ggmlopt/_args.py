"""Argument checks shared by the Python layer: each raises TypeError or
ValueError naming the argument and what was expected."""
import numbers


def int_arg(value, name, minimum, allow_none=False):
    """value as an int >= minimum (None passes through when allow_none)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def enum_arg(value, enum_cls, name):
    """value as a member of the IntEnum enum_cls."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a {enum_cls.__name__}, got {type(value).__name__}")
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(f"{name}: expected one of {[m.name for m in enum_cls]}, "
                         f"got {value!r}") from None
