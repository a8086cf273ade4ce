"""The compressor contract, the registry, and spec parsing.

A compressor turns one gradient tensor into one wire :class:`~hvdcomp.wire.Message`
(``encode``) and adds a message's contribution into a float32 accumulator (``decode``).
Everything it remembers between steps (levels, residuals, momentum) lives in the compressor
and round-trips through ``state_dict`` / ``load_state_dict``.

Data flows one way: gradient -> encode -> Message -> bytes -> transport -> bytes ->
Message -> decode (into the accumulator) -> finalize (average) -> gradient.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError, WireFormatError
from ..ops import divide_
from ..wire import FLAG_ENTROPY, FLAG_NONFINITE, Message, dtype_code, register_codec
from . import prefixes, settings
from .declarations import ABSENT_LAST, ABSENT_REFUSE, ABSENT_ZEROS, Declarations
from .state import finite

__all__ = ["Compressor", "TensorKey", "register", "get", "parse_spec", "available",
           "registry", "examples", "REGISTRY", "ABSENT_ZEROS", "ABSENT_LAST", "ABSENT_REFUSE",
           "AVERAGE_SUFFIX"]

REGISTRY: Dict[str, type] = {}


def register(name: str, codec: Optional[int] = None):
    """Class decorator: make a compressor available as ``hvdcomp.get(name)``, with the wire
    id ``codec`` (set as the class's ``codec``; hvdcomp.wire.register_codec).

    codec: 1..127 for hvdcomp's own compressors (a class defined in this package,
    hvdcomp.wire.BUILTIN_CODECS: never renumbered, tests/unit/test_codec_ids.py), 128..255
    for one defined outside hvdcomp (hvdcomp.wire.USER_CODECS); None: the class's own
    ``codec`` stands.  Raises ValueError for a name registered twice or an id taken or out
    of its range.
    """
    def deco(cls):
        if name in REGISTRY:
            raise ValueError(f"compressor name {name!r} registered twice")
        if codec is not None:
            cls.codec = register_codec(name, codec,
                                       builtin=cls.__module__.startswith(__package__ + "."))
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco


def registry() -> Dict[str, type]:
    """{name: class} of every registered compressor, sorted by name.  Each class has its
    wire id (``codec``), an example spec that exercises its state (``example``; the name
    alone where the class declares none) and its settings with their defaults (the
    ``__init__`` signature, as ``parse_spec`` reads them)."""
    return {n: REGISTRY[n] for n in available()}


def examples() -> Dict[str, str]:
    """{name: example spec} of every registered compressor (:func:`registry`), sorted by
    name: the list that the tests, the DDP golden run, the device tests, bench/codec_speed.py
    and the selftest run."""
    return {n: cls.example or n for n, cls in registry().items()}


#: What ends the name of a reduce-scatter's second-stage key (the owner's re-encoded average
#: of a piece, :meth:`hvdcomp.exchange.shards.Piece.key2`), so that a compressor that keeps
#: statistics per kind of tensor tells averages from gradients.
AVERAGE_SUFFIX = "/avg"


@dataclass(frozen=True)
class TensorKey:
    """Identifies one tensor in one step on one rank; feeds the header and the Philox key.

    name: stable parameter name; tensor_id: its index in the fixed (name-sorted) order;
    step: optimizer step; rank / world_size: sender and group size; seed: shared seed.
    shape / dtype: the parameter's shape and dtype as the receiver knows them; where given,
    ``decode`` requires the header's shape (every entry, empty tensors included) and dtype
    code to be these (None: only the numel of the accumulator is checked).
    """
    name: str
    tensor_id: int
    step: int
    rank: int
    world_size: int
    seed: int = 0
    shape: Optional[Tuple[int, ...]] = None
    dtype: Optional[torch.dtype] = None


class Compressor(Declarations):
    """Base class.  Subclasses set ``codec`` (wire id), implement ``_encode`` and ``_decode``.

    The contract every compressor keeps: ``encode`` / ``combine`` (decode the ranks'
    messages in rank order and add them up) / ``state_dict`` / ``load_state_dict`` /
    ``message_bytes(shape)``.  Special needs of the training loop (fitted levels, momentum
    correction, parameter deltas, events) are opt-in protocols in
    :mod:`hvdcomp.compressors.protocols`, checked with ``isinstance`` by the exchange core.

    Class attributes:
      summable  -- the encoding can be summed by an allreduce (dtype casts); such tensors
                   may travel through Horovod's allreduce instead of the allgather path.
      prescaled -- encode already divides by the world size (fp16), so the average is the
                   plain sum of the decoded contributions.
      example   -- a spec that exercises its state (:func:`examples`).
    What the exchange core reads from a compressor is declared, with defaults, in its base
    :class:`~hvdcomp.compressors.declarations.Declarations`, and overridden by the
    families: ``absent_rank``, ``wire_dtype``, ``sends_values``, ``shard_unit`` /
    ``shard_shape`` (how the reduce-scatter cuts a message into shards, or why not),
    ``second_stage``, ``for_dtype`` and ``shared_state``.  The core never names a
    compressor class.
    Instance attribute (may depend on the settings):
      keeps_state -- the compressor carries state from step to step that a checkpoint must
                   hold (error-feedback residuals, fitted levels, momentum, lazy-upload
                   records: what ``state_dict`` returns); the drop-in optimizer refuses to
                   load a checkpoint without hvdcomp's part into such a compressor unless
                   told to (``load_state_dict(..., allow_missing_hvdcomp=True)``).
    """
    name: ClassVar[str] = "?"
    codec: ClassVar[int] = 0
    summable: ClassVar[bool] = False
    prescaled: ClassVar[bool] = False
    keeps_state: bool = False
    # The ``entropy`` setting, for compressors that have it (code sections rANS-coded, flag
    # ENTROPY); decode requires the flag to match it.
    entropy: bool = False
    # A spec that exercises the compressor's state (registry: ``examples()``); "" = the name.
    example: ClassVar[str] = ""

    # --- the contract -----------------------------------------------------------------
    def encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        """Encode ``grad`` (any shape and layout, floating dtype; read, not modified).

        A tensor holding NaN or Inf is sent as a payload-free NONFINITE message; every
        receiver then turns the whole averaged tensor into NaN (docs/design.md, "NaN").
        Raises TypeError for non-floating tensors in codecs that need floats.
        """
        if grad.is_floating_point() and grad.numel() and not _all_finite(grad):
            return self._nonfinite(grad, key)
        return self._encode(grad, key)

    def encode_pieces(self, grad: torch.Tensor, spans: Sequence[Tuple[int, int]],
                      keys: Sequence[TensorKey]) -> List[Message]:
        """The messages of several pieces of one gradient in one call (the reduce-scatter's
        pieces of a tensor, one per destination rank: hvdcomp.exchange.shards): message k
        is ``encode(grad.reshape(-1)[lo:hi].reshape(keys[k].shape), keys[k])`` for
        ``(lo, hi) = spans[k]`` (flat elements; ``keys[k].shape`` None: flat), the same
        bytes.  Default: one ``encode`` per piece, in order; the bucketed quantizers do all
        pieces in one kernel launch.  Raises as ``encode``, and ValueError for
        ``len(spans) != len(keys)``."""
        if len(spans) != len(keys):
            raise ValueError(f"{len(spans)} pieces but {len(keys)} keys")
        flat = grad.reshape(-1)
        return [self.encode(flat[lo:hi] if k.shape is None else flat[lo:hi].reshape(k.shape),
                            k) for (lo, hi), k in zip(spans, keys)]

    def decode_pieces(self, msgs: Sequence[Message], keys: Sequence[TensorKey],
                      spans: Sequence[Tuple[int, int]], out: torch.Tensor) -> bool:
        """Add several pieces' messages into their parts of one accumulator in one call:
        ``decode(msgs[k], keys[k], out[lo:hi])`` for ``(lo, hi) = spans[k]``, in order (the
        spans disjoint), the same bits.  out: flat float32.  Returns False if any message
        was NONFINITE.  Default: one ``decode`` per piece; the bucketed quantizers add all
        pieces in one kernel launch.  Raises as ``decode``, and ValueError for lists of
        different lengths."""
        if not len(msgs) == len(keys) == len(spans):
            raise ValueError(f"{len(msgs)} messages, {len(keys)} keys, {len(spans)} spans")
        finite_all = True
        for msg, key, (lo, hi) in zip(msgs, keys, spans):
            finite_all &= self.decode(msg, key, out[lo:hi])
        return finite_all

    def _nonfinite(self, grad: torch.Tensor, key: TensorKey) -> Message:
        """The payload-free NONFINITE message (NaN policy, docs/design.md)."""
        return self._new_message(grad, key, flags=FLAG_NONFINITE)

    def _new_message(self, grad: torch.Tensor, key: TensorKey, sections=(),
                     flags: int = 0) -> Message:
        """A message for ``grad`` (its dtype and shape) and ``key`` (tensor id, rank, seed,
        step) with this compressor's codec and header fields (``_header_fields``), carrying
        ``sections`` (uint8 arrays or bytes) and ``flags``: the one place a header is
        filled in."""
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=tuple(sections), flags=flags, tensor_id=key.tensor_id,
                       rank=key.rank, seed=key.seed, step=key.step, **self._header_fields())

    def decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> bool:
        """Validate ``msg`` against ``key`` and add its contribution to ``out``.

        out: flat float32 accumulator with ``numel`` elements (numel of the parameter).
        key: the sender's key; with ``key.shape`` / ``key.dtype`` (the parameter's) the
        header's shape and dtype code are checked too.
        Returns False if the message is NONFINITE (nothing added), True otherwise.
        Raises WireFormatError for any mismatch or malformed section (the header checks:
        ``_expect_header``).
        """
        if not self._check_header(msg, key, out):
            return False
        self._decode(msg, key, out)
        return True

    def _check_header(self, msg: Message, key: TensorKey, out: torch.Tensor) -> bool:
        """decode()'s header checks; False for a NONFINITE message (nothing to add)."""
        self._expect_header(msg, key, out.numel())
        return not msg.flags & FLAG_NONFINITE

    def _expect_header(self, msg: Message, key: TensorKey, numel: int, **fields) -> None:
        """Check every header field of ``msg`` against this receiver: codec, tensor id,
        step, rank, seed, shape and dtype (where ``key`` has them), numel, the flags this
        compressor writes (ENTROPY iff its ``entropy`` setting; a NONFINITE message carries
        that flag alone) and bits / bucket size / level-table version as
        ``_header_fields`` gives them, 0 for those it does not use; ``fields`` overrides
        them (NDQSG: the bits of the sender's group).  Raises WireFormatError naming the
        field."""
        hf = {"bits": 0, "bucket_size": 0, "level_version": 0, **self._header_fields(),
              **fields}
        msg.expect(codec=self.codec, tensor_id=key.tensor_id, step=key.step, rank=key.rank,
                   seed=key.seed, shape=key.shape,
                   dtype=None if key.dtype is None else dtype_code(key.dtype), **hf)
        if msg.numel != numel:
            raise WireFormatError(f"numel mismatch: message has {msg.numel}, receiver "
                                  f"expects {numel}")
        flags = FLAG_NONFINITE if msg.flags & FLAG_NONFINITE else (
            FLAG_ENTROPY if self.entropy else 0)
        if msg.flags != flags:
            raise WireFormatError(f"{self.name}: flags 0x{msg.flags:02x}, expected "
                                  f"0x{flags:02x} (ENTROPY is set iff the compressor's "
                                  f"entropy setting is; NONFINITE stands alone)")

    def combine(self, msgs: List[Message], keys: List[TensorKey], out: torch.Tensor) -> bool:
        """Decode every rank's message for one tensor into ``out`` (the sum of the
        contributions).  ``msgs[r]`` came from rank ``r``; ``keys[r]`` is its key.

        ``msgs[r]`` is None where rank ``r`` sent a zero-length message (a skipped upload).
        Default: decode in rank order 0..N-1 (the same float32 order on every rank).
        Compressors whose receivers need a decode order (NDQSG's side information) override
        this.  Returns False if any message was NONFINITE.
        """
        finite = True
        for msg, key in zip(msgs, keys):
            self._require_message(msg, key)
            finite &= self.decode(msg, key, out)
        return finite

    def _require_message(self, msg: Optional[Message], key: TensorKey) -> None:
        if msg is None:
            raise WireFormatError(f"{self.name}: rank {key.rank} sent an empty message "
                                  f"for {key.name}; only compressors that skip uploads "
                                  f"(LAQ) may send nothing")

    def finalize(self, acc: torch.Tensor, key: TensorKey) -> torch.Tensor:
        """Turn the sum of decoded contributions into the average, in place.

        ``key`` names the tensor (stateful receivers, e.g. a running aggregate, keep
        per-name state here); ``key.world_size`` is the number of ranks.
        """
        if not self.prescaled:
            divide_(acc, key.world_size)
        return acc

    # --- for subclasses ---------------------------------------------------------------
    def _header_fields(self) -> Dict[str, int]:
        return {}

    def _encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        raise NotImplementedError

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        raise NotImplementedError

    def message_bytes(self, shape) -> Optional[int]:
        """Payload bytes (header and CRC excluded) of the fixed-length encoding of a tensor
        of ``shape`` (a tuple, a torch.Size, or an int: the number of elements of a 1-D
        tensor), or None where the size depends on the values (sparse index codes).
        Entropy coding (``entropy=True``) replaces the fixed-length code section by a
        rANS section whose size depends on the values."""
        return None

    # --- state (``shared_state``: Declarations) -------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} has no state, got keys {sorted(state)}")

    # --- settings ---------------------------------------------------------------------
    def settings(self) -> Dict[str, Any]:
        """The constructor arguments of this instance (what ``spec()`` prints).

        Rule for every compressor: each ``__init__`` argument is stored, validated, under its
        own name (``self.bits = settings.integer("bits", bits, 1, 8)``).  ``spec()``, ``repr``
        and the ranks' start-up handshake read the settings back this way."""
        sig = inspect.signature(type(self).__init__)
        return {p: getattr(self, p) for p in sig.parameters if p != "self"}

    def spec(self) -> str:
        """The one-line spec that ``hvdcomp.get`` turns back into an equal compressor."""
        s = self.settings()
        return self.name + (":" + ",".join(f"{k}={_fmt(v)}" for k, v in s.items()) if s else "")

    def __repr__(self) -> str:
        return f"hvdcomp.get({self.spec()!r})"

    # --- Horovod's own Compression contract -------------------------------------------
    # Horovod's DistributedOptimizer and hvd.allreduce call compress(), SUM the result
    # across ranks, then call decompress().  Only summable encodings survive that.
    def compress(self, tensor: torch.Tensor):
        raise TypeError(
            f"hvdcomp compressor {self.spec()!r} sends packed per-rank codes that Horovod's "
            f"allreduce would sum into garbage. Use hvdcomp.torch.DistributedOptimizer "
            f"(import hvdcomp.torch as hvd) instead of horovod.torch's, and do not pass it "
            f"to hvd.allreduce.")

    def decompress(self, tensor: torch.Tensor, ctx):
        raise TypeError("decompress() without compress(): see compress()")


