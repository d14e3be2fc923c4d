"""Typed errors of ``optim_staged``; every message names the field or tensor and the value."""

from __future__ import annotations

from mcore_distill.errors import ConfigError, ConfigTypeError, McoreDistillError

__all__ = [
    "StagedError",
    "StagedConfigError",
    "StagedConfigTypeError",
    "HostMemoryError",
    "SlotTooSmallError",
    "CheckpointLayoutError",
    "UnsupportedMegatronConfigError",
    "CheckpointWriteError",
]


class StagedError(McoreDistillError):
    """Base class of every error raised by ``optim_staged``."""


class StagedConfigError(StagedError, ConfigError):
    """A configuration field has an invalid value (the message names the field and value)."""


class StagedConfigTypeError(StagedConfigError, ConfigTypeError):
    """A configuration field or argument has the wrong type."""


class HostMemoryError(StagedError, MemoryError):
    """Host RAM is too small for the pinned slabs (the message gives bytes needed and available)."""


class SlotTooSmallError(StagedError, ValueError):
    """A whole-matrix unit (Muon) does not fit one transfer slot."""


class CheckpointLayoutError(StagedError, ValueError):
    """A checkpoint does not match this optimizer's layout (shapes, keys, TP/PP sizes)."""


class UnsupportedMegatronConfigError(StagedError, ValueError):
    """The Megatron ``OptimizerConfig`` / DDP config asks for something staging cannot do."""


class CheckpointWriteError(StagedError, RuntimeError):
    """Writing a checkpoint failed (a rank's background writer, a disk error); the previous
    checkpoint at the path is untouched."""

