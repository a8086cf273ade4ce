"""Tables made from the registry: the codec table of docs/wire-format.md (checked by
tests/unit/test_codec_ids.py, which prints the table to paste when they differ).

Only what the registry holds goes in (each class's name, wire id and example spec), so a
compressor added with ``@register(name, codec=ID)`` appears without any other edit here.
"""
from __future__ import annotations

from typing import List, Tuple

from ..wire import BUILTIN_CODECS, CODECS
from .base import registry

__all__ = ["codec_rows", "wire_codec_table", "BEGIN", "END"]

# the lines around the generated table in docs/wire-format.md
BEGIN = "<!-- codec table: generated from the registry (hvdcomp.compressors.listing) -->"
END = "<!-- end of codec table -->"

# wire codecs that are not compressors, with what sends them
_NOT_COMPRESSORS = {"coo": "a sparse gradient's indices and values, uncompressed "
                           "(`hvdcomp/exchange/coo.py`)"}


def codec_rows(builtin_only: bool = True) -> List[Tuple[int, str, str]]:
    """(id, name, what) of every wire codec, by id: each registered compressor (what: its
    class and example spec) and the codecs that no compressor sends.  ``builtin_only``:
    hvdcomp's own ids (1..127) only."""
    rows = []
    for name, cls in registry().items():
        if builtin_only and cls.codec not in BUILTIN_CODECS:
            continue
        rows.append((cls.codec, name, f"`{cls.__module__}.{cls.__qualname__}`, e.g. "
                                      f"`{cls.example or name}`"))
    for name, what in _NOT_COMPRESSORS.items():
        rows.append((CODECS[name], name, what))
    return sorted(rows)


def wire_codec_table() -> str:
    """The markdown table of hvdcomp's codec ids, between :data:`BEGIN` and :data:`END`."""
    lines = [BEGIN, "| id | codec | sent by |", "|---|---|---|"]
    lines += [f"| {i} | `{n}` | {what} |" for i, n, what in codec_rows()]
    return "\n".join(lines + [END])
