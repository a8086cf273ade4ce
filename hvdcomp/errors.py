"""Errors raised by hvdcomp."""

__all__ = ["WireFormatError", "ConfigError"]


class WireFormatError(ValueError):
    """A wire message is truncated, corrupted, or does not match what the receiver expects.

    Raised by :func:`hvdcomp.wire.Message.from_bytes` and by every compressor's ``decode``;
    the text says which field was wrong and what was expected.
    """


class ConfigError(ValueError):
    """A compressor name, spec string or setting is invalid; the text lists what is valid."""
