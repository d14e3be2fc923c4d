"""The shared teacher source: a metadata-only control plane between one producer and many students.

The source admits samples per node (:class:`~shared_teacher.admission.NodeGate`), records the
producer's published :class:`SampleRef`\\ s, forms one dispatch window per optimizer step for each
student, and frees a sample object only when every live student has settled it (durable ack at
its step, resume skip, or epoch-tail drop) and every failed student has been fenced. It never
touches tensors except through ``store.release``.

Threading: every public method takes the lock; blocking methods wait on one condition with a
timeout. A monitor thread expires leases, fences failed students and runs the watchdog. The RPC
server (:mod:`shared_teacher.rpc`) calls these methods from its connection threads.

Per student ``c`` and node ``n`` the dispatcher keeps a cursor into the node's stream (node
positions ``s``: epoch ``s // D_n``, ``s % D_n``-th position of that epoch on ``n``). A window
takes, per node, the next ``Q_cn`` unsettled samples (unpacked) or a next-fit packing of
``ranks × accumulation`` bins (packed); ranks are node-major and each rank gets
``accumulation_steps`` micro-batches. At most two windows are outstanding per student; the second
is formed only after every rank fast-acked (read) all of the first (backpressure).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, fields
from pathlib import Path

from shared_teacher.admission import NodeGate, node_epoch_sizes, preflight
from shared_teacher.config import CompatKey, SourceConfig
from shared_teacher.dispatch import _Dispatch, _Entry, _Lease, _Student, _Window
from shared_teacher.errors import (
    IncompatibleSubscriptionError,
    LeaseExpiredError,
    PublishError,
    SourceClosedError,
    SourceConfigError,
    WaitTimeoutError,
)
from shared_teacher.ledger import StudentCursor, atomic_write_json
from shared_teacher.lifecycle import _Lifecycle
from shared_teacher.refs import SampleRef, epoch_order, node_position, sample_id
from shared_teacher.store import FeatureStore

__all__ = ["SharedTeacherSource"]


class SharedTeacherSource(_Dispatch, _Lifecycle):
    """Control plane of one shared teacher stream (see module docstring).

    Args:
        config: the source config; :func:`~shared_teacher.admission.preflight` runs here and
            raises :class:`~shared_teacher.errors.AdmissionConfigError` before any work starts.
        store: the feature store the producer writes to (used here only for ``release``).
        monitor: start the lease/fencing/watchdog thread (tests may drive :meth:`tick` by hand).
    """

    def __init__(self, config: SourceConfig, store: FeatureStore, *, monitor: bool = True) -> None:
        self.report = preflight(config)
        self.cfg = config
        self.store = store
        self.nodes = list(config.nodes)
        self.sizes = node_epoch_sizes(config.dataset_size, self.nodes)
        self._cv = threading.Condition()
        self._students = {s.name: _Student(spec=s) for s in config.students}
        self._gates = {n: NodeGate(config.nodes[n], max_sample_bytes=config.max_sample_bytes) for n in self.nodes}
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._admit_pos: dict[str, int] = {}
        self._generations: dict[tuple[str, int], int] = {}
        self._orders: dict[int, list[int]] = {}
        self._leases: dict[str, tuple[str, int]] = {}
        self._start_epoch: int | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self._last_progress = time.monotonic()
        self.errors: list[BaseException] = []
        self.events: list[tuple[str, str, float]] = []  # (event, student, monotonic time) of failures/fencing
        self.counters = {"admitted": 0, "skipped": 0, "published": 0, "freed": 0, "windows": 0, "dropped": 0}
        self._fencers: dict[str, threading.Thread] = {}
        self._monitor = threading.Thread(target=self._monitor_loop, name="shared-teacher-monitor", daemon=True)
        if monitor:
            self._monitor.start()

    # ---------------------------------------------------------------- positions
    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            k = self.cfg.key
            self._orders[epoch] = epoch_order(self.cfg.dataset_size, seed=k.seed, epoch=epoch, order=k.epoch_order)
        return self._orders[epoch]

    def locate(self, node: str, s: int) -> tuple[int, int, str]:
        """Node stream position → (epoch, dataset index, sample id)."""
        epoch, p = node_position(s, self.nodes.index(node), len(self.nodes), self.sizes[node])
        index = self._order(epoch)[p]
        return epoch, index, sample_id(epoch, index)

    def _epoch_end(self, node: str, epoch: int) -> int:
        return (epoch + 1) * self.sizes[node]

    # ---------------------------------------------------------------- subscription
    def subscribe(self, *, student: str, rank: int, pid: int, key: dict, resume: dict | None = None) -> dict:
        """Register reader ``rank`` of ``student`` (process ``pid``); returns ``{lease, world_size, node}``.

        Raises :class:`IncompatibleSubscriptionError` naming every differing key field.
        """
        theirs = self._key_of(key, f"student {student!r}")
        diff = self.cfg.key.differences(theirs)
        if diff:
            lines = ", ".join(f"{k}: source={a!r} student={b!r}" for k, (a, b) in diff.items())
            raise IncompatibleSubscriptionError(f"student {student!r} is incompatible with this source: {lines}", diff)
        with self._cv:
            self._check_open()
            if student not in self._students:
                raise SourceConfigError(f"subscribe: unknown student {student!r}; configured: {list(self._students)}")
            st = self._students[student]
            if not 0 <= rank < st.spec.world_size:
                raise SourceConfigError(f"subscribe: rank={rank} out of range for student {student!r} "
                                        f"(world_size={st.spec.world_size})")
            if st.status not in ("pending", "live"):
                raise LeaseExpiredError(f"student {student!r} is {st.status}; it cannot subscribe to this source")
            cur = StudentCursor.from_dict(resume)
            if st.leases and cur.to_dict() != st.cursor.to_dict():
                raise SourceConfigError(f"subscribe: rank {rank} of {student!r} resumes from step {cur.step} epoch "
                                        f"{cur.epoch}, other ranks from step {st.cursor.step} epoch {st.cursor.epoch}")
            if rank in st.leases:
                self._leases.pop(st.leases[rank].lease_id, None)
            lease = _Lease(lease_id=uuid.uuid4().hex, rank=rank, pid=pid, beat=time.monotonic())
            st.leases[rank] = lease
            st.cursor = cur
            st.skip = set(cur.settled)
            self._leases[lease.lease_id] = (student, rank)
            if len(st.leases) == st.spec.world_size:
                st.status = "live"
            self._maybe_start()
            self._progress()
            return {"lease": lease.lease_id, "world_size": st.spec.world_size, "node": st.spec.rank_nodes()[rank]}

    def register_owned_pids(self, student: str, pids: list[int]) -> None:
        """Declare processes this launcher started for ``student``: fencing may SIGKILL them."""
        with self._cv:
            self._students[student].owned_pids.update(int(p) for p in pids)

    @staticmethod
    def _key_of(key: dict, who: str) -> CompatKey:
        if not isinstance(key, dict):
            raise SourceConfigError(f"{who}: key must be a dict of CompatKey fields, got {type(key).__name__}")
        unknown = sorted(set(key) - {f.name for f in fields(CompatKey)})
        if unknown:
            raise SourceConfigError(f"{who}: key has unknown CompatKey fields {unknown}")
        try:
            return CompatKey(**key)
        except TypeError as err:  # a required field is missing
            raise SourceConfigError(f"{who}: key is not a CompatKey: {err}") from None

    def _maybe_start(self) -> None:
        """Start once every student is live or out (failed before it could subscribe fully, fenced):
        a student that died early must not keep the others from ever starting."""
        if self._start_epoch is not None or any(s.status == "pending" for s in self._students.values()):
            return
        live = [s for s in self._students.values() if s.status == "live"] or list(self._students.values())
        self._start_epoch = min(s.cursor.epoch for s in live)
        for n in self.nodes:
            self._admit_pos[n] = self._start_epoch * self.sizes[n]
        for st in self._students.values():
            st.epoch = st.cursor.epoch
            st.node_pos = {n: st.cursor.epoch * self.sizes[n] for n in self.nodes}
        self._pump()
        self._cv.notify_all()

    # ---------------------------------------------------------------- producer side
    def plan(self, *, key: dict, timeout: float) -> dict:
        """Block until every student subscribed (or failed); returns where production starts.

        ``key``: the producer's :class:`CompatKey` (as a dict). It must equal the source's in every
        field (the producer's seed, order and ``max_length`` decide which samples it scores and how),
        else :class:`IncompatibleSubscriptionError` names the differing fields.
        """
        theirs = self._key_of(key, "producer")
        diff = {f.name: (getattr(self.cfg.key, f.name), getattr(theirs, f.name)) for f in fields(CompatKey)
                if getattr(self.cfg.key, f.name) != getattr(theirs, f.name)}
        if diff:
            lines = ", ".join(f"{k}: source={a!r} producer={b!r}" for k, (a, b) in diff.items())
            raise IncompatibleSubscriptionError(f"the producer is incompatible with this source: {lines}", diff)
        with self._cv:
            try:
                self._wait(lambda: self._start_epoch is not None, timeout, "plan")
            except WaitTimeoutError:
                missing = {n: f"{len(s.leases)} of {s.spec.world_size} ranks" for n, s in self._students.items()
                           if s.status == "pending"}
                raise WaitTimeoutError(f"plan: students {missing} did not subscribe within {timeout:.1f}s") from None
            return {"start_epoch": self._start_epoch, "num_epochs": self.cfg.num_epochs, "nodes": self.nodes,
                    "sizes": self.sizes, "schema_key": self.cfg.key.schema_key(),
                    "start": dict(self._admit_pos)}

    def admit(self, *, node: str, lengths: list[int], timeout: float) -> list[dict]:
        """Admit a prefix of the next positions of ``node`` (``lengths[j]``: tokens of the j-th next one).

        Waits up to ``timeout`` for the gate to open; returns ``[]`` on timeout or at end of stream.
        Each decision is ``{s, sample_id, epoch, index, generation, produce}``; ``produce=False``
        means no live student needs it (skipped, not counted in flight).
        """
        with self._cv:
            if self._start_epoch is None:
                raise SourceConfigError("admit: call plan() first; not every student has subscribed")
            if node not in self.sizes:
                raise SourceConfigError(f"admit: unknown node {node!r}; SourceConfig.nodes has {self.nodes}")
            end = self.cfg.num_epochs * self.sizes[node]
            self._wait(lambda: self._admit_pos.get(node, end) >= end or self._gate_open(node), timeout, None)
            out = []
            for tokens in lengths:
                s = self._admit_pos[node]
                if s >= end:
                    break
                if not (self.cfg.min_seq_len <= tokens <= self.cfg.max_seq_len):
                    raise SourceConfigError(f"admit: sample at node {node!r} position {s} has {tokens} tokens, "
                                            f"outside [min_seq_len={self.cfg.min_seq_len}, "
                                            f"max_seq_len={self.cfg.max_seq_len}]")
                epoch, index, sid = self.locate(node, s)
                pins = {c for c, st in self._students.items()
                        if st.status == "live" and st.node_pos[node] <= s and sid not in st.skip}
                gen = self._generations.get((node, s), 0) + 1
                if not pins:
                    self._admit_pos[node] = s + 1
                    self.counters["skipped"] += 1
                    out.append({"s": s, "sample_id": sid, "epoch": epoch, "index": index, "generation": gen,
                                "produce": False})
                    continue
                if not self._gate_open(node):
                    break
                self._generations[(node, s)] = gen
                self._gates[node].admit(tokens)
                self._entries[(node, s)] = _Entry(node=node, s=s, sid=sid, epoch=epoch, tokens=tokens,
                                                  generation=gen, pins=pins)
                self._admit_pos[node] = s + 1
                self.counters["admitted"] += 1
                out.append({"s": s, "sample_id": sid, "epoch": epoch, "index": index, "generation": gen,
                            "produce": True})
            if out:
                self._progress()
            return out

    def requeue_unpublished(self, *, node: str | None = None) -> int:
        """A producer died: forget its admitted-but-unpublished samples so a new producer redoes them.

        Their reservations are returned, any partial objects aborted, and admission rewinds to the
        first of them; the next admission of a position gets ``generation + 1``, so a late
        ``publish`` from the dead producer is released as stale. Returns how many were requeued.
        """
        with self._cv:
            count = 0
            for n in [node] if node else self.nodes:
                lost = sorted(s for (m, s), e in self._entries.items() if m == n and e.ref is None)
                for s in lost:
                    e = self._entries.pop((n, s))
                    self._gates[n].free(e.tokens, self.cfg.max_sample_bytes)
                    self.store.abort(sample_id=e.sid, generation=e.generation, node=n)
                if lost:
                    self._admit_pos[n] = lost[0]
                    count += len(lost)
            self._progress()
            self._cv.notify_all()
            return count

    def publish(self, *, refs: list[dict]) -> None:
        """Record committed objects (``SampleRef`` fields as dicts); frees any that lost all pins meanwhile.

        A ref of an older attempt (a requeued position, see :meth:`requeue_unpublished`) is stale:
        its object is released and nothing else happens. A ref the source cannot place raises
        :class:`PublishError` (its object released) and fails the source (see the error)."""
        with self._cv:
            self._check_open()
            for r in refs:
                ref = SampleRef(**r)
                s = self._check_publish(ref)
                e = self._entries.get((ref.node, s))
                if e is None or ref.generation < e.generation:
                    self.store.release(ref)  # stale attempt: never visible to students
                    continue
                if e.ref is not None:
                    continue  # the same ref again (a producer retrying a publish whose reply was lost)
                e.ref = ref
                self._gates[ref.node].publish(ref.nbytes)
                self.counters["published"] += 1
                if not e.pins:
                    self._free(e)
            self._pump()
            self._progress()

    def _check_publish(self, ref: SampleRef) -> int:
        """The node stream position of ``ref``, or :class:`PublishError` (fatal) if it cannot be placed."""
        n = len(self.nodes)
        why = None
        if ref.node not in self.sizes:
            why = f"unknown node {ref.node!r} (SourceConfig.nodes has {self.nodes})"
        elif ref.schema_key != self.cfg.key.schema_key():
            why = f"schema_key {ref.schema_key!r} is not this source's {self.cfg.key.schema_key()!r}"
        elif ref.position % n != self.nodes.index(ref.node) or not 0 <= ref.position < self.cfg.dataset_size:
            why = (f"epoch position {ref.position} is not on node {ref.node!r} (position p lives on "
                   f"nodes[p % {n}])")
        elif not 0 <= ref.epoch < self.cfg.num_epochs:
            why = f"epoch {ref.epoch} outside [0, num_epochs={self.cfg.num_epochs})"
        elif ref.nbytes > self.cfg.max_sample_bytes:
            why = (f"object of {ref.nbytes} bytes exceeds SourceConfig.max_sample_bytes={self.cfg.max_sample_bytes} "
                   "(admission reserved that much; raise max_sample_bytes, e.g. with features.max_object_bytes)")
        else:
            s = ref.epoch * self.sizes[ref.node] + ref.position // n
            admitted = self._generations.get((ref.node, s), 0)
            e = self._entries.get((ref.node, s))
            if ref.generation > admitted:
                why = f"generation {ref.generation} of node {ref.node!r} position {s} was never admitted"
            elif e is not None and e.generation == ref.generation and e.sid != ref.sample_id:
                why = (f"node {ref.node!r} position {s} holds {e.sid}, not {ref.sample_id} "
                       "(the producer follows another order: seed or epoch_order)")
            elif e is not None and e.generation == ref.generation and e.ref is not None and e.ref != ref:
                why = f"{ref.sample_id} generation {ref.generation} was already published as another object"
            else:
                return s
        self.store.release(ref)
        err = PublishError(f"publish of {ref.sample_id} (generation {ref.generation}) refused: {why}; "
                           "the source stops: its order and memory caps no longer hold")
        self._fail(err)
        raise err

    def _fail(self, err: BaseException) -> None:
        """Make ``err`` fatal: every waiting and later call raises it."""
        if self._fatal is None:
            self._fatal = err
        self.errors.append(err)
        self._cv.notify_all()

    # ---------------------------------------------------------------- reader side
    def heartbeat(self, *, lease: str) -> None:
        with self._cv:
            st, rank = self._lease(lease)
            st.leases[rank].beat = time.monotonic()

    def next_window(self, *, lease: str, timeout: float) -> dict | None:
        """This rank's share of the student's next window, or ``None`` at end of stream.

        ``{window, epoch, micro_batches: [[SampleRef dict, ...] × accumulation_steps]}``.
        """
        with self._cv:
            st, rank = self._lease(lease)

            def ready() -> bool:
                self._lease(lease)
                return st.status == "done" or any(rank not in w.delivered for w in st.windows.values())

            self._wait(ready, timeout, f"next_window: student {st.spec.name!r} rank {rank}")
            pending = [w for i, w in sorted(st.windows.items()) if rank not in w.delivered]
            if not pending:
                return None
            w = pending[0]
            w.delivered.add(rank)
            mbs = [[asdict(self._entries[k].ref) for k in mb] for mb in w.parts[rank]]
            return {"window": w.index, "epoch": w.epoch, "micro_batches": mbs}

    def ack_read(self, *, lease: str, window: int, micro: int) -> None:
        """Fast ack: this rank has read (copied out) micro-batch ``micro`` of ``window``.

        Once every rank fast-acked every micro-batch of the outstanding window, the next window may
        be formed (dispatch backpressure); pins stay until :meth:`ack_step`.
        """
        with self._cv:
            st, rank = self._lease(lease)
            w = st.windows.get(window)
            if w is not None:
                w.read.add((rank, micro))
                self._pump()
                self._progress()

    def ack_step(self, *, lease: str, window: int, timeout: float) -> dict:
        """Durable ack at the optimizer step that consumed ``window``; returns the student's cursor.

        Blocks until every rank of the student acked the window (their step is one collective).
        """
        with self._cv:
            st, rank = self._lease(lease)
            w = st.windows.get(window)
            if w is None:
                if window < st.next_window:
                    return st.cursor.to_dict()  # all ranks acked already
                raise SourceConfigError(f"ack_step: student {st.spec.name!r} has no window {window}")
            w.acked.add(rank)
            if len(w.acked) == st.spec.world_size:
                self._settle_window(st, w)
            self._wait(lambda: window not in st.windows, timeout,
                       f"ack_step: student {st.spec.name!r} window {window}, waiting for all ranks")
            return st.cursor.to_dict()

    def _settle_window(self, st: _Student, w: _Window) -> None:
        del st.windows[w.index]
        settled = set(st.cursor.settled)
        for k in w.keys:
            e = self._entries[k]
            settled.add(e.sid)
            self._unpin(e, st.spec.name)
        st.cursor = StudentCursor(epoch=st.cursor.epoch, settled=sorted(settled), step=st.cursor.step + 1)
        self._advance_durable(st)
        self._persist(st)
        self._pump()
        self._cv.notify_all()

    def _advance_durable(self, st: _Student) -> None:
        """Move the durable cursor past dropped epoch tails once no older window is outstanding."""
        while st.drops and not any(w.epoch <= st.drops[0] for w in st.windows.values()):
            st.cursor = StudentCursor(epoch=st.drops.pop(0) + 1, settled=[], step=st.cursor.step)

    def _persist(self, st: _Student) -> None:
        if self.cfg.state_dir:
            atomic_write_json(Path(self.cfg.state_dir) / f"{st.spec.name}.ledger.json", st.cursor.to_dict())

    # ---------------------------------------------------------------- helpers
    def _lease(self, lease: str) -> tuple[_Student, int]:
        if self._fatal is not None:
            raise self._fatal
        if lease not in self._leases:
            raise LeaseExpiredError(f"lease {lease[:8]}… is not valid (expired, fenced, or replaced)")
        name, rank = self._leases[lease]
        return self._students[name], rank

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise SourceClosedError("the source is closed")

    def _wait(self, pred, timeout: float, what: str | None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            if pred():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                if what is None:
                    return
                raise WaitTimeoutError(f"{what}: timed out after {timeout:.1f}s")
            self._cv.wait(min(left, 0.2))

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._monitor.is_alive():
            self._monitor.join(timeout=2)
