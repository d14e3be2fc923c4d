"""Per-step phase timeline: wall seconds and memory of each phase (one object per run, no globals).

::

    tl = PhaseTimeline(device)
    with tl.phase("generate"):
        ...
    tl.add_bytes("release", {"engine/kv_cache": 0, "engine/weights": 327680})
    row = tl.flush()   # {"time/generate": s, "mem/generate/allocated": bytes | None, ..., "bytes/...": n}

Memory per phase is ``torch.cuda.memory_allocated`` / ``memory_reserved`` of this process at the
phase's end and the peak allocated inside it (``None`` on CPU, where torch keeps no such counters);
the bytes a residency transition moved are added by the caller from what
:class:`colocate.Residency` / the engine reported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

PHASES = ("generate", "release", "resume", "teacher_scoring", "train", "optimizer", "publish", "verify")
"""The phases of one colocated step, in order (checkpointing, when due, is logged as ``checkpoint``)."""


class PhaseTimeline:
    """Accumulates the phases of the current step; :meth:`flush` returns them as one flat row."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._row: dict[str, float | int | None] = {}

    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` (seconds add up when a phase runs twice in a step) and record memory."""
        if self._cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda():
                torch.cuda.synchronize(self.device)
            self.add_seconds(name, time.perf_counter() - t0)
            cuda = self._cuda()
            self._row[f"mem/{name}/allocated"] = torch.cuda.memory_allocated(self.device) if cuda else None
            self._row[f"mem/{name}/reserved"] = torch.cuda.memory_reserved(self.device) if cuda else None
            self._row[f"mem/{name}/peak_allocated"] = torch.cuda.max_memory_allocated(self.device) if cuda else None

    def add_seconds(self, name: str, seconds: float) -> None:
        key = f"time/{name}"
        self._row[key] = float(self._row.get(key) or 0.0) + seconds

    def add_bytes(self, phase: str, moved: dict[str, int]) -> None:
        """Record bytes per ``owner/tag`` a transition of ``phase`` moved (freed or restored)."""
        for tag, n in moved.items():
            key = f"bytes/{phase}/{tag}"
            self._row[key] = int(self._row.get(key) or 0) + int(n)

    def set(self, key: str, value) -> None:
        self._row[key] = value

    def flush(self) -> dict:
        """This step's row (every phase of :data:`PHASES` present, 0.0 s when it did not run); resets."""
        row = {f"time/{p}": 0.0 for p in PHASES}
        row.update(self._row)
        self._row = {}
        return row
