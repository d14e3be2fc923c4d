"""Internal state records of the source and the dispatcher mixin (window formation, freeing).

Split from :mod:`shared_teacher.source` for size; not a public API.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared_teacher.config import StudentSpec
from shared_teacher.ledger import StudentCursor
from shared_teacher.refs import SampleRef

_MAX_OUTSTANDING = 2


@dataclass
class _Entry:
    """One admitted sample: node stream position ``s``, the students pinning it, its ref once published."""

    node: str
    s: int
    sid: str
    epoch: int
    tokens: int
    generation: int
    pins: set[str]
    ref: SampleRef | None = None


@dataclass
class _Window:
    """One optimizer step of one student: per rank, micro-batches of entry keys; delivery/read/ack sets."""

    index: int
    epoch: int
    parts: dict[int, list[list[tuple[str, int]]]]
    keys: list[tuple[str, int]]
    delivered: set[int] = field(default_factory=set)
    read: set[tuple[int, int]] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)


@dataclass
class _Lease:
    """A reader rank's lease: owner pid and last heartbeat (monotonic seconds)."""

    lease_id: str
    rank: int
    pid: int
    beat: float


@dataclass
class _Student:
    """Per-student state: status, durable cursor, dispatch position per node, outstanding windows."""

    spec: StudentSpec
    status: str = "pending"  # pending → live → done | failed → fencing → fenced | blocked
    cursor: StudentCursor = field(default_factory=StudentCursor)
    skip: set[str] = field(default_factory=set)
    node_pos: dict[str, int] = field(default_factory=dict)
    windows: dict[int, _Window] = field(default_factory=dict)
    next_window: int = 0
    leases: dict[int, _Lease] = field(default_factory=dict)
    owned_pids: set[int] = field(default_factory=set)
    advanced: int = 0
    epoch: int = 0  # dispatch epoch (the durable cursor's epoch lags it until older windows are acked)
    drops: list[int] = field(default_factory=list)  # epochs whose tails were dropped, not yet durable
    reason: str = ""
    left: bool = False  # stopped by leave(): fenced on exit, never SIGKILLed