def numel_of(shape) -> int:
    """Number of elements of ``shape`` (an int is taken as a 1-D shape)."""
    if isinstance(shape, int):
        return shape
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _all_finite(grad: torch.Tensor) -> bool:
    """Whether every value is finite once cast to float32 (float64 values beyond float32's
    range become Inf when quantized).  min/max propagate NaN and are ~20x cheaper on a CPU
    than isfinite().all()."""
    return finite(grad.detach().float() if grad.dtype == torch.float64 else grad.detach())


def available() -> List[str]:
    """Names of all registered compressors."""
    return sorted(REGISTRY)


def _fmt(v: Any) -> str:
    """A setting's value as a spec string writes it (tuples as a/b/c)."""
    return "/".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _describe(cls) -> str:
    """The compressor's default spec, e.g. ``qsgd:bits=3,bucket_size=8192,entropy=False``."""
    sig = inspect.signature(cls.__init__)
    parts = [f"{p.name}={_fmt(p.default)}" for p in sig.parameters.values() if p.name != "self"]
    return f"{cls.name}:{','.join(parts)}" if parts else f"{cls.name} (no settings)"


def _convert(cls, pname: str, raw: str, default: Any) -> Any:
    """A spec string's value typed like the setting's default (settings.parse)."""
    try:
        return settings.parse(pname, raw, default)
    except ValueError:
        raise ConfigError(f"{cls.name}: setting {pname}={raw!r} is not a valid "
                          f"{type(default).__name__}; valid: {_describe(cls)}") from None


