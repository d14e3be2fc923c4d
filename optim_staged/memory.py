"""A CUDA caching-allocator snapshot of one real training iteration, written next to the run's
outputs (open it at ``pytorch.org/memory_viz``).

:class:`AllocatorSnapshot` counts optimizer steps through a step post-hook on the last optimizer
of the chain. After step ``step - 1`` it starts recording the allocator's history, so the record
covers the whole of iteration ``step``: forward, backward and optimizer step (slot transfers, the
update, the parameter write-back); the hook after step ``step`` writes
``<output_dir>/optim_staged_alloc_step<step>_rank<rank>.pickle`` atomically and stops recording.
``step=1`` starts recording when the snapshot is attached. Recording is process-wide: a history
that the trainer records itself (Megatron's ``--record-memory-history``) is stopped too.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from mcore_distill.atomic import atomic_write
from optim_staged.config import MemorySnapshotConfig, StagedConfigError

__all__ = ["AllocatorSnapshot", "last_torch_optimizer"]


def last_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that steps last in a (nested) Megatron optimizer chain: its step
    post-hook runs once per iteration, after every other leaf has stepped."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    leaves = getattr(optimizer, "chained_optimizers", None)
    if leaves:
        return last_torch_optimizer(leaves[-1])
    inner = getattr(optimizer, "optimizer", None)
    if inner is None:
        raise StagedConfigError(f"optimizer={type(optimizer).__name__} holds no torch optimizer to hook")
    return last_torch_optimizer(inner)


class AllocatorSnapshot:
    """Record iteration ``cfg.step`` of a training run and write it as a pickle (see module doc)."""

    def __init__(self, cfg: MemorySnapshotConfig, *, rank: int | None = None) -> None:
        if not cfg.output_dir:
            raise StagedConfigError("MemorySnapshotConfig.output_dir='' is invalid here: set the output folder")
        if not torch.cuda.is_available():
            raise StagedConfigError(
                f"MemorySnapshotConfig.output_dir={cfg.output_dir!r}: an allocator snapshot needs CUDA, none is available")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.cfg = cfg
        self.path = Path(cfg.output_dir) / f"optim_staged_alloc_step{cfg.step}_rank{rank}.pickle"
        self.steps = 0
        self.recording = False
        self.written: Path | None = None
        self._handle: Any = None

    def attach(self, optimizer: Any) -> AllocatorSnapshot:
        """Count the steps of ``optimizer`` (a torch optimizer or a Megatron chain)."""
        self._handle = last_torch_optimizer(optimizer).register_step_post_hook(lambda *_: self.after_step())
        if self.cfg.step == 1:
            self._start()
        return self

    def after_step(self) -> None:
        """Called once per iteration, after the optimizer step."""
        self.steps += 1
        if self.steps == self.cfg.step - 1:
            self._start()
        elif self.steps == self.cfg.step and self.recording:
            self._dump()

    def _start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.cfg.max_entries)
        self.recording = True

    def _dump(self) -> None:
        try:
            snapshot = torch.cuda.memory._snapshot()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.path, "wb") as f:
                pickle.dump(snapshot, f)
            self.written = self.path
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
            if self._handle is not None:
                self._handle.remove()
