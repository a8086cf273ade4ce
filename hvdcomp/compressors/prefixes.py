"""The spec string's exchange prefixes: settings of the exchange, not of a compressor.

A spec string given as the exchange's ``compression=`` (hvdcomp.torch.DistributedOptimizer,
hvdcomp.ddp.register / HookState, ``$HVDCOMP_COMPRESSION``, the main job's
``--compression``) may start with them, in this order:
``[host+|flat+][auto+[layer+]][rs+|ag+]SPEC``.  The hierarchy prefix is read by
:func:`hvdcomp.exchange.driver.split_hierarchy`, the others by :func:`hvdcomp.auto.from_spec`;
``SPEC`` is a compressor's spec, all that :func:`hvdcomp.get` takes (a prefix there raises
ConfigError with :func:`prefix_error`); a prefix out of order raises ConfigError with
:func:`order_error`.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["HIERARCHY", "AUTO", "LAYER", "COLLECTIVE", "MEANING", "ORDER", "leading",
           "prefix_error", "order_error"]

#: hierarchy prefixes ("host+alq:bits=3"), before every other one: hierarchy setting
HIERARCHY = {"host+": "host", "flat+": "flat"}
#: Auto: ``hvdcomp.Auto(SPEC)``
AUTO = "auto+"
#: after "auto+" only: ``hvdcomp.Auto(SPEC, per_layer=True)``
LAYER = "layer+"
#: collective prefixes, after "auto+[layer+]" if any: collective setting
COLLECTIVE = {"rs+": "reduce_scatter", "ag+": "allgather"}

#: {prefix: the setting it stands for}
MEANING = {
    "host+": "hierarchy='host'",
    "flat+": "hierarchy='flat'",
    "auto+": "hvdcomp.Auto(SPEC)",
    "layer+": "hvdcomp.Auto(SPEC, per_layer=True), after 'auto+'",
    "rs+": "collective='reduce_scatter'",
    "ag+": "collective='allgather'",
}
ORDER = "[host+|flat+][auto+[layer+]][rs+|ag+]SPEC"


def leading(spec: str) -> Optional[str]:
    """The exchange prefix ``spec`` starts with (case-insensitive, after blanks), or None.
    Never raises."""
    s = str(spec).strip().lower()
    return next((p for p in MEANING if s.startswith(p)), None)


def prefix_error(spec: str, prefix: str) -> str:
    """The message of the ConfigError :func:`hvdcomp.get` raises for ``spec``, which
    starts with the exchange prefix ``prefix``."""
    return (f"{spec.strip()!r}: {prefix!r} is an exchange setting ({MEANING[prefix]}), not "
            f"part of a compressor's spec, which is all hvdcomp.get takes; give the whole "
            f"string as the exchange's compression= (hvdcomp.torch.DistributedOptimizer, "
            f"hvdcomp.ddp, $HVDCOMP_COMPRESSION, the main job's --compression), prefixes in "
            f"the order {ORDER} (docs/compressors.md, \"Spec prefixes\")")


def order_error(spec: str, prefix: str) -> str:
    """The message of the ConfigError :func:`hvdcomp.auto.from_spec` raises for ``spec``
    (the whole exchange spec string) where the exchange prefix ``prefix`` comes after a
    prefix that must follow it, or comes twice."""
    return f"prefix {prefix!r} out of order in {spec.strip()!r}; the order is {ORDER}"
