"""Which ranks share a host: the topology of a hierarchical exchange.

Each rank names its host with a key the launcher gives (:meth:`Transport.host_key`):

* mpi: the world rank of rank 0 of MPI's ``COMM_TYPE_SHARED`` split (the ranks that can
  share memory, i.e. one host, whatever started them);
* torch: torchrun's ``GROUP_RANK`` (the node's number) when set, else the host name;
* horovod: Horovod's ``cross_rank()`` (its host number; Horovod's transport cannot make
  the sub-groups, so it is read only for the record).

Every rank's host count then comes from the keys themselves (``LOCAL_WORLD_SIZE`` or
Horovod's ``local_size`` are not consulted: the keys of all ranks say the same and more).

:func:`discover` allgathers the keys over the transport (one collective, every rank alike),
so every rank computes the same :class:`Topology`: hosts numbered in order of their lowest
rank, a rank's *local rank* its place among its host's ranks in rank order.

For tests on one machine, ``$HVDCOMP_TEST_HOSTS`` overrides the keys: a comma-separated
host label per world rank ("0,0,1,1": ranks 0 and 1 on one host, 2 and 3 on another).  It
exists for testing only; the sub-communicators are then built from it (ranks of one
"host" still talk over whatever the machine offers).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["Topology", "discover", "TEST_HOSTS_ENV"]

#: The test override (module docstring).
TEST_HOSTS_ENV = "HVDCOMP_TEST_HOSTS"


@dataclass(frozen=True)
class Topology:
    """``hosts[r]``: the host number of world rank r (0, 1, ... in order of each host's
    lowest rank).  ``rank``: this process's world rank."""
    hosts: tuple
    rank: int

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def host(self) -> int:
        """This rank's host number (also its rank among the ranks of its local rank)."""
        return self.hosts[self.rank]

    @property
    def host_count(self) -> int:
        return max(self.hosts) + 1 if self.hosts else 0

    def ranks_of(self, host: int) -> List[int]:
        """The world ranks of host ``host``, in rank order."""
        return [r for r, h in enumerate(self.hosts) if h == host]

    def local_rank_of(self, r: int) -> int:
        return self.ranks_of(self.hosts[r]).index(r)

    @property
    def local_rank(self) -> int:
        return self.local_rank_of(self.rank)

    @property
    def counts(self) -> List[int]:
        """Ranks per host, by host number."""
        return [len(self.ranks_of(h)) for h in range(self.host_count)]

    @property
    def equal(self) -> bool:
        """Every host has the same number of ranks."""
        return len(set(self.counts)) == 1

    @property
    def local_size(self) -> int:
        """Ranks per host (this rank's host's count)."""
        return len(self.ranks_of(self.host))

    def describe(self) -> str:
        c = self.counts
        if self.equal:
            return f"{len(c)} host(s) x {c[0]} rank(s)"
        return f"{len(c)} hosts with unequal rank counts {c}"

    @classmethod
    def from_keys(cls, keys: Sequence[str], rank: int) -> "Topology":
        """Hosts numbered in order of first appearance of their key."""
        num: dict = {}
        return cls(tuple(num.setdefault(k, len(num)) for k in keys), rank)


def _override(rank: int, size: int) -> Optional[str]:
    """This rank's host label from ``$HVDCOMP_TEST_HOSTS``, or None when unset.  ConfigError
    unless it names one host per rank."""
    text = os.environ.get(TEST_HOSTS_ENV, "").strip()
    if not text:
        return None
    labels = [x.strip() for x in text.split(",")]
    if len(labels) != size or not all(labels):
        raise ConfigError(f"${TEST_HOSTS_ENV}={text!r} must give one host label per rank "
                          f"({size} ranks), comma-separated (a test override)")
    return labels[rank]


def discover(transport) -> Topology:
    """The topology of ``transport``'s ranks (collective: one allgather of the host keys;
    every rank gets the same answer).  ``$HVDCOMP_TEST_HOSTS`` overrides the launcher's
    keys (module docstring)."""
    key = _override(transport.rank, transport.size)
    if key is None:
        key = "launcher:" + transport.host_key()
    else:
        key = "test:" + key
    got = transport.allgather(np.frombuffer(key.encode("utf-8"), dtype=np.uint8))
    keys = [bytes(g).decode("utf-8", "replace") for g in got]
    return Topology.from_keys(keys, transport.rank)
