"""Typed failures of the colocated runner, each derived from the package error it refines."""

from __future__ import annotations

from colocate.errors import ColocateError, PublishError, WorkerError
from mopd.errors import TeacherServerError


class EngineStartError(WorkerError):
    """The rollout engine could not be built or started (``engine.kind`` names which)."""


class EngineCrashedError(ColocateError, RuntimeError):
    """The rollout engine failed during generation at ``step``; the step's update was not applied."""

    def __init__(self, step: int, cause: BaseException):
        self.step, self.cause = step, cause
        super().__init__(f"rollout engine failed while generating step {step}: {type(cause).__name__}: {cause}")


class PublishVerificationError(PublishError):
    """A publish completed but the engine does not serve what was sent: it reports another
    version, or its greedy outputs on the fixed verification prompts differ from the trainer's."""


class TeacherServerDownError(TeacherServerError):
    """The HTTP teacher server (a child of this job) died or stopped answering at ``step``."""

    def __init__(self, step: int, teacher: str, cause: BaseException):
        self.step, self.teacher, self.cause = step, teacher, cause
        super().__init__(f"teacher server of {teacher!r} failed at step {step}: {type(cause).__name__}: {cause}")
