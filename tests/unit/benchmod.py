"""Import a module of bench/ from a test without leaving bench/ on sys.path or bench's
``common`` in sys.modules (tests/mpi and tests/exchange import a ``common`` of their own,
and whichever is imported first would shadow the other at collection)."""
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "bench")


def import_bench(name: str):
    """bench/NAME.py as a module (imported once; later calls return the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    saved = sys.modules.pop("common", None)
    sys.path.insert(0, BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCH)
        sys.modules.pop("common", None)
        if saved is not None:
            sys.modules["common"] = saved