class _Dispatch:
    """Window formation and freeing; mixed into :class:`~shared_teacher.source.SharedTeacherSource`
    (all state lives there; every method runs under its lock)."""

    # ---------------------------------------------------------------- dispatch
    def _pump(self) -> None:
        """Form every window that can be formed now (called under the lock after each change)."""
        if self._start_epoch is None:
            return
        live = [st for st in self._students.values() if st.status == "live"]
        for st in live:
            while self._try_window(st, live):
                pass
        self._cv.notify_all()

    def _try_window(self, st: _Student, live: list[_Student]) -> bool:
        if len(st.windows) >= _MAX_OUTSTANDING:
            return False
        full = st.spec.world_size * st.spec.accumulation_steps
        if st.windows and any(len(w.read) < full for w in st.windows.values()):
            return False
        if st.advanced - min(s.advanced for s in live) > self.cfg.lag_cap_samples:
            return False
        epoch = st.epoch
        if epoch >= self.cfg.num_epochs:
            if not st.windows:
                st.status = "done"
                self._cv.notify_all()
            return False
        spec = st.spec
        takes: dict[str, list[int]] = {}
        bins: dict[str, list[list[int]]] = {}
        tail = False
        for n in self.nodes:
            cands = self._candidates(st, n, epoch)
            nbins = spec.ranks_per_node[n] * spec.accumulation_steps
            if not spec.packed:
                q = spec.quantum(n)
                first = list(itertools.islice(cands, q))
                if len(first) < q:
                    tail = True
                    break
                if any((n, s) not in self._entries or self._entries[(n, s)].ref is None for s in first):
                    return False
                takes[n] = first
                per = spec.micro_batch_size
                bins[n] = [first[b * per:(b + 1) * per] for b in range(nbins)]
            else:
                ready, tokens, whole = [], 0, True
                for s in cands:
                    e = self._entries.get((n, s))
                    if e is None or e.ref is None or tokens >= spec.quantum(n):
                        whole = False
                        break
                    ready.append(s)
                    tokens += e.tokens
                if tokens < spec.quantum(n) and not whole:
                    return False
                packed = self._next_fit(n, ready, spec.pack_budget_tokens, nbins)
                if whole and any(not b for b in packed):
                    tail = True
                    break
                bins[n] = packed
                takes[n] = [s for b in packed for s in b]
        if tail:
            self._drop_epoch_tail(st, epoch)
            return True
        w = _Window(index=st.next_window, epoch=epoch, parts={}, keys=[])
        rank = 0
        for n in self.nodes:
            r_n = spec.ranks_per_node[n]
            for j in range(r_n):
                w.parts[rank + j] = [[(n, s) for s in bins[n][m * r_n + j]] for m in range(spec.accumulation_steps)]
            rank += r_n
            w.keys.extend((n, s) for s in takes[n])
            last = takes[n][-1]
            passed = last + 1 - st.node_pos[n]
            st.node_pos[n] = last + 1
            st.advanced += passed
        st.windows[w.index] = w
        st.next_window += 1
        self.counters["windows"] += 1
        return True

    def _candidates(self, st: _Student, node: str, epoch: int) -> Iterator[int]:
        """Unsettled node positions of ``epoch`` from the student's cursor (skips resume-settled ids)."""
        for s in range(st.node_pos[node], self._epoch_end(node, epoch)):
            if not st.skip or self.locate(node, s)[2] not in st.skip:
                yield s

    def _next_fit(self, node: str, ready: list[int], budget: int, nbins: int) -> list[list[int]]:
        bins: list[list[int]] = [[] for _ in range(nbins)]
        b, used = 0, 0
        for s in ready:
            t = self._entries[(node, s)].tokens
            if used + t > budget:
                b, used = b + 1, 0
                if b == nbins:
                    break
            bins[b].append(s)
            used += t
        return bins

    def _drop_epoch_tail(self, st: _Student, epoch: int) -> None:
        """The student cannot fill another window in ``epoch``: settle the rest and move to the next."""
        for n in self.nodes:
            end = self._epoch_end(n, epoch)
            for s in range(st.node_pos[n], end):
                e = self._entries.get((n, s))
                if e is not None:
                    self._unpin(e, st.spec.name)
                self.counters["dropped"] += 1
            st.advanced += end - st.node_pos[n]
            st.node_pos[n] = end
        st.epoch = epoch + 1
        st.drops.append(epoch)
        self._advance_durable(st)
        self._progress()

    # ---------------------------------------------------------------- admission (rule 3: starvation release)
    def _gate_open(self, node: str) -> bool:
        """May ``node`` admit now? Clears the hysteresis latches first if the node is starving."""
        gate = self._gates[node]
        if gate.latched and not gate.at_hard_cap and self._starving(node):
            gate.release_starved()
        return gate.can_admit()

    def _starving(self, node: str) -> bool:
        """Some live student's next share on ``node`` is not admitted yet (its window waits on this node)."""
        return any(st.status == "live" and not self._share_admitted(st, node) for st in self._students.values())

    def _share_admitted(self, st: _Student, node: str) -> bool:
        """Are the samples of the student's next share on ``node`` admitted (or is its epoch tail a drop)?"""
        if st.epoch >= self.cfg.num_epochs:
            return True
        spec, admitted = st.spec, self._admit_pos[node]
        q, have = spec.quantum(node), 0
        for s in self._candidates(st, node, st.epoch):
            if s >= admitted:
                return False
            if spec.packed:
                e = self._entries.get((node, s))
                have += e.tokens if e is not None else 0
            else:
                have += 1
            if have >= q:
                return True
        return True  # the rest of the epoch is admitted: a (packed) tail window or a tail drop

    # ---------------------------------------------------------------- freeing
    def _unpin(self, e: _Entry, student: str) -> None:
        e.pins.discard(student)
        if not e.pins and e.ref is not None:
            self._free(e)

    def _free(self, e: _Entry) -> None:
        del self._entries[(e.node, e.s)]
        if e.ref is not None:
            self.store.release(e.ref)
            self._gates[e.node].free(e.tokens, e.ref.nbytes)
        else:
            self._gates[e.node].free(e.tokens, self.cfg.max_sample_bytes)
        self.counters["freed"] += 1
        self._cv.notify_all()
