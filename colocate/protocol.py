"""The protocols that join the pieces: what an engine offers, and how a publisher reaches it.

* :class:`WeightReceiver`: the receiving side of a publish. It names the parameters it expects,
  stages a versioned update (``begin_update`` → ``load_bucket``… → ``end_update``), verifies, and
  commits, or drops it (``abort_update``). A version whose update was aborted is never served:
  an ``abort_update(v)`` that arrives after ``v`` was committed (the publisher gave up waiting
  for ``end_update``) rolls back to the previous version, or, for a receiver that loads in place
  and cannot, leaves no valid version (``weight_version()`` is None).
* :class:`RolloutEngine`: a receiver that also generates and shares the GPU through residency
  tags (``kv_cache``, ``weights``, ``cuda_graph``); :class:`~colocate.cycle.ColocatedCycle`
  drives one. :class:`~colocate.engines.HFEngine` and :class:`~colocate.sglang_engine.SGLangEngine`
  are the two.
* :class:`ReceiverLink`: the publisher's handle on a receiver, whatever side of a process
  boundary it is on. :class:`~colocate.transports.RemoteReceiver` is the link to a receiver in
  another process; :class:`~colocate.transports.LocalLink` wraps an in-process receiver (hand-overs
  are synchronous calls, no handle crosses). :func:`~colocate.transports.link_to` picks.

Optional receiver attributes the publisher reads: ``unsynced_acks`` (an acknowledged load may
still be copying on the device: the publisher keeps every bucket alive until ``end_update``),
``verifies_checksums`` (False: per-tensor checksums cannot be compared; the report says
``version-only``), ``sample(indices)`` (``verify="sampled"``) and ``rollback()`` (undo a commit
whose read-back failed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from colocate.buckets import Entry

__all__ = ["WeightReceiver", "RolloutEngine", "ReceiverLink", "ParamSpecs"]

ParamSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""HF name → (shape, dtype)."""


@runtime_checkable
class WeightReceiver(Protocol):
    """The receiving side of a publish (an engine, or a proxy to one in another process)."""

    def capabilities(self) -> frozenset[str]:
        """Transports it accepts: subset of ``{"inprocess", "shm", "cuda_ipc", "disk"}``."""

    def param_specs(self) -> ParamSpecs:
        """HF name → (shape, dtype) of every parameter it holds."""

    def begin_update(self, version: int) -> None:
        """Open a staged update to ``version``."""

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None:
        """Stage the tensors ``entries`` describe, viewed in ``buffer`` (uint8)."""

    def end_update(self, version: int, checksums: dict[str, int] | None) -> None:
        """Verify the staged tensors against ``checksums`` (if given) and commit ``version``."""

    def abort_update(self, version: int) -> None:
        """Drop the update to ``version``; if it was committed already, stop serving it."""

    def weight_version(self) -> int | None:
        """The version it serves (None: none valid)."""

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """:func:`~colocate.buckets.tensor_checksum` of live parameters by name."""


@runtime_checkable
class RolloutEngine(WeightReceiver, Protocol):
    """A weight receiver that generates and gives its GPU memory back by residency tag."""

    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        """Release ``tags`` (None: all) of ``kv_cache``, ``weights``, ``cuda_graph``; bytes per tag."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        """Resume ``tags`` (None: all), in reverse release order; bytes per tag."""


@runtime_checkable
class ReceiverLink(Protocol):
    """How a publisher reaches a receiver. Every call takes the publisher's ``timeout``."""

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """``receiver.op(*args)``; across a process boundary, bounded by ``timeout``."""

    def send(self, slot: Any, entries: list[Entry], buffer: torch.Tensor, nbytes: int, *,
             timeout: float) -> int:
        """Have the receiver load ``entries`` of ``buffer[:nbytes]`` (a staging buffer under
        ``slot``, or a storage shared in place); may return before the acknowledgement. Returns
        the handles that crossed a process boundary (0 or 1)."""

    def send_file(self, entries: list[Entry], path: str, nbytes: int, *, timeout: float) -> None:
        """Have the receiver load ``entries`` from the bucket file at ``path``."""

    def wait(self, *, below: int, timeout: float) -> None:
        """Block until fewer than ``below`` sends are unacknowledged."""

    def abort(self, version: int, *, timeout: float) -> None:
        """``abort_update(version)``, dropping the acknowledgements of the failed update."""

    def detach(self, slots: list | None = None, *, timeout: float) -> None:
        """Make the receiver unmap the buffers of ``slots`` (None: all), if it is still there."""
