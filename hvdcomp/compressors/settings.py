"""Validators for compressor settings: one meaning of bool, int, float and choice.

Every compressor's ``__init__`` validates each argument with these and stores it under its
own name (``self.bits = integer("bits", bits, 2, 8)``): ``spec()``, ``repr`` and the ranks'
agreement handshake read the settings back by those names.  The same functions convert the
strings of a spec (``"alq:bits=3,entropy=1"``), so a value means the same whether it comes
from Python or from a spec string.  Each raises ValueError (TypeError for a wrong type) with
the setting's name.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Tuple

__all__ = ["boolean", "integer", "real", "choice", "int_tuple", "TRUE", "FALSE"]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def boolean(name: str, v: Any) -> bool:
    """True/False, 1/0, or one of the strings in TRUE/FALSE (any case)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        low = v.strip().lower()
        if low in TRUE:
            return True
        if low in FALSE:
            return False
    elif isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ValueError(f"{name} must be a bool (True/False, 1/0, yes/no, on/off), got {v!r}")


def integer(name: str, v: Any, lo: int = -2**63, hi: int = 2**63 - 1) -> int:
    """An integer (or a string holding one) in lo..hi; bools are refused."""
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}") from None
    if not lo <= i <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {i}")
    return int(i)


def real(name: str, v: Any, lo: float = -math.inf, hi: float = math.inf, *,
         lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite float (or a string holding one) in [lo, hi] (open ends where asked)."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be a number, got bool")
    try:
        f = float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    if f < lo or f > hi or (lo_open and f == lo) or (hi_open and f == hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}"
                         f"{')' if hi_open else ']'}, got {f}")
    return f


def choice(name: str, v: Any, options: Iterable[str]) -> str:
    """One of ``options`` (strings; compared after strip and lower-casing)."""
    opts = tuple(options)
    s = v.strip().lower() if isinstance(v, str) else v
    if s not in opts:
        raise ValueError(f"{name} must be one of {', '.join(map(str, opts))}, got {v!r}")
    return s


def int_tuple(name: str, v: Any, lo: int = -2**63, hi: int = 2**63 - 1) -> Tuple[int, ...]:
    """A tuple of integers: a sequence, or a string "a/b/c" (also "a+b", "a b")."""
    if isinstance(v, str):
        v = v.replace("/", " ").replace("+", " ").split()
    try:
        items = tuple(v)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of integers, got {v!r}") from None
    return tuple(integer(f"{name}[{i}]", x, lo, hi) for i, x in enumerate(items))
