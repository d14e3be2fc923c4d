"""Teacher lifecycle: a pool of teacher back-ends with one resident teacher at a time.

States per teacher::

    EMPTY ──load──▶ RESIDENT ◀──onload── OFFLOADED
                       │ ──offload──────────▲
    any failure ─▶ BROKEN (back-end closed, error kept)      close() ─▶ CLOSED (idempotent)

* :meth:`TeacherPool.acquire` makes a teacher resident (offloading the previous, idle one) and
  returns a :class:`Lease`; :meth:`Lease.score` hands out :class:`TeacherOutput` objects.
* :meth:`TeacherPool.release` needs the :class:`DrainReceipt` of that lease: every output was
  taken, and no taken tensor is still referenced anywhere (checked with weak references). An
  incomplete receipt raises :class:`~mopd.errors.DrainError` and the lease stays held.
* ``prefetch`` stages the next teacher's weights on a single background thread (host-side
  work only, no collectives); waits on it and on other holders are bounded by timeouts.
* Any back-end exception moves that teacher to BROKEN and closes it; lifecycle calls
  (load/offload/onload) are never retried, and a BROKEN teacher is never called again (not
  even through a lease taken before it broke). The pool keeps a copy of the cause without
  traceback: a kept traceback would keep every frame of the failed call alive, with its
  tensors (batches, scores, the caller's activations).
* ``close`` is idempotent and bounded: it waits at most ``wait_timeout_s`` for a running
  prefetch, then leaves it behind (recorded as that teacher's error).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import enum
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mcore_distill.errors import ConfigTypeError
from mcore_distill.validate import check_type
from mopd.backends import TeacherBackend, TokenBatch
from mopd.config import TeacherPoolConfig
from mopd.errors import DrainError, TeacherBrokenError, TeacherStateError, TeacherTimeoutError

__all__ = ["DrainReceipt", "Lease", "TeacherOutput", "TeacherPool", "TeacherState"]


class TeacherState(enum.Enum):
    EMPTY = "empty"
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    BROKEN = "broken"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class DrainReceipt:
    """Proof that a lease's outputs are no longer held: ``complete`` iff every issued output
    was taken (``taken == issued``) and none of the taken tensors is alive (``alive == 0``)."""

    teacher_id: str
    lease_id: int
    issued: int
    taken: int
    alive: int

    @property
    def complete(self) -> bool:
        return self.taken == self.issued and self.alive == 0


class TeacherOutput:
    """One scoring result. :meth:`take` returns the tensor once and drops the output's own
    reference; the pool then tracks the tensor only through a weak reference."""

    def __init__(self, logp: torch.Tensor) -> None:
        self._logp: torch.Tensor | None = logp
        self._ref: weakref.ref | None = None

    def take(self) -> torch.Tensor:
        if self._logp is None:
            raise TeacherStateError("teacher output was already taken")
        t, self._logp = self._logp, None
        self._ref = weakref.ref(t)
        return t

    @property
    def taken(self) -> bool:
        return self._logp is None

    @property
    def alive(self) -> bool:
        return self._ref is not None and self._ref() is not None


class Lease:
    """Exclusive use of one resident teacher; create with :meth:`TeacherPool.acquire`."""

    def __init__(self, pool: TeacherPool, teacher_id: str, lease_id: int) -> None:
        self.pool, self.teacher_id, self.lease_id = pool, teacher_id, lease_id
        self._outputs: list[TeacherOutput] = []
        self.released = False

    def score(self, batch: TokenBatch) -> TeacherOutput:
        """Score ``batch`` with this teacher (see :meth:`TeacherBackend.score`)."""
        if self.released:
            raise TeacherStateError(f"lease {self.lease_id} of {self.teacher_id!r} was released")
        self.pool._check_usable(self.teacher_id)
        logp = self.pool._call(self.teacher_id, "score", batch)
        out = TeacherOutput(logp)
        self._outputs.append(out)
        return out

    def drain(self) -> DrainReceipt:
        """The receipt for the outputs handed out so far."""
        return DrainReceipt(self.teacher_id, self.lease_id, issued=len(self._outputs),
                            taken=sum(o.taken for o in self._outputs), alive=sum(o.alive for o in self._outputs))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.released:
            return
        if exc_type is not None:  # the consumer failed: drop untaken outputs, end the lease
            for o in self._outputs:
                o._logp = None
            self.pool._end_lease(self)
            return
        self.pool.release(self, self.drain())


class TeacherPool:
    """Owns teacher back-ends and their states; at most one teacher is RESIDENT.

    Args:
        backends: ``{teacher_id: backend}``; nothing is loaded until acquired.
        config: prefetch switch and timeouts.
        on_event: optional callback ``(teacher_id, event)`` for logging/tests; events are
            ``load``, ``onload``, ``offload``, ``prefetch``, ``broken``, ``close``.
    """

    def __init__(self, backends: Mapping[str, TeacherBackend], *, config: TeacherPoolConfig,
                 on_event: Callable[[str, str], None] | None = None) -> None:
        if not isinstance(backends, Mapping):
            raise ConfigTypeError(f"TeacherPool backends must be a mapping {{teacher_id: backend}}, got "
                                  f"{type(backends).__name__} (e.g. {{b.teacher_id: b for b in backends}})")
        self.config = check_type("TeacherPool config", config, TeacherPoolConfig)
        self._backends = dict(backends)
        self._state = {tid: TeacherState.EMPTY for tid in self._backends}
        self._errors: dict[str, BaseException] = {}
        self._cond = threading.Condition()
        self._lease: Lease | None = None
        self._next_lease = 0
        self._executor: cf.ThreadPoolExecutor | None = None
        self._prefetch: dict[str, cf.Future] = {}
        self._on_event = on_event or (lambda tid, ev: None)
        self._closed = False

    # ---- introspection -------------------------------------------------------------------
    def state(self, teacher_id: str) -> TeacherState:
        self._known(teacher_id)
        return self._state[teacher_id]

    def states(self) -> dict[str, TeacherState]:
        return dict(self._state)

    def resident(self) -> str | None:
        return next((t for t, s in self._state.items() if s is TeacherState.RESIDENT), None)

    def _known(self, teacher_id: str) -> None:
        if teacher_id not in self._backends:
            raise KeyError(f"unknown teacher {teacher_id!r}; pool has {sorted(self._backends)}")

    # ---- failure handling ----------------------------------------------------------------
    def _break(self, teacher_id: str, err: BaseException) -> None:
        self._state[teacher_id] = TeacherState.BROKEN
        self._errors[teacher_id] = _detached(err)
        self._on_event(teacher_id, "broken")
        try:
            self._backends[teacher_id].close()
        except Exception:  # noqa: BLE001 - cleanup after a failure must not mask the failure
            pass

    def _call(self, teacher_id: str, method: str, *args: Any) -> Any:
        """Run a back-end method once; any exception breaks the teacher and propagates."""
        try:
            return getattr(self._backends[teacher_id], method)(*args)
        except Exception as err:
            self._break(teacher_id, err)
            raise

    def _check_usable(self, teacher_id: str) -> None:
        if self._closed:
            raise TeacherStateError("teacher pool is closed")
        self._known(teacher_id)
        if self._state[teacher_id] is TeacherState.BROKEN:
            err = self._errors.get(teacher_id)
            raise TeacherBrokenError(f"teacher {teacher_id!r} is BROKEN after: {type(err).__name__}: {err}") from err

    # ---- prefetch ------------------------------------------------------------------------
    def prefetch(self, teacher_id: str) -> None:
        """Start staging ``teacher_id``'s weights on the background thread (no-op if it is
        resident, already staged, or prefetch is disabled)."""
        self._check_usable(teacher_id)
        if not self.config.prefetch or self._state[teacher_id] is TeacherState.RESIDENT:
            return
        if teacher_id in self._prefetch:
            return
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mopd-prefetch")
        self._on_event(teacher_id, "prefetch")
        self._prefetch[teacher_id] = self._executor.submit(self._backends[teacher_id].prefetch)

    def _wait_prefetch(self, teacher_id: str) -> None:
        fut = self._prefetch.pop(teacher_id, None)
        if fut is None:
            return
        try:
            fut.result(timeout=self.config.wait_timeout_s)
        except cf.TimeoutError as err:
            self._break(teacher_id, err)
            raise TeacherTimeoutError(
                f"prefetch of teacher {teacher_id!r} did not finish in pool.wait_timeout_s="
                f"{self.config.wait_timeout_s}s") from err
        except Exception as err:
            self._break(teacher_id, err)
            raise

    # ---- acquire / release ---------------------------------------------------------------
    def acquire(self, teacher_id: str, *, prefetch_next: str | None = None) -> Lease:
        """Make ``teacher_id`` RESIDENT and lease it. Waits (bounded by
        ``pool.wait_timeout_s``) while another lease is held; then offloads the previous
        resident teacher. ``prefetch_next`` starts staging the next teacher afterwards."""
        self._check_usable(teacher_id)
        with self._cond:
            if not self._cond.wait_for(lambda: self._lease is None or self._closed,
                                       timeout=self.config.wait_timeout_s):
                raise TeacherTimeoutError(
                    f"acquire({teacher_id!r}) waited pool.wait_timeout_s={self.config.wait_timeout_s}s "
                    f"for the lease held on {self._lease.teacher_id!r}")
            self._check_usable(teacher_id)
            self._next_lease += 1
            lease = Lease(self, teacher_id, self._next_lease)
            self._lease = lease
        try:
            other = self.resident()
            if other is not None and other != teacher_id:
                self.offload(other)
            state = self._state[teacher_id]
            if state is not TeacherState.RESIDENT:
                self._wait_prefetch(teacher_id)
                event = "load" if state is TeacherState.EMPTY else "onload"
                self._call(teacher_id, event)
                self._state[teacher_id] = TeacherState.RESIDENT
                self._on_event(teacher_id, event)
        except BaseException:
            self._end_lease(lease)
            raise
        if prefetch_next is not None and prefetch_next != teacher_id:
            self.prefetch(prefetch_next)
        return lease

    def release(self, lease: Lease, receipt: DrainReceipt) -> None:
        """End ``lease``. Refused (:class:`DrainError`) unless ``receipt`` is this lease's
        complete drain receipt; the teacher stays RESIDENT for reuse."""
        if lease is not self._lease or lease.released:
            raise TeacherStateError(f"lease {lease.lease_id} of {lease.teacher_id!r} is not the active lease")
        if receipt.lease_id != lease.lease_id or receipt.teacher_id != lease.teacher_id:
            raise DrainError(f"receipt for lease {receipt.lease_id} ({receipt.teacher_id!r}) does not match "
                             f"lease {lease.lease_id} ({lease.teacher_id!r})")
        current = lease.drain()
        if not (receipt.complete and current.complete):
            raise DrainError(
                f"release of {lease.teacher_id!r} refused: {current.issued} outputs issued, {current.taken} taken, "
                f"{current.alive} still referenced by a consumer")
        self._end_lease(lease)

    def _end_lease(self, lease: Lease) -> None:
        with self._cond:
            lease.released = True
            if self._lease is lease:
                self._lease = None
            self._cond.notify_all()

    def offload(self, teacher_id: str) -> None:
        """RESIDENT → OFFLOADED (no-op when already offloaded or empty; refused while leased
        by another caller)."""
        self._check_usable(teacher_id)
        if self._state[teacher_id] is not TeacherState.RESIDENT:
            return
        if self._lease is not None and self._lease.teacher_id == teacher_id:
            raise TeacherStateError(f"offload of {teacher_id!r} refused: lease {self._lease.lease_id} is held")
        self._call(teacher_id, "offload")
        self._state[teacher_id] = TeacherState.OFFLOADED
        self._on_event(teacher_id, "offload")

    def close(self) -> None:
        """Close every back-end (errors are collected, not raised twice); idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        if self._executor is not None:
            running = {tid: f for tid, f in self._prefetch.items() if not f.done()}
            cf.wait(running.values(), timeout=self.config.wait_timeout_s)
            self._executor.shutdown(wait=False, cancel_futures=True)
            for tid, f in running.items():
                if not f.done():
                    self._errors[tid] = TeacherTimeoutError(
                        f"close: prefetch of teacher {tid!r} still running after pool.wait_timeout_s="
                        f"{self.config.wait_timeout_s}s; left behind")
        for tid, backend in self._backends.items():
            if self._state[tid] is not TeacherState.BROKEN:
                try:
                    backend.close()
                except Exception as err:  # noqa: BLE001 - keep closing the others
                    self._errors[tid] = _detached(err)
            self._state[tid] = TeacherState.CLOSED
            self._on_event(tid, "close")

    def __enter__(self) -> TeacherPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _detached(err: BaseException) -> BaseException:
    """A copy of ``err`` (type, args, attributes) without traceback, cause or context, so that
    keeping it keeps no frame, hence no tensor, alive."""
    try:
        clone = copy.copy(err)
    except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt from its args
        clone = TeacherStateError(f"{type(err).__name__}: {err}")
    clone.__traceback__ = clone.__cause__ = clone.__context__ = None
    return clone
