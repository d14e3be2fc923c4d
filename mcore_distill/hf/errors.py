"""Errors of :mod:`mcore_distill.hf`: every one names the tensor, file or config field at fault.

All derive from :class:`HFCheckpointError` (a :class:`~mcore_distill.errors.McoreDistillError`);
configuration problems also derive from :class:`~mcore_distill.errors.ConfigError`.
"""

from __future__ import annotations

from mcore_distill.errors import ConfigError, McoreDistillError

__all__ = [
    "HFCheckpointError",
    "ConversionError",
    "UnsupportedConfigError",
    "ConfigMismatchError",
    "VocabSizeError",
    "CheckpointMismatchError",
    "CheckpointFileError",
    "PeerRankError",
]


class HFCheckpointError(McoreDistillError):
    """Base class of the Hugging Face checkpoint errors."""


class ConversionError(HFCheckpointError, ValueError):
    """A Megatron name or tensor that the mapping tables cannot map; names the parameter."""


class UnsupportedConfigError(HFCheckpointError, ConfigError):
    """An HF ``config.json`` field (or a Megatron config field) whose value we cannot reproduce:
    an unknown architecture, a rope scaling type, sliding windows, … The message names the field
    and its value."""


class ConfigMismatchError(HFCheckpointError, ConfigError):
    """The Megatron model and the HF config disagree on a field (names both values)."""


class VocabSizeError(ConfigMismatchError):
    """The HF vocabulary does not fit the Megatron embedding (or an override is smaller than it)."""


class CheckpointMismatchError(HFCheckpointError, ValueError):
    """Missing, unexpected or wrongly shaped tensors. ``missing``, ``unexpected`` and
    ``mismatched`` list the tensor names (with shapes in the message; the first 10 of each)."""

    def __init__(self, *, missing: list[str] = (), unexpected: list[str] = (), mismatched: list[str] = (),
                 where: str = ""):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        parts = []
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatch", self.mismatched)):
            if items:
                more = f" (+{len(items) - 10} more)" if len(items) > 10 else ""
                parts.append(f"{len(items)} {label}: " + ", ".join(items[:10]) + more)
        super().__init__(f"{where}: " * bool(where) + "; ".join(parts))


class CheckpointFileError(HFCheckpointError, OSError):
    """A checkpoint file that cannot be read: no ``config.json``, an index naming a file that is
    absent, a truncated or corrupt safetensors file (names the file)."""


class PeerRankError(HFCheckpointError):
    """Another rank failed the checks of a collective load or save (its message is included);
    this rank did not touch its model, or did not publish the directory."""
