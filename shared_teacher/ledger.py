"""Per-student cursor (what a student checkpoint stores) and atomic JSON files."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mcore_distill.atomic import atomic_write_json as _atomic_write_json

__all__ = ["StudentCursor", "atomic_write_json", "read_json"]


@dataclass(kw_only=True)
class StudentCursor:
    """Progress of one student, durable at its optimizer-step boundary.

    Resume: the source restarts from the oldest ``epoch`` over all students and this student
    skips every id in ``settled`` (trained on, or dropped as its epoch tail) — exactly-once effect.
    """

    epoch: int = 0
    """Epoch the student is in (all earlier epochs are settled)."""
    settled: list[str] = field(default_factory=list)
    """Sample ids of ``epoch`` (and later) already settled by this student."""
    step: int = 0
    """Optimizer steps acked so far (windows), counted over the whole run."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> StudentCursor:
        if not d:
            return cls()
        return cls(epoch=int(d["epoch"]), settled=list(d["settled"]), step=int(d["step"]))


def atomic_write_json(path: str | os.PathLike, payload: object) -> None:
    """Write JSON to ``path`` atomically (:func:`mcore_distill.atomic.atomic_write_json`: temp file in
    the same folder, fsync, rename, fsync of the folder); values JSON cannot encode are written as
    ``str``. Creates the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_json(path, payload, indent=None, default=str)


def read_json(path: str | os.PathLike) -> object:
    with open(path) as f:
        return json.load(f)
