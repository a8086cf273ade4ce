"""Validators for compressor settings: one meaning for each kind of value.

Every compressor's ``__init__`` validates each argument with these and stores it under its
own name (``self.bits = integer("bits", bits, 2, 8)``): ``spec()``, ``repr`` and the ranks'
agreement handshake read the settings back by those names.

Two doors, one meaning:

* Python values must already have the setting's type: a flag is a ``bool`` (``1`` or
  ``"no"`` are refused rather than guessed), a count an ``int`` (not a bool, float or
  string), a real an ``int`` or ``float``.  Anything else raises ValueError naming the
  setting.
* Spec strings (``"alq:bits=3,entropy=1"``) are converted by :func:`parse` first, where a
  flag is one of TRUE / FALSE (any case), then validated by the same functions.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Tuple

__all__ = ["boolean", "integer", "real", "choice", "int_tuple", "parse", "TRUE", "FALSE"]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def boolean(name: str, v: Any) -> bool:
    """A flag: ``True`` or ``False`` (NumPy bools too)."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    raise ValueError(f"{name} must be True or False, got {v!r}")


def integer(name: str, v: Any, lo: int = -2**63, hi: int = 2**63 - 1) -> int:
    """An ``int`` (NumPy integers too; bools refused) in lo..hi."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {v}")
    return int(v)


def real(name: str, v: Any, lo: float = -math.inf, hi: float = math.inf, *,
         lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite ``int`` or ``float`` (bools refused) in [lo, hi] (open ends where asked)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    if f < lo or f > hi or (lo_open and f == lo) or (hi_open and f == hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}"
                         f"{')' if hi_open else ']'}, got {f}")
    return f


def choice(name: str, v: Any, options: Iterable[str]) -> str:
    """One of ``options`` (strings)."""
    opts = tuple(options)
    if not isinstance(v, str) or v not in opts:
        raise ValueError(f"{name} must be one of {', '.join(opts)}, got {v!r}")
    return v


def int_tuple(name: str, v: Any, lo: int = -2**63, hi: int = 2**63 - 1) -> Tuple[int, ...]:
    """A tuple (or list) of integers in lo..hi."""
    if not isinstance(v, (tuple, list)):
        raise ValueError(f"{name} must be a tuple of integers, got {v!r}")
    return tuple(integer(f"{name}[{i}]", x, lo, hi) for i, x in enumerate(v))


def parse(name: str, raw: str, like: Any) -> Any:
    """A spec string's value converted to the type of ``like`` (the setting's default):
    bool (TRUE / FALSE, any case), int, float, tuple of ints ("a/b/c"), else the string.
    Raises ValueError when the string does not hold such a value."""
    s = raw.strip()
    try:
        if isinstance(like, bool):
            if s.lower() in TRUE:
                return True
            if s.lower() in FALSE:
                return False
            raise ValueError
        if isinstance(like, int):
            return int(s)
        if isinstance(like, float):
            return float(s)
        if isinstance(like, tuple):
            return tuple(int(x) for x in s.replace("/", " ").replace("+", " ").split())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {type(like).__name__}") from None
    return s
