"""Errors raised by hvdcomp."""

__all__ = ["WireFormatError", "ConfigError", "RankFailure", "OutOfStep", "Mismatch"]


class WireFormatError(ValueError):
    """A wire message is truncated, corrupted, or does not match what the receiver expects.

    Raised by :func:`hvdcomp.wire.Message.from_bytes` and by every compressor's ``decode``;
    the text says which field was wrong and what was expected.
    """


class ConfigError(ValueError):
    """A compressor name, spec string or setting is invalid; the text lists what is valid."""


class RankFailure(RuntimeError):
    """Another rank failed: it sent an error instead of its part of a collective (its
    encoder raised, or it is stopping after an exception or KeyboardInterrupt).  ``rank``:
    the first such rank.  Raised on every rank but that one."""

    def __init__(self, text: str, rank: int):
        super().__init__(text)
        self.rank = rank


class OutOfStep(RuntimeError):
    """Ranks exchanged different steps (or different optimizers' steps) in one collective:
    a rank skipped an iteration, called ``step()`` twice, or stepped its optimizers in
    another order.  ``ranks``: the ranks that differ from the raising one.  Raised on every
    rank at the first collective where it happens."""

    def __init__(self, text: str, ranks=()):
        super().__init__(text)
        self.ranks = list(ranks)


class Mismatch(RuntimeError):
    """The ranks disagree on the model, its initial values, or the settings (raised on
    every rank while the optimizer is built, or at its first step for the values)."""
