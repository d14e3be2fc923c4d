"""Typed errors of ``harts``; every message names the field, tensor or shape and the value."""

from __future__ import annotations

from mcore_distill.errors import ConfigError, ConfigTypeError, McoreDistillError

__all__ = [
    "HartsError",
    "HartsConfigError",
    "HartsConfigTypeError",
    "EmptySequenceError",
    "TokenOutOfRangeError",
    "GdnConfigError",
    "GdnShapeError",
    "TreeIncompatibleError",
    "CapacityError",
    "PlanError",
]


class HartsError(McoreDistillError):
    """Base class of every error raised by ``harts``."""


class HartsConfigError(HartsError, ConfigError):
    """An invalid harts configuration value (the message names the field and the value)."""


class HartsConfigTypeError(HartsConfigError, ConfigTypeError):
    """A harts configuration field or argument has the wrong type."""


class EmptySequenceError(HartsError, ValueError):
    """A sequence has no tokens."""


class TokenOutOfRangeError(HartsError, ValueError):
    """A token id is negative or not below the vocabulary size."""


class GdnConfigError(HartsConfigError):
    """An invalid Gated DeltaNet tree option (the message names the field and the value)."""


class GdnShapeError(HartsError, ValueError):
    """Tensors do not match each other or the plan (the message names the shapes)."""


class TreeIncompatibleError(HartsError, ValueError):
    """The model configuration cannot run tree-packed batches exactly."""


class CapacityError(HartsError, ValueError):
    """A single sequence does not fit into ``token_cap``."""


class PlanError(HartsError, ValueError):
    """No plan satisfies the constraints (e.g. fewer sequences than DP ranks)."""
