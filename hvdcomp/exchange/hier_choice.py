"""Auto's choice between the flat and the hierarchical exchange (``hierarchy="auto"`` with an
:class:`hvdcomp.Auto`), from measured costs.

Where the hosts allow the hierarchical exchange (:func:`~.hier.plan_hierarchy`), Auto
calibrates the two links it would use as it calibrates the flat one (:mod:`hvdcomp.auto`,
:func:`~hvdcomp.auto.measure_link`): inside the host (the host's allgather and
all-to-all, every host at once) and across hosts (the allgather, and the all-to-all when the
reduce-scatter may carry the pieces, among the ranks of one local rank; all ``L`` such
groups at once, as they share the host's network link in the exchange).  Every value is
the slowest rank's of the whole job, so every rank decides alike.

Per tensor of ``n`` float32 elements that Auto plans (:meth:`hvdcomp.Auto.make_plan`), on
``H`` hosts of ``L`` ranks, without the collectives' latencies (a bucket pays those once):

    flat           f(n) = the cheapest flat path Auto allows (its CostModel.seconds)
    hierarchical   h(n) = b_aa,host * 4n                       (1: the host's reduce-scatter)
                        + C_cross(n / L)                       (2: compressed across hosts)
                        + b_ag,host * 4n / L                   (3: the host's allgather)

with C_cross the compressor's path across hosts (over the allgather, or the reduce-scatter
when that is the collective setting) priced by :class:`hvdcomp.auto.CostModel` on the
cross-host link with ``H`` ranks and the compressor's measured encode/decode costs.  The
float32 sums of step 1 are not counted (one add per element, against an encode of several).
In the hierarchical exchange a tensor may still take fp32 or fp16 over the flat allreduce,
so

    T_flat = sum_n f(n) + B * latencies of the flat paths used
    T_hier = sum_n min(fp32(n), fp16(n), h(n)) + B * latencies of the paths used

(``B`` fusion buckets; the hierarchical path's latencies: the host's all-to-all and
allgather and the cross-host collective).  The exchange is hierarchical when
``T_hier < T_flat``, with the tensors whose cheapest path is ``h`` over it; the decision
and its reason are logged once (INFO, rank 0; the links' numbers at DEBUG) and kept as a
:class:`HierChoice` (``Exchange.hierarchy_choice``, the doors' ``hierarchy_choice``).

No paper: the arithmetic of the hierarchical schemes (e.g. Horovod's hierarchical
allreduce; Agarwal et al., MLSys 2022, for the "does it pay?" question) with measured costs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..auto import (CHOICES, LINK_LARGE_MAX, LINK_LARGE_MIN, Auto, CodecCost, CostModel,
                    LinkCost, measure_link, slowest_over_ranks)
from ..compressors import get
from ..log import logger
from ..transport import Transport
from .plan import collectives, keep_range, wire_dtype

__all__ = ["HierChoice", "hier_seconds", "decide", "measure_hier", "settle"]


@dataclass
class HierChoice:
    """Auto's flat-or-hierarchical decision.  hierarchical: the exchange's choice; reason:
    one sentence; flat_s / hier_s: the predicted seconds of one step's exchange of the
    planned tensors each way; host / cross: the measured link costs inside a host and
    across hosts; hosts, ranks_per_host: the topology; across: the compressor's collective
    across hosts; paths: {tensor: "none", "fp16" or "hierarchical"} in the hierarchical
    exchange (empty when flat)."""
    hierarchical: bool
    reason: str
    flat_s: float
    hier_s: float
    host: LinkCost
    cross: LinkCost
    hosts: int
    ranks_per_host: int
    across: str = "allgather"
    paths: Dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> List[str]:
        """The tensors that go hierarchical (none when the exchange is flat)."""
        return [n for n, p in self.paths.items() if p == "hierarchical"]

    def as_dict(self) -> dict:
        return asdict(self)


def hier_seconds(n: float, host: LinkCost, cross: LinkCost, codec: CodecCost, hosts: int,
                 ranks_per_host: int, across: str = "allgather",
                 stage2: Optional[CodecCost] = None) -> float:
    """h(n) of the module docstring: predicted seconds of the hierarchical path for a
    tensor of ``n`` elements in a fusion bucket (no collective latencies).  ``across``:
    "allgather" or "reduce_scatter" (the compressed collective among ``hosts`` ranks)."""
    L = ranks_per_host
    inner = CostModel(cross, codec, hosts, allreduce=False, stage2=stage2)
    return (host.aa_per_byte * 4 * n + inner.seconds(n / L, fused=True)[across]
            + host.ag_per_byte * 4 * n / L)


def _latency(paths: Sequence[str], flat: LinkCost, host: LinkCost, cross: LinkCost,
             allreduce: bool) -> float:
    """One bucket's collective latencies for the paths used (CHOICES and "hier_ag",
    "hier_rs")."""
    t = 0.0
    if "none" in paths or "fp16" in paths:
        t += flat.ar_latency if allreduce else flat.ag_latency
    if "allgather" in paths:
        t += flat.ag_latency
    if "reduce_scatter" in paths:
        t += flat.aa_latency + flat.ag_latency
    if "hier_ag" in paths or "hier_rs" in paths:
        t += host.aa_latency + host.ag_latency + cross.ag_latency
    if "hier_rs" in paths:
        t += cross.aa_latency
    return t


def decide(sizes: Dict[str, int], model: CostModel, allowed: Sequence[str], host: LinkCost,
           cross: LinkCost, hosts: int, ranks_per_host: int, buckets: int = 1,
           across: str = "allgather") -> HierChoice:
    """The decision of the module docstring for the tensors ``sizes`` ({name: numel}) that
    Auto plans: ``model`` the flat CostModel Auto measured (its codec and stage-2 costs
    price the compressor across hosts too), ``allowed`` the flat paths Auto may take
    (among :data:`hvdcomp.auto.CHOICES`), ``buckets`` the fusion buckets (each pays the
    latencies once).  A pure function: every rank computes the same from the same costs."""
    L, H = ranks_per_host, hosts
    flat_paths, hier_paths, paths = set(), set(), {}
    t_flat = t_hier = 0.0
    fallbacks = [c for c in ("none", "fp16") if c in allowed]
    hier_key = "hier_rs" if across == "reduce_scatter" else "hier_ag"
    for name, n in sizes.items():
        t = model.seconds(n, fused=True)
        best = min((c for c in CHOICES if c in allowed), key=lambda c: t[c])
        flat_paths.add(best)
        t_flat += t[best]
        h = hier_seconds(n, host, cross, model.codec, H, L, across, model.stage2)
        fb = min(fallbacks, key=lambda c: t[c]) if fallbacks else None
        if fb is not None and t[fb] <= h:
            hier_paths.add(fb)
            t_hier += t[fb]
            paths[name] = fb
        else:
            hier_paths.add(hier_key)
            t_hier += h
            paths[name] = "hierarchical"
    names = [n for n, p in paths.items() if p == "hierarchical"]
    t_flat += buckets * _latency(sorted(flat_paths), model.link, host, cross, model.allreduce)
    t_hier += buckets * _latency(sorted(hier_paths), model.link, host, cross, model.allreduce)
    hierarchical = bool(names) and t_hier < t_flat
    where = (f"on {H} hosts x {L} ranks, predicted {t_flat * 1e3:.3g} ms per step flat, "
             f"{t_hier * 1e3:.3g} ms hierarchical")
    if not names:
        reason = (f"flat: {where} (fp32/fp16 beats the compressor across hosts for every "
                  f"tensor)")
    elif hierarchical:
        reason = (f"hierarchical: {where} ({len(names)} of {len(sizes)} tensors compressed "
                  f"across hosts over the {across})")
    else:
        reason = f"flat: {where}"
    return HierChoice(hierarchical, reason, t_flat, t_hier, host, cross, H, L, across,
                      paths if hierarchical else {})


def _agreed(transport: Transport, link: LinkCost) -> LinkCost:
    """``link`` with each value the maximum over every rank of ``transport``."""
    return LinkCost(*slowest_over_ranks(transport, list(asdict(link).values())))


def measure_hier(transport: Transport, host: Transport, cross: Transport, nbytes: int,
                 alltoall_across: bool, device=None) -> Tuple[LinkCost, LinkCost]:
    """(host link, cross-host link) measured as :func:`hvdcomp.auto.measure_link` measures
    the flat one: the host's allgather and all-to-all at ``nbytes`` (clamped to Auto's
    bounds), the cross-host allgather (and all-to-all with ``alltoall_across``) at
    ``nbytes`` / ranks per host; each value the slowest rank's of ``transport`` (every
    rank gets the same).  Collective over every rank."""
    def clamp(b):
        return min(max(int(b), LINK_LARGE_MIN), LINK_LARGE_MAX)

    h = measure_link(host, None, large=clamp(nbytes), device=device, alltoall=True)
    c = measure_link(cross, None, large=clamp(nbytes / host.size), device=device,
                     alltoall=alltoall_across)
    return _agreed(transport, h), _agreed(transport, c)


def settle(hierarchy, auto: Optional[Auto], transport: Transport, allreduce, entries,
           collective: str, buckets: int, fusion: bool
           ) -> Tuple[Optional[tuple], Optional[HierChoice]]:
    """``(hierarchy, choice)`` for an exchange: ``hierarchy`` as
    :func:`~.hier.plan_hierarchy` returned it ((host, cross, topology) or None), kept,
    or None (its carriers closed) when Auto's model says flat; ``choice`` the
    :class:`HierChoice`, None without an Auto's decision (no Auto, one host, or a setting
    other than "auto": ``hierarchy`` as it was).  Where the exchange stays hierarchical,
    the tensors the model sends by fp32/fp16 are marked so (``entries``: name ->
    Entry; their ``hier`` is set by the caller from ``choice.names``) and the compressed
    ones get the compressor back (Auto's flat plan may have sent them uncompressed:
    :func:`reroute`).  Collective over every rank (measurements)."""
    if hierarchy is None or auto is None or auto.model is None:
        return hierarchy, None
    host, cross, topo = hierarchy
    if cross.size < 2:
        return hierarchy, None
    sizes = {n: entries[n].param.numel() for n in auto.plan if n in entries}
    across = "reduce_scatter" if collective == "reduce_scatter" and fusion else "allgather"
    h, c = measure_hier(transport, host, cross, 4 * sum(sizes.values()),
                        across == "reduce_scatter",
                        device=next((e.param.device for e in entries.values()), None))
    allowed = list(auto.fallbacks) + collectives(auto.compressor, collective, transport.size)
    choice = decide(sizes, auto.model, allowed, h, c,
                    topo.host_count, topo.local_size, max(buckets, 1), across)
    if transport.rank == 0:
        logger.info("exchange: %s (hierarchy='auto', Auto's cost model)", choice.reason)
        logger.debug("exchange: host link %s, across hosts %s", asdict(h), asdict(c))
    if not choice.hierarchical:
        for t in (host, cross):
            t.close()
            if hasattr(t, "free"):
                t.free()
        return None, choice
    reroute(entries, choice, auto, allreduce)
    return hierarchy, choice


def reroute(entries, choice: HierChoice, auto: Auto, allreduce) -> None:
    """Give each tensor of ``choice.paths`` its path in the hierarchical exchange: the
    compressor (``hier``: the caller marks it) or fp32/fp16 (summed by ``allreduce``
    where it carries that dtype); ``auto.plan`` records the compressor per tensor."""
    for name, path in choice.paths.items():
        e = entries[name]
        comp = keep_range(auto.compressor if path == "hierarchical" else get(path), e.param)
        e.compressor, e.scatter = comp, False
        e.allreduce = (path != "hierarchical" and allreduce is not None and comp.summable
                       and wire_dtype(comp) in allreduce.dtypes)
        auto.plan[name] = comp.name
