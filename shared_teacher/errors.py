"""Typed errors of the shared teacher source. Every message names the field and the numbers."""

from __future__ import annotations

from mcore_distill import errors as _base

__all__ = [
    "SharedTeacherError",
    "SourceConfigError",
    "SourceConfigTypeError",
    "AdmissionConfigError",
    "CrossNodeSkewError",
    "IncompatibleSubscriptionError",
    "StaleRefError",
    "LeaseExpiredError",
    "SourceTeardownBlockedError",
    "SourceStalledError",
    "SourceClosedError",
    "StoreError",
    "PublishError",
    "WaitTimeoutError",
    "StateBudgetExceeded",
]


class SharedTeacherError(_base.McoreDistillError, RuntimeError):
    """Base class of every error raised by :mod:`shared_teacher`."""


class SourceConfigError(SharedTeacherError, _base.ConfigError):
    """A config field has an invalid value (the message names the field and the value)."""


class SourceConfigTypeError(SourceConfigError, _base.ConfigTypeError):
    """A config field has a value of the wrong type (the message names the field and the value)."""


class AdmissionConfigError(SourceConfigError):
    """Preflight proved that admission/dispatch can stall; carries the offending numbers.

    ``details`` is a list of dicts ``{node, student, check, need, have}``.
    """

    def __init__(self, message: str, details: list[dict] | None = None) -> None:
        super().__init__(message)
        self.details = list(details or [])


class CrossNodeSkewError(AdmissionConfigError):
    """Every per-node check passes, but students can drift apart differently on different nodes
    (uneven rank splits or packed students on several nodes) and the capacity does not cover the
    proven skew bound, so progress is not proven. ``details`` rows add ``quantum_share``,
    ``skew`` and ``against`` (the student the skew is measured against) to the usual
    ``{node, student, check, need, have}``. Fix: raise the node's caps to ``need``, give every
    student the same per-node rank proportions, or set ``SourceConfig.allow_unproven_layout``.
    """


class IncompatibleSubscriptionError(SharedTeacherError, ValueError):
    """A student's compatibility key differs from the source's; ``fields`` maps name → (source, student)."""

    def __init__(self, message: str, fields: dict | None = None) -> None:
        super().__init__(message)
        self.fields = dict(fields or {})


class StaleRefError(SharedTeacherError, KeyError):
    """A ``get`` named a sample generation that was released, aborted or superseded."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class LeaseExpiredError(SharedTeacherError):
    """A reader's lease is no longer valid (missed heartbeats, or its student was fenced)."""


class SourceTeardownBlockedError(SharedTeacherError):
    """A failed student's reader processes could not be confirmed exited; its pins are kept."""


class SourceStalledError(SharedTeacherError):
    """The watchdog saw no progress for ``watchdog_s`` seconds; the state dump path is in the message.

    Fatal for the source: every later call raises it. Deliberately not a ``TimeoutError`` (which
    callers retry, see :class:`WaitTimeoutError`)."""


class WaitTimeoutError(SharedTeacherError, TimeoutError):
    """A blocking call's own ``timeout`` expired while the source is healthy (no window yet, other
    ranks not acked yet, students not subscribed yet). Safe to call again; nothing else is."""


class PublishError(SharedTeacherError, ValueError):
    """A producer published a ref the source cannot place: an unknown node, a position that is not
    on that node, another schema, a generation never admitted, another sample at that position
    (a producer with a different order), or an object over ``max_sample_bytes``. Fatal for the
    source: the stream's promises (order, memory caps) no longer hold."""


class SourceClosedError(SharedTeacherError):
    """The source was closed or failed; no more batches will come."""


class StoreError(SharedTeacherError, OSError):
    """A feature-store operation failed (corrupt object, missing file, capacity)."""


class StateBudgetExceeded(SharedTeacherError):
    """The exhaustive simulation (:func:`shared_teacher.reference.simulate_nodes`) visited more than
    ``max_states`` states: the configuration is too large to prove by enumeration."""