def parse_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """Parse ``"name:key=value,key=value"`` into ``(name, kwargs)`` with typed values.

    Raises ConfigError for an unknown name or setting, listing what is valid, and for a
    spec that starts with an exchange prefix ("auto+", "rs+", "host+"...:
    :mod:`.prefixes`), saying where those are taken.
    """
    prefix = prefixes.leading(spec)
    if prefix is not None:
        raise ConfigError(prefixes.prefix_error(spec, prefix))
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    kwargs: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip()
        if not eq:
            raise ConfigError(f"{name}: setting {item!r} needs the form key=value; "
                              f"valid: {_describe(cls)}")
        if k not in sig.parameters or k == "self":
            raise ConfigError(f"{name}: unknown setting {k!r}; valid: {_describe(cls)}")
        kwargs[k] = _convert(cls, k, v, sig.parameters[k].default)
    return name, kwargs


def _lookup(name: str):
    if name not in REGISTRY:
        raise ConfigError(f"unknown compressor {name!r}; valid (with their defaults): "
                          + "; ".join(_describe(REGISTRY[n]) for n in available()))
    return REGISTRY[name]


def get(spec, **kwargs) -> Compressor:
    """A compressor from a name or a one-line spec, e.g. ``get("alq", bits=3)`` or
    ``get("alq:bits=3,bucket_size=8192")``.  A Compressor instance is returned as is.

    Raises ConfigError for unknown names or settings and for invalid values, and for an
    exchange prefix ("auto+alq:bits=3", "rs+...", "host+...": settings of the exchange,
    taken by its ``compression=``; :mod:`.prefixes`).
    """
    if isinstance(spec, Compressor):
        if kwargs:
            raise ConfigError("settings cannot be given together with a compressor instance")
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"expected a compressor name, spec string or instance, got {spec!r}")
    name, parsed = parse_spec(spec)
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    for k in kwargs:
        if k not in sig.parameters or k == "self":
            raise ConfigError(f"{name}: unknown setting {k!r}; valid: {_describe(cls)}")
    parsed.update(kwargs)
    try:
        return cls(**parsed)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{name}: {e}; valid: {_describe(cls)}") from None
