"""Failure isolation (leases, fencing, teardown) and observability (gauges, watchdog) of the source.

A mixin of :class:`~shared_teacher.source.SharedTeacherSource`, split out for size; every method
takes the source's lock. Order on failure: stop dispatching → wait (bounded) for the student's
reader processes to exit → SIGKILL the pids this launcher registered as its own → only then drop
the student's pins. If exit cannot be confirmed: :class:`SourceTeardownBlockedError`, pins kept.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil

from shared_teacher.config import kill_grace_s
from shared_teacher.errors import (
    SharedTeacherError,
    SourceConfigError,
    SourceStalledError,
    SourceTeardownBlockedError,
)
from shared_teacher.ledger import atomic_write_json

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs on this host and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class _Lifecycle:
    """Failure and observability methods (see module docstring)."""

    # ---------------------------------------------------------------- failures
    def leave(self, *, lease: str, reason: str = "left") -> None:
        """A student stops early (step limit, preemption): same path as a failure, fenced on exit,
        but never SIGKILLed: it is healthy and may still be writing its last checkpoint. Its pins
        drop once its processes have exited (``blocked`` until then if that takes longer than
        ``teardown_timeout_s``)."""
        with self._cv:
            st, _ = self._lease(lease)
            st.left = True
            self.fail_student(st.spec.name, reason)

    def fail_student(self, student: str, reason: str) -> None:
        """Stop dispatching to ``student``; fencing (then pin release) follows on the monitor thread.
        A student that fails before the source started no longer holds the start back."""
        with self._cv:
            if student not in self._students:
                raise SourceConfigError(f"fail_student: unknown student {student!r}; configured: "
                                        f"{list(self._students)}")
            st = self._students[student]
            if st.status in ("pending", "live"):
                st.status = "failed"
                st.reason = reason
                self.events.append(("failed", student, time.monotonic()))
                for lid in [ls.lease_id for ls in st.leases.values()]:
                    self._leases.pop(lid, None)
                self._maybe_start()
                self._pump()  # lag bounds of the others no longer include it
                self._cv.notify_all()

    def fence(self, student: str, *, timeout: float | None = None) -> None:
        """Wait for the failed student's reader processes to exit, then drop its pins.

        Waits up to ``timeout`` (default ``teardown_timeout_s``), then SIGKILLs the pids registered
        with :meth:`register_owned_pids` and waits briefly again. If any reader process is still
        alive, raises :class:`SourceTeardownBlockedError` and keeps its pins (memory not recycled).
        """
        with self._cv:
            st = self._students[student]
            if st.status not in ("failed", "blocked"):
                raise SourceConfigError(f"fence: student {student!r} is {st.status}, not failed")
            st.status = "fencing"
            pids = self._pids(st)
            owned = set() if st.left else set(st.owned_pids)
        limit = self.cfg.teardown_timeout_s if timeout is None else timeout
        alive = self._wait_exit(pids, limit)
        for pid in alive & owned:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if alive & owned:
            alive = self._wait_exit(alive, kill_grace_s(limit))
        with self._cv:
            if alive:
                st.status = "blocked"
                why = "it left and is not killed" if st.left else "not owned, or did not die on SIGKILL"
                err = SourceTeardownBlockedError(
                    f"student {student!r}: reader processes {sorted(alive)} still alive after {limit:.1f}s "
                    f"({why}); its pins stay until they exit")
                self.errors.append(err)
                self.events.append(("teardown_blocked", student, time.monotonic()))
                raise err
            self.events.append(("exit_confirmed", student, time.monotonic()))
            for e in list(self._entries.values()):
                if student in e.pins:
                    self._unpin(e, student)
            self.events.append(("pins_released", student, time.monotonic()))
            st.windows.clear()
            st.status = "fenced"
            self._pump()
            self._progress()

    @staticmethod
    def _pids(st) -> set[int]:
        return {ls.pid for ls in st.leases.values()} | set(st.owned_pids)

    @staticmethod
    def _wait_exit(pids: set[int], timeout: float) -> set[int]:
        deadline = time.monotonic() + timeout
        alive = {p for p in pids if pid_alive(p)}
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = {p for p in alive if pid_alive(p)}
        return alive

    def tick(self) -> None:
        """One monitor pass: expire leases (of students still waiting for their other ranks too),
        start fencing, fence again a ``blocked`` student whose processes have all exited since,
        run the watchdog."""
        now = time.monotonic()
        with self._cv:
            for name, st in self._students.items():
                if st.status in ("pending", "live"):
                    late = [ls for ls in st.leases.values() if now - ls.beat > self.cfg.lease_timeout_s]
                    if late:
                        self.fail_student(name, f"rank {late[0].rank} (pid {late[0].pid}) missed heartbeats for "
                                                f"{now - late[0].beat:.1f}s > lease_timeout_s={self.cfg.lease_timeout_s}")
                fencer = self._fencers.get(name)
                retry = (st.status == "blocked" and (fencer is None or not fencer.is_alive())
                         and not any(pid_alive(p) for p in self._pids(st)))
                if (st.status == "failed" and fencer is None) or retry:
                    t = threading.Thread(target=self._fence_quietly, args=(name,), daemon=True)
                    self._fencers[name] = t
                    t.start()
            busy = self._start_epoch is not None and not self.finished()
            if busy and self._fatal is None and now - self._last_progress > self.cfg.watchdog_s:
                path = self._dump("watchdog")
                self._fatal = SourceStalledError(
                    f"no progress for {now - self._last_progress:.1f}s > watchdog_s={self.cfg.watchdog_s}; "
                    f"state dumped to {path}")
                self.errors.append(self._fatal)
                self._cv.notify_all()

    def _fence_quietly(self, name: str) -> None:
        try:
            self.fence(name)
        except SharedTeacherError:
            pass  # recorded in self.errors; the student stays blocked
        except BaseException as e:  # noqa: BLE001 - an unexpected failure must not leave it 'fencing' silently
            with self._cv:
                self._students[name].status = "blocked"
                self.errors.append(e)
                self.events.append(("teardown_blocked", name, time.monotonic()))

    def _monitor_loop(self) -> None:
        while not self._closed:
            try:
                self.tick()
            except BaseException as e:  # noqa: BLE001 - keep monitoring; surface the error to every caller
                with self._cv:
                    self.errors.append(e)
                    self._fatal = self._fatal or e
                    self._cv.notify_all()
            time.sleep(0.05)

    # ---------------------------------------------------------------- observability
    def finished(self) -> bool:
        """Every student is done or fenced, and nothing is left in flight."""
        with self._cv:
            return all(s.status in ("done", "fenced") for s in self._students.values()) and not self._entries

    def wait_finished(self, *, timeout: float) -> None:
        with self._cv:
            self._wait(lambda: all(s.status in ("done", "fenced", "blocked") for s in self._students.values()),
                       timeout, "wait_finished")

    def stats(self) -> dict:
        """Per node: demand / ready / admitted / pinned bytes / gauges; per student: status, lag, step."""
        with self._cv:
            live = [s for s in self._students.values() if s.status == "live"]
            slow = min((s.advanced for s in live), default=0)
            nodes = {}
            for n in self.nodes:
                ents = [e for e in self._entries.values() if e.node == n]
                nodes[n] = {
                    **self._gates[n].snapshot(),
                    "demand": sum(s.spec.quantum(n) for s in live if not s.windows),
                    "ready": sum(1 for e in ents if e.ref is not None),
                    "admitted": len(ents),
                    "pinned_bytes": sum(e.ref.nbytes for e in ents if e.ref is not None and e.pins),
                    "store_bytes": self.store.pool_bytes(n),
                }
            students = {name: {"status": s.status, "reason": s.reason, "epoch": s.epoch, "step": s.cursor.step,
                               "lag": s.advanced - slow, "outstanding": sorted(s.windows),
                               "pins": sum(1 for e in self._entries.values() if name in e.pins)}
                        for name, s in self._students.items()}
            return {"nodes": nodes, "students": students, "counters": dict(self.counters),
                    "start_epoch": self._start_epoch, "admit_pos": dict(self._admit_pos)}

    def _dump(self, tag: str) -> str:
        state = self.stats()
        if not self.cfg.state_dir:
            return f"(no state_dir) {state}"
        path = Path(self.cfg.state_dir) / f"{tag}-{int(time.time() * 1000)}.json"
        atomic_write_json(path, state)
        return str(path)
