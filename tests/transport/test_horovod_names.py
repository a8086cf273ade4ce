"""hvdcomp.transport.horovod.name_unnamed_collectives' wrapper, in one process: an
unnamed collective gets "hvdcomp.unnamed.<k>" from a count of unnamed starts alone, a named
one keeps its name, wherever the name is passed (positionally, by keyword, or left to its
default).  The multi-rank behaviour: tests/mpi/worker_alongside.py (unnamed_in_backward)."""
import pytest

from hvdcomp.transport import horovod as hv


def _allgather_like(tensor, output, name, process_set=None):   # Horovod's signature
    return name


def _broadcast_like(tensor, output, root_rank, name=None, process_set=None):
    return name


def test_unnamed_collectives_are_numbered_and_named_ones_kept(monkeypatch):
    monkeypatch.setattr(hv, "_unnamed", iter(range(100)))
    ag, bc = hv._with_a_name(_allgather_like), hv._with_a_name(_broadcast_like)
    assert ag("t", "o", None) == "hvdcomp.unnamed.0"
    assert ag("t", "o", "metric") == "metric"                 # not counted
    assert ag("t", "o", name=None) == "hvdcomp.unnamed.1"
    assert bc("t", "o", 0) == "hvdcomp.unnamed.2"              # the default None
    assert bc("t", "o", 0, name="w") == "w"
    assert bc("t", "o", 0, None, "ps") == "hvdcomp.unnamed.3"
    assert ag.__name__ == "_allgather_like"


def test_every_start_function_of_horovod_takes_a_name():
    """The functions wrapped exist in this Horovod and have a ``name`` parameter."""
    ops = pytest.importorskip("horovod.torch.mpi_ops")
    import inspect
    for fn_name in hv._STARTERS:
        fn = getattr(ops, fn_name)
        assert "name" in inspect.signature(fn).parameters, fn_name
