"""Base error classes shared by every package.

Each package's ``errors.py`` roots its errors at a package base that subclasses
:class:`McoreDistillError`, and its configuration errors also subclass :class:`ConfigError`, so a
trainer can catch ``mcore_distill.errors.ConfigError`` for a bad value in any package's config.
"""

from __future__ import annotations

__all__ = ["McoreDistillError", "ConfigError", "ConfigTypeError"]


class McoreDistillError(Exception):
    """Base class of every error raised by mcore-distill packages."""


class ConfigError(McoreDistillError, ValueError):
    """A configuration field or argument holds a value that cannot work; the message names the
    field (``Class.field``) and the value."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration field or argument has the wrong type (a list where a mapping is expected,
    a plain dict where a config dataclass is expected, a string where a number is expected)."""
