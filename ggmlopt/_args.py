"""Argument checks shared by the Python layer: each raises TypeError or
ValueError naming the argument and what was expected."""
from __future__ import annotations

import enum
import numbers
from typing import Literal, TypeVar, overload

import numpy as np

E = TypeVar("E", bound=enum.IntEnum)


@overload
def int_arg(value: object, name: str, minimum: int, allow_none: Literal[False] = ...) -> int: ...
@overload
def int_arg(value: object, name: str, minimum: int, allow_none: bool) -> int | None: ...
def int_arg(value: object, name: str, minimum: int, allow_none: bool = False) -> int | None:
    """value as an int >= minimum (None passes through when allow_none)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


@overload
def bool_arg(value: object, name: str, allow_none: Literal[False] = ...) -> bool: ...
@overload
def bool_arg(value: object, name: str, allow_none: bool) -> bool | None: ...
def bool_arg(value: object, name: str, allow_none: bool = False) -> bool | None:
    """value as a bool (a Python or NumPy bool; None passes through when
    allow_none): a string such as "no" is refused, not taken as true."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool{' or None' if allow_none else ''}, got "
                        f"{type(value).__name__}")
    return bool(value)


def enum_arg(value: object, enum_cls: type[E], name: str) -> E:
    """value as a member of the IntEnum enum_cls: a member, its int value, or its
    name as a string in any case ("cross_entropy" for LossType.CROSS_ENTROPY)."""
    names = [m.name for m in enum_cls]
    if isinstance(value, str):
        member = enum_cls.__members__.get(value.strip().upper())
        if member is None:
            raise ValueError(f"{name}: expected one of {names} (any case), got {value!r}")
        return member
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a {enum_cls.__name__} or one of its names, got "
                        f"{type(value).__name__}")
    try:
        return enum_cls(int(value))
    except ValueError:
        raise ValueError(f"{name}: expected one of {names}, got {value!r}") from None
