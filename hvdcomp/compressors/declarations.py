"""What the exchange core reads from a compressor, declared with its defaults: the base of
:class:`hvdcomp.compressors.base.Compressor`, whose families override them.  The exchange
core (hvdcomp/exchange) never names a compressor class; everything it needs to know of one is
one of these declarations.  (``Compressor`` in the annotations: that class, not imported
here, as it imports this module.)
"""
from __future__ import annotations

from typing import ClassVar, Optional, Tuple

import torch

__all__ = ["Declarations", "ABSENT_ZEROS", "ABSENT_LAST", "ABSENT_REFUSE"]

# What a rank that sends nothing for a tensor counts as (Compressor.absent_rank).
ABSENT_ZEROS = "zeros"      # a zero contribution (the average still divides by it)
ABSENT_LAST = "last"        # its last upload stands (receivers keep one per rank: LAQ)
ABSENT_REFUSE = "refuse"    # a clear error: every rank's message is needed (NDQSG)


class Declarations:
    """The declarations the exchange core reads (defaults here; the families override):
    ``absent_rank``, ``wire_dtype``, ``sends_values``, ``shard_unit`` / ``shard_shape``,
    ``second_stage``, ``for_dtype``, ``steady_state``, ``shared_state`` and ``biased``; and
    one for the compressor's users and tests, not the core: ``device_identical``.  Only
    :class:`~hvdcomp.compressors.base.Compressor` inherits it; ``name`` is the compressor's
    registered name."""
    name: ClassVar[str] = "?"

    # What a rank that sends nothing for a tensor (no gradient there) counts as:
    # ABSENT_ZEROS, ABSENT_LAST (its last upload; a rank that has joined cannot be left out)
    # or ABSENT_REFUSE (ValueError on every rank).
    absent_rank: ClassVar[str] = ABSENT_ZEROS
    # The dtype a cast sends the values in (fp16, bf16); None for every other compressor.
    # A finite gradient the wire dtype cannot hold travels as ``none`` instead
    # (hvdcomp.exchange.averaging.Averaging.cast_fallback).
    wire_dtype: ClassVar[Optional[torch.dtype]] = None
    # The message holds the gradient's values (``none`` and the casts): a float32 sum of
    # finite contributions can overflow, and is then summed again prescaled.
    sends_values: ClassVar[bool] = False

    def shard_unit(self, shape: Tuple[int, ...]) -> int:
        """Elements per *unit* of a tensor of ``shape`` (int >= 1): the reduce-scatter
        (hvdcomp.exchange.shards) cuts a tensor into pieces only at unit boundaries and
        encodes each piece as a tensor of its own, so a unit is what must stay whole for a
        piece's message to mean what the whole tensor's would (a quantization bucket, a
        row; 1 where any cut will do).  Raises TypeError saying why this compressor's
        messages cannot be cut into shards; the default, for a compressor that declares no
        unit."""
        raise TypeError(f"{self.name} declares no shard unit (Compressor.shard_unit), so "
                        f"its messages cannot be cut into shards for the reduce-scatter")

    def shard_shape(self, shape: Tuple[int, ...], lo: int, hi: int) -> Tuple[int, ...]:
        """The shape a piece ``[lo, hi)`` (flat elements, at unit boundaries) of a tensor of
        ``shape`` is encoded with: flat ``(hi - lo,)`` by default."""
        return (hi - lo,)

    def second_stage(self) -> "Compressor":
        """The compressor that re-encodes an owner's averaged pieces in the reduce-scatter
        (hvdcomp.exchange.shards): this one by default (same instance: state kept by piece
        name)."""
        return self

    def for_dtype(self, dtype: torch.dtype) -> "Compressor":
        """The compressor a tensor of ``dtype`` travels with in place of this one: this one,
        except a cast whose wire dtype cannot hold ``dtype``'s range (fp16 for bfloat16:
        bf16)."""
        return self

    def steady_state(self) -> "Compressor":
        """The compressor that compresses, from its first step, as this one does once its
        warm-up schedule has ended (Auto per layer's trial times what the steps after the
        first cost: hvdcomp.exchange.plan_trial): this one by default; a new instance
        without the schedule where there is one (PowerSGD's ``start_iter``, DGC's warm-up)."""
        return self

    # The keys of ``state_dict()`` that hold the same values on every rank and keep their
    # meaning at another world size (fitted level tables, PowerSGD's Q).  A checkpoint
    # loaded into a world of another size keeps them and resets the rest: the state that is
    # this rank's own (error-feedback residuals, DGC's momentum and accumulation, LAQ's
    # last uploads and aggregates), which no rank of the new world owns
    # (:meth:`hvdcomp.exchange.driver.Driver.load_state_dict`).
    shared_state: ClassVar[Tuple[str, ...]] = ()

    # The decoded gradient is a biased estimate, corrected over steps by error feedback (or,
    # for LAQ, by lazy uploads): top-k, DGC, sign with error feedback, PowerSGD.  Auto per
    # layer (hvdcomp.exchange.layer_plan.effective_error) weighs such a compressor's one-step
    # error by the contraction it implies rather than as an unbiased variance.
    biased: ClassVar[bool] = False

    # The message bytes are the same on a CPU and a CUDA device for the same gradient and
    # key (the kernels and their reference sum in one fixed order).  False where the encode
    # sums in an order the device chooses: PowerSGD's matrix products (cuBLAS against the
    # CPU's BLAS), BHQ's choice of blocks (torch.sum / amax over rows).  Decoding stays
    # elementwise for every compressor, so ranks that decode the same messages agree.
    device_identical: ClassVar[bool] = True
