"""Residency: an explicit, idempotent tag state machine for GPU memory shared by roles.

A :class:`Residency` owns named tags (trainer: ``optimizer``, ``grads``, ``weights``; engine:
``kv_cache``, ``weights``, ``cuda_graph``), each with a release and a resume callable that
return the bytes freed / restored. Rules:

* releasing a released tag, or resuming a resident one, is a no-op (never a ``KeyError``);
* release is refused with :class:`BusyError` while the owner is busy (inside :meth:`busy`);
* the device is synchronized before any release (no kernel may still read the memory);
* tags given together are released in the declared order and resumed in reverse order;
* every transition is logged with its bytes and the allocator configuration
  (:func:`allocator_config`: expandable segments, for one, change what a release returns and
  cannot be shared over CUDA IPC) and kept in :attr:`Residency.events`.

Canonical colocated cycle (enforced by the calls that need residency, see ``docs/colocate.md``):
engine release ``kv_cache, weights, cuda_graph`` → train → trainer release ``optimizer, grads``
→ engine resume ``weights`` → publish → trainer release ``weights`` → engine resume
``cuda_graph, kv_cache`` → rollout → trainer resume ``weights, grads, optimizer`` → train.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from colocate.errors import BusyError, NotResidentError, ResidencyError

__all__ = ["ResidencyError", "BusyError", "NotResidentError", "Residency", "ResidencyEvent", "TensorOffload",
           "TRAINER_TAGS", "ENGINE_TAGS", "allocator_config"]

log = logging.getLogger(__name__)

TRAINER_TAGS = ("optimizer", "grads", "weights")
"""Trainer tags in release order."""
ENGINE_TAGS = ("kv_cache", "weights", "cuda_graph")
"""Engine tags in release order (SGLang's)."""

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_config(env: dict[str, str] | None = None) -> str:
    """This process's caching-allocator settings as torch reads them from the environment
    (``PYTORCH_CUDA_ALLOC_CONF`` and its newer name ``PYTORCH_ALLOC_CONF``), e.g.
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; ``default`` when neither is set."""
    env = os.environ if env is None else env
    return " ".join(f"{k}={env[k]}" for k in ALLOC_CONF_VARS if env.get(k)) or "default"


@dataclass(frozen=True)
class ResidencyEvent:
    """One transition: ``op`` is ``release``/``resume``; ``nbytes`` moved; ``seconds`` taken;
    ``allocator``: :func:`allocator_config` of the owner's process."""

    owner: str
    op: str
    tag: str
    nbytes: int
    seconds: float
    allocator: str = "default"


def _default_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Residency:
    """Tag state machine for one owner (a trainer rank or an engine).

    ``hooks`` maps tag → ``(release_fn, resume_fn)``; each returns bytes moved (int or None).
    The dict order is the release order. ``sync`` runs before releases (default: CUDA sync).
    ``allocator``: the allocator settings of the process that owns the memory, logged with every
    transition (default: :func:`allocator_config` of this process).
    """

    def __init__(self, hooks: dict[str, tuple[Callable[[], int | None], Callable[[], int | None]]], *,
                 owner: str = "owner", sync: Callable[[], None] | None = None, allocator: str | None = None):
        if not hooks:
            raise ValueError("Residency needs at least one tag in hooks")
        self.owner = owner
        self._hooks = dict(hooks)
        self._order = tuple(hooks)
        self._released: set[str] = set()
        self._sync = sync or _default_sync
        self._busy = 0
        self._lock = threading.RLock()
        self.events: list[ResidencyEvent] = []
        self.allocator = allocator or allocator_config()

    @property
    def tags(self) -> tuple[str, ...]:
        return self._order

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    def is_resident(self, tag: str) -> bool:
        self._check([tag])
        return tag not in self._released

    def _check(self, tags: Iterable[str]) -> list[str]:
        tags = list(tags)
        unknown = [t for t in tags if t not in self._hooks]
        if unknown:
            raise ValueError(f"{self.owner}: unknown residency tag(s) {unknown}; known: {list(self._order)}")
        return tags

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the owner busy (releases raise :class:`BusyError`); needs all tags resident."""
        with self._lock:
            self.require(*self._order)
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    @property
    def is_busy(self) -> bool:
        """Inside :meth:`busy` (e.g. an engine generating)."""
        return self._busy > 0

    def require(self, *tags: str) -> None:
        """Raise :class:`NotResidentError` naming any of ``tags`` that is released."""
        missing = [t for t in self._check(tags) if t in self._released]
        if missing:
            raise NotResidentError(f"{self.owner}: needs {missing} resident; released now: {sorted(self._released)}")

    def release(self, tags: Iterable[str] | None = None) -> dict[str, int]:
        """Release ``tags`` (None = all) in declared order; already-released tags are skipped.
        Returns bytes freed per tag actually released."""
        with self._lock:
            want = self._check(self._order if tags is None else tags)
            todo = [t for t in self._order if t in want and t not in self._released]
            if not todo:
                return {}
            if self._busy:
                raise BusyError(f"{self.owner}: release of {todo} refused while busy")
            self._sync()
            return {t: self._run("release", t) for t in todo}

    def resume(self, tags: Iterable[str] | None = None) -> dict[str, int]:
        """Resume ``tags`` (None = all) in reverse declared order; resident tags are skipped."""
        with self._lock:
            want = self._check(self._order if tags is None else tags)
            todo = [t for t in reversed(self._order) if t in want and t in self._released]
            return {t: self._run("resume", t) for t in todo}

    def _run(self, op: str, tag: str) -> int:
        fn = self._hooks[tag][0 if op == "release" else 1]
        t0 = time.perf_counter()
        nbytes = int(fn() or 0)
        dt = time.perf_counter() - t0
        if op == "release":
            self._released.add(tag)
        else:
            self._released.discard(tag)
        self.events.append(ResidencyEvent(self.owner, op, tag, nbytes, dt, self.allocator))
        log.info("%s: %s %s %.1f MiB in %.2f ms (allocator: %s)", self.owner, op, tag, nbytes / 2**20, dt * 1e3,
                 self.allocator)
        return nbytes


def _bytes(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of ``st`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (st.nbytes(),), (1,))


class TensorOffload:
    """Release/resume of a set of tensors by storage resizing, keeping tensor identity.

    ``release`` optionally copies each tensor's storage into a CPU mirror (pinned when on CUDA),
    resizes the storage to 0 bytes and, for CUDA storages, empties the caching allocator so
    another process can use the memory. Views into it (e.g. Megatron params into the DDP flat
    buffer) stay valid objects; the storage gets a new address on resume, so anything that
    captured raw addresses (CUDA graphs, NCCL user-buffer registration) must be rebuilt.
    ``resume`` re-grows the storage and restores the mirror, or zero-fills when
    ``keep_contents`` is False (gradients). Both return bytes moved.
    """

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], *, keep_contents: bool):
        self._tensors = tensors
        self._keep = keep_contents
        self._saved: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []

    def release(self) -> int:
        total = 0
        seen: set[int] = set()
        cuda = False
        for t in self._tensors():
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            nbytes = st.nbytes()
            mirror = None
            if self._keep:
                mirror = torch.empty(nbytes, dtype=torch.uint8, pin_memory=t.is_cuda)
                mirror.copy_(_bytes(st, t.device))
            self._saved.append((t, nbytes, mirror))
            st.resize_(0)
            total += nbytes
            cuda |= t.is_cuda
        if cuda:
            torch.cuda.empty_cache()
        return total

    def resume(self) -> int:
        total = 0
        for t, nbytes, mirror in self._saved:
            st = t.untyped_storage()
            st.resize_(nbytes)
            view = _bytes(st, t.device)
            if mirror is not None:
                view.copy_(mirror)
            else:
                view.zero_()
            total += nbytes
        self._saved.clear()
        return total
