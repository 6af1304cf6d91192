"""Value checks shared by the profile types' ``__post_init__`` (ranges, finiteness, lists).

Each returns the normalised value or raises ``ValueError`` reading
``<field>: expected <what>, got <value>``. They run on direct construction too, where no
schema loader has seen the values, so they also reject values of the wrong type.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import TypeVar

_T = TypeVar("_T")

INF_SPELLINGS = frozenset({"inf", ".inf", "+inf"})
"""Text read as an infinite bandwidth (``to_dict`` writes ``"inf"`` to stay strict JSON)."""


def fail(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {value!r}")


def integer(name: str, value: object, *, minimum: int, expected: str) -> int:
    # bool is an int subclass; `True` as a rank or a byte count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise fail(name, expected, value)
    return int(value)


def real(
    name: str,
    value: object,
    *,
    expected: str,
    minimum: float = 0.0,
    strict: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number >= ``minimum`` (> if ``strict``); ``"inf"`` text is read when ``allow_inf``."""
    number: float
    if isinstance(value, str) and allow_inf and value.strip().lower() in INF_SPELLINGS:
        number = math.inf
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail(name, expected, value)
    else:
        number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise fail(name, expected, value)
    if number < minimum or (strict and number == minimum):
        raise fail(name, expected, value)
    return number


def text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(name, "a non-empty string", value)
    return value


def sequence(name: str, value: object, item: Callable[[str, object], _T]) -> tuple[_T, ...]:
    """A list or tuple (not a string), each entry checked by ``item(name[i], entry)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise fail(name, "a list", value)
    return tuple(item(f"{name}[{index}]", entry) for index, entry in enumerate(value))


def seconds(name: str, value: object) -> float:
    return real(name, value, expected="a non-negative finite number of seconds")


def byte_count(name: str, value: object) -> int:
    return integer(name, value, minimum=0, expected="a non-negative integer")


def set_field(obj: object, name: str, value: object) -> None:
    """Set a field of a frozen dataclass (its ``__post_init__`` normalises lists to tuples)."""
    object.__setattr__(obj, name, value)
