"""Every error :mod:`colocate` raises, rooted at :class:`ColocateError`.

``ColocateError`` subclasses :class:`mcore_distill.errors.McoreDistillError`; each error also keeps
the built-in base callers already catch (``ValueError`` for bad values, ``TimeoutError`` for
waits that ran out, ``RuntimeError`` otherwise). The converter's ``ConversionError`` is the
shared HF mapping's (:mod:`mcore_distill.hf.errors`); ``ArenaCapacityError`` derives from both.
"""

from __future__ import annotations

from typing import Any

from mcore_distill import errors as base
from mcore_distill.hf.errors import ConversionError

__all__ = ["ColocateError", "ConfigError", "ConfigTypeError", "ResidencyError", "BusyError", "NotResidentError", "TransportError",
           "ReceiverTimeout", "ReceiverDied", "EngineStartError", "RemoteError", "UpdateError", "PublishError", "PoisonedVersionError",
           "ControlTimeoutError", "GenerationAbortedError", "EngineDestroyedError", "WorkerError",
           "WorkerStartTimeout", "AwexUnavailable", "ParamMismatchError", "ArenaCapacityError"]


class ColocateError(base.McoreDistillError):
    """Base of every :mod:`colocate` error."""


class ConfigError(ColocateError, base.ConfigError):
    """A config field holds a value that cannot work; the message names field and value."""


class ConfigTypeError(ConfigError, base.ConfigTypeError):
    """A config field holds a value of the wrong type; the message names field and value."""


# ----- residency ---------------------------------------------------------------------------------
class ResidencyError(ColocateError, RuntimeError):
    """Base of residency errors."""


class BusyError(ResidencyError):
    """Release requested while the owner is busy (generating, training, publishing)."""


class NotResidentError(ResidencyError):
    """An operation needs a tag that is currently released."""


# ----- transports and receivers -----------------------------------------------------------------
class TransportError(ColocateError, RuntimeError):
    """Base of transport failures."""


class ReceiverTimeout(TransportError, TimeoutError):
    """The receiver did not answer within the timeout."""


class ReceiverDied(TransportError):
    """The receiver process exited (or its pipe closed, or its server is unreachable) before answering."""


class EngineStartError(ReceiverDied):
    """An SGLang engine or server failed to start (e.g. no checkpoint at its model path); the
    processes it had started are gone."""


class RemoteError(TransportError):
    """The receiver raised; carries its exception type name and message."""

    def __init__(self, op: str, type_name: str, message: str):
        self.op, self.type_name, self.remote_message = op, type_name, message
        super().__init__(f"receiver failed in {op}: {type_name}: {message}")


class UpdateError(ColocateError, RuntimeError):
    """A weight update was refused or failed on the receiver; the previous weights stay."""


# ----- publication --------------------------------------------------------------------------------
class PublishError(ColocateError, RuntimeError):
    """A publish failed in ``phase``; ``version`` is poisoned and the receiver does not serve it."""

    def __init__(self, version: int, phase: str, cause: BaseException):
        self.version, self.phase, self.cause = version, phase, cause
        super().__init__(f"publish of weight_version {version} failed in {phase}: {type(cause).__name__}: {cause}")


class PoisonedVersionError(ColocateError, ValueError):
    """A version that failed before (or is not newer than the last good one) was published."""


# ----- the embedded engine's control plane --------------------------------------------------------
class ControlTimeoutError(ColocateError, TimeoutError):
    """A control request (pause / abort / destroy) did not take effect within its timeout."""

    def __init__(self, op: str, timeout: float, detail: str = ""):
        super().__init__(f"{op}: not done within timeout={timeout}s{': ' + detail if detail else ''}")
        self.op, self.timeout = op, timeout


class GenerationAbortedError(ColocateError, RuntimeError):
    """``generate`` was stopped by ``abort`` / ``destroy``; ``partial`` holds the tokens and
    log-probs sampled before the stop (full rows of finished chunks)."""

    def __init__(self, msg: str, partial: Any):
        super().__init__(msg)
        self.partial = partial


class EngineDestroyedError(ColocateError, RuntimeError):
    """The engine was destroyed; build a new one."""


# ----- workers ------------------------------------------------------------------------------------
class WorkerError(ColocateError, RuntimeError):
    """A worker could not be started or exited unexpectedly."""


class WorkerStartTimeout(WorkerError, TimeoutError):
    """The worker did not report ready within its start timeout."""


class AwexUnavailable(ColocateError, RuntimeError):
    """A required AWEX feature is missing; names the feature and what was probed."""


# ----- conversion --------------------------------------------------------------------------------

class ParamMismatchError(ColocateError, ValueError):
    """Sender and receiver disagree on names, shapes or dtypes (first 10 listed with both sides)."""

    def __init__(self, problems: list[str], total: int):
        self.problems = problems
        self.total = total
        super().__init__(f"{total} parameter mismatch(es); first {len(problems)}:\n  " + "\n  ".join(problems))


class ArenaCapacityError(ColocateError, ConversionError):
    """A conversion pass needs more bytes than its :class:`ConversionArena` holds."""

    def __init__(self, name: str, requested: int, used: int, capacity: int):
        self.name, self.requested, self.used, self.capacity = name, requested, used, capacity
        super().__init__(f"ConversionArena: {name} needs {requested} bytes at offset {used}, but capacity is "
                         f"{capacity} bytes (size it with ConversionArena.for_spec(spec, dtype=...), call reset() "
                         "at the start of each pass)")
