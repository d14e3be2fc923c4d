"""Typed errors of ``mopd``. Every message names the field or tensor, the value, and where."""

from __future__ import annotations

from mcore_distill import errors as _base

__all__ = [
    "MOPDError",
    "ConfigError",
    "ConfigTypeError",
    "NonFiniteInputError",
    "RoutingError",
    "RouteMutationError",
    "TeacherStateError",
    "DrainError",
    "TeacherBrokenError",
    "TeacherTimeoutError",
    "TeacherServerError",
    "FingerprintMismatchError",
]


class MOPDError(_base.McoreDistillError):
    """Base class of every error raised by ``mopd``."""


class ConfigError(MOPDError, _base.ConfigError):
    """A configuration value is invalid; the message names the field and the value."""


class ConfigTypeError(ConfigError, _base.ConfigTypeError):
    """A configuration field or argument has the wrong type; the message names it."""


class NonFiniteInputError(MOPDError, ValueError):
    """A tensor holds NaN/inf at an active (unmasked) position."""


class RoutingError(MOPDError, ValueError):
    """A sample cannot be routed (missing field, unknown route, bad route value)."""


class RouteMutationError(RoutingError):
    """A trajectory carries a route stamp different from the sample it was derived from."""


class TeacherStateError(MOPDError, RuntimeError):
    """A teacher-pool operation is not allowed in the teacher's current state."""


class DrainError(TeacherStateError):
    """Release was attempted without a complete drain receipt."""


class TeacherBrokenError(TeacherStateError):
    """The teacher failed earlier and was torn down; it cannot be used again."""


class TeacherTimeoutError(MOPDError, TimeoutError):
    """A wait on a teacher (load, prefetch, scoring, server) exceeded its timeout."""


class TeacherServerError(MOPDError, RuntimeError):
    """An inference-server teacher answered with an error or an unusable payload."""


class FingerprintMismatchError(MOPDError, ValueError):
    """Student and teacher models are incompatible (architecture keys, vocabulary, tokens)."""
