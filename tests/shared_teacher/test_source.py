"""The control plane in-process: delivery, pins, gauges, lag, compatibility, fencing, watchdog, resume.

Feature payloads here are small token tensors: the source never looks inside them (the real
teacher runs in test_multiprocess.py and test_features.py). Producer and students are driven by
a seeded random scheduler so many interleavings are exercised.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import asdict

import pytest
import torch

from shared_teacher import (
    CompatKey,
    IncompatibleSubscriptionError,
    NodeLimits,
    SharedTeacherSource,
    ShmStore,
    SourceConfig,
    SourceStalledError,
    StudentSpec,
)
from shared_teacher.errors import LeaseExpiredError, SourceTeardownBlockedError
from shared_teacher.ledger import StudentCursor
from shared_teacher.refs import epoch_order, node_position, sample_id

KEY = CompatKey(teacher_fingerprint="t0", tokenizer="tok", signals=["logprobs", "topk", "hidden"], top_k=8,
                hidden_taps=[1, 3], max_length=16, dataset="d", seed=5)
pytestmark = pytest.mark.filterwarnings("ignore:allow_unproven_layout=True:RuntimeWarning")
N = 30
LENS = torch.randint(2, 17, (N,), generator=torch.Generator().manual_seed(1)).tolist()


def _config(students, *, epochs=2, nodes=("n0", "n1"), high=8, low=7, **kw):
    limits = {n: NodeLimits(high_samples=high, low_samples=low, high_tokens=128, low_tokens=127, byte_cap=8 * 600)
              for n in nodes}
    # Uneven splits and a packed student on two nodes with tight caps: preflight cannot prove progress
    # (the cross-node skew bound needs about an epoch in flight); these tests exercise delivery, with
    # the watchdog as the guard.
    kw = {"allow_unproven_layout": True, "lease_timeout_s": 60, "teardown_timeout_s": 0.5, "watchdog_s": 120, **kw}
    return SourceConfig(key=KEY, nodes=limits, students=students, dataset_size=N, num_epochs=epochs,
                        max_sample_bytes=600, max_seq_len=16, min_seq_len=2, **kw)


STUDENTS = [
    StudentSpec(name="a", ranks_per_node={"n0": 1, "n1": 1}, micro_batch_size=2),
    StudentSpec(name="b", ranks_per_node={"n0": 2, "n1": 1}, micro_batch_size=1, accumulation_steps=2),
    StudentSpec(name="p", ranks_per_node={"n0": 1, "n1": 1}, packed=True, pack_budget_tokens=16),
]


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_harnesses():
    yield
    while _OPEN:
        h = _OPEN.pop()
        h.src.close()
        h.store.close(remove=True)


class Harness:
    """Drives one source with a fake-free producer (real store puts) and per-rank reader state."""

    def __init__(self, cfg, *, resume=None, seed=0, absent=(), before=None):
        """``absent``: students the harness does not subscribe; ``before(src)`` runs before it subscribes."""
        self.cfg, self.store = cfg, ShmStore()
        self.src = SharedTeacherSource(cfg, self.store, monitor=False)
        _OPEN.append(self)
        self.rng = random.Random(seed)
        self.leases, self.pending, self.log = {}, {}, {s.name: [] for s in cfg.students}
        self.produced = 0
        gone = subprocess.Popen(["true"])
        gone.wait()  # an exited, reaped pid: readers of these harness students "live" in this process
        self.gone_pid = gone.pid
        if before is not None:
            before(self.src)
        for s in cfg.students:
            if s.name in absent:
                continue
            for r in range(s.world_size):
                info = self.src.subscribe(student=s.name, rank=r, pid=gone.pid, key=asdict(KEY),
                                          resume=(resume or {}).get(s.name))
                self.leases[(s.name, r)] = info["lease"]
        self.plan = self.src.plan(key=asdict(KEY), timeout=1)

    def produce(self, node):
        src = self.src
        end = self.cfg.num_epochs * src.sizes[node]
        s0 = src._admit_pos[node]
        if s0 >= end:
            return
        lens = [LENS[src.locate(node, s)[1]] for s in range(s0, min(s0 + self.rng.randint(1, 3), end))]
        refs = []
        for d in src.admit(node=node, lengths=lens, timeout=0):
            if d["produce"]:
                self.produced += 1
                p = node_position(d["s"], self.cfg.nodes and list(self.cfg.nodes).index(node), len(self.cfg.nodes),
                                  src.sizes[node])[1]
                ref = self.store.put({"tokens": torch.full((LENS[d["index"]],), d["index"])}, sample_id=d["sample_id"],
                                     generation=d["generation"], node=node, num_tokens=LENS[d["index"]],
                                     schema_key=self.plan["schema_key"], epoch=d["epoch"], position=p)
                refs.append(asdict(ref))
        src.publish(refs=refs)

    def read(self, name, rank):
        lease = self.leases[(name, rank)]
        try:
            w = self.src.next_window(lease=lease, timeout=0)
        except TimeoutError:
            return
        if w is None:
            return
        for m, mb in enumerate(w["micro_batches"]):
            for r in mb:
                got = self.store.get(_ref(r))  # readable while pinned
                assert got["tokens"].numel() == r["num_tokens"]
            self.src.ack_read(lease=lease, window=w["window"], micro=m)
        self.pending.setdefault(name, {}).setdefault(w["window"], {})[rank] = w

    def step(self, name):
        spec = self.cfg.student(name)
        windows = self.pending.get(name, {})
        for wi in sorted(windows):
            if len(windows[wi]) == spec.world_size:
                ws = windows.pop(wi)
                for rank in range(spec.world_size):
                    try:
                        self.src.ack_step(lease=self.leases[(name, rank)], window=wi, timeout=0)
                    except TimeoutError:
                        pass  # other ranks not acked yet: the last one settles the window
                cur = self.src._students[name].cursor
                self.log[name].append({"step": cur.step, "cursor": cur.to_dict(),
                                       "ids": [r["sample_id"] for w in ws.values() for mb in w["micro_batches"]
                                               for r in mb], "epoch": ws[0]["epoch"]})
                return

    def invariants(self):
        st = self.src.stats()
        for n, g in st["nodes"].items():
            lim = self.cfg.nodes[n]
            assert g["in_flight_samples"] <= lim.high_samples, (n, g)
            assert not lim.byte_cap or g["in_flight_bytes"] <= lim.byte_cap, (n, g)
            assert g["in_flight_samples"] == g["admitted"], (n, g)
        live = [s for s in self.src._students.values() if s.status == "live"]
        if live:
            lag = max(s.advanced for s in live) - min(s.advanced for s in live)
            biggest = max(sum(s.spec.quantum(n) if not s.spec.packed else 2 * len(self.cfg.nodes)
                              for n in self.cfg.nodes) for s in live)
            assert lag <= self.cfg.lag_cap_samples + biggest * 4, lag

    def run(self, *, until=None, max_iters=20000, skip=()):
        names = [s.name for s in self.cfg.students if s.name not in skip]
        for _ in range(max_iters):
            if self.src.finished() or (until and until()):
                return
            act = self.rng.random()
            if act < 0.4:
                self.produce(self.rng.choice(list(self.cfg.nodes)))
            else:
                name = self.rng.choice(names)
                spec = self.cfg.student(name)
                if act < 0.8:
                    self.read(name, self.rng.randrange(spec.world_size))
                else:
                    self.step(name)
            self.invariants()
        raise AssertionError(f"no progress: {self.src.stats()}")


def _ref(d):
    from shared_teacher.refs import SampleRef

    return SampleRef(**d)


def _ids(epoch):
    return {sample_id(epoch, i) for i in epoch_order(N, seed=KEY.seed, epoch=epoch)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_students_each_sample_once_per_epoch_and_no_leak(seed):
    h = Harness(_config(STUDENTS, lag_cap_samples=6), seed=seed)
    h.run()
    st = h.src.stats()
    assert h.produced == 2 * N  # one teacher object per sample, not per student
    assert st["counters"]["freed"] == 2 * N and h.store.objects() == []
    assert all(s["status"] == "done" for s in st["students"].values())
    for name in ("a", "b", "p"):
        for epoch in (0, 1):
            seen = [i for row in h.log[name] if row["epoch"] == epoch for i in row["ids"]]
            assert len(seen) == len(set(seen)), (name, epoch)
            missing = _ids(epoch) - set(seen)
            if name == "a":  # Q = 2 per node on 15/15 samples: one 1-sample tail per node dropped
                assert len(missing) == 2
            elif name == "b":  # Q = 4 on n0 (2 ranks × 2 accumulation), 2 on n1 → 3 windows, 15-12 + 15-6 dropped
                assert len(missing) == 12
            else:
                assert len(missing) <= 4
            assert h.src.counters["dropped"] > 0


def test_pins_last_until_every_student_acked_the_step():
    h = Harness(_config(STUDENTS[:2], epochs=1))
    for _ in range(4):
        h.produce("n0")
        h.produce("n1")
    h.read("a", 0)
    h.read("a", 1)
    first = h.pending["a"][0][0]["micro_batches"][0][0]
    h.step("a")  # a settled, b still pins it
    assert any(sid == first["sample_id"] for _, sid, _ in h.store.objects())
    while "b" not in h.pending or 0 not in h.pending.get("b", {}) or len(h.pending["b"][0]) < 3:
        for r in range(3):
            h.read("b", r)
    before = h.store.objects()
    assert any(sid == first["sample_id"] for _, sid, _ in before)
    h.step("b")
    assert not any(sid == first["sample_id"] for _, sid, _ in h.store.objects())


def test_incompatible_student_refused_with_differing_fields():
    h = Harness(_config(STUDENTS[:1], epochs=1))
    bad = CompatKey(teacher_fingerprint="t1", tokenizer="tok", signals=["logprobs", "topk"], top_k=16,
                    hidden_taps=[2], max_length=16, dataset="d", seed=5)
    with pytest.raises(IncompatibleSubscriptionError) as info:
        h.src.subscribe(student="a", rank=0, pid=1, key=asdict(bad))
    assert set(info.value.fields) == {"teacher_fingerprint", "top_k"}
    assert "teacher_fingerprint: source='t0' student='t1'" in str(info.value)
    taps = CompatKey(**{**asdict(KEY), "signals": ["hidden"], "hidden_taps": [2], "seed": 6, "dtype": "bfloat16"})
    with pytest.raises(IncompatibleSubscriptionError) as info:
        h.src.subscribe(student="a", rank=0, pid=1, key=asdict(taps))
    assert set(info.value.fields) == {"hidden_taps", "seed", "dtype"}
    onpolicy = CompatKey(**{**asdict(KEY), "rollout_policy_version": "v7"})
    with pytest.raises(IncompatibleSubscriptionError, match="rollout_policy_version"):
        h.src.subscribe(student="a", rank=0, pid=1, key=asdict(onpolicy))
    subset = CompatKey(**{**asdict(KEY), "signals": ["topk"], "top_k": 4, "hidden_taps": []})
    h.src.subscribe(student="a", rank=0, pid=1, key=asdict(subset))  # a subset of what is captured is served


def test_failed_student_fenced_only_after_its_processes_exit():
    h = Harness(_config(STUDENTS[:2], epochs=1))
    owner = subprocess.Popen(["sleep", "60"])  # a live reader process this source does not own
    try:
        h.src._students["b"].leases[0].pid = owner.pid
        h.run(until=lambda: h.src.stats()["students"]["b"]["pins"] > 0 and h.log["a"], skip=("b",))
        pinned = h.src.stats()["students"]["b"]["pins"]
        h.src.fail_student("b", "test: reader lost")
        with pytest.raises(SourceTeardownBlockedError, match=rf"processes \[{owner.pid}\] still alive"):
            h.src.fence("b", timeout=0.3)
        st = h.src.stats()
        assert st["students"]["b"]["status"] == "blocked" and st["students"]["b"]["pins"] == pinned
        assert len(h.store.objects()) >= pinned  # memory of the blocked student is not recycled
        with pytest.raises(LeaseExpiredError):
            h.src.next_window(lease=h.leases[("b", 0)], timeout=0)
        # the healthy student keeps going while b is blocked
        steps = len(h.log["a"])
        h.run(until=lambda: len(h.log["a"]) > steps + 1, skip=("b",))
        h.src.register_owned_pids("b", [owner.pid])  # now it is ours: fencing may kill it
        h.src.fence("b", timeout=0.3)
        assert owner.wait(timeout=5) == -9
        assert h.src.stats()["students"]["b"]["status"] == "fenced"
        h.run(skip=("b",))
        assert h.store.objects() == [] and h.src.stats()["counters"]["freed"] == h.produced
        names = [e for e, s, _ in h.src.events if s == "b"]
        assert names == ["failed", "teardown_blocked", "exit_confirmed", "pins_released"]
    finally:
        owner.kill()
        owner.wait()


def test_lease_expiry_fails_the_student_and_watchdog_raises(tmp_path):
    cfg = _config(STUDENTS[:1], epochs=1, state_dir=str(tmp_path))
    cfg.lease_timeout_s, cfg.watchdog_s = 0.2, 0.3
    h = Harness(cfg)
    import time

    time.sleep(0.25)
    h.src.tick()  # expires the lease and starts fencing on a thread; the reader pid is gone → fenced
    deadline = time.monotonic() + 5
    while h.src.stats()["students"]["a"]["status"] != "fenced":
        assert time.monotonic() < deadline, h.src.stats()["students"]
        time.sleep(0.01)
    assert "missed heartbeats" in h.src.stats()["students"]["a"]["reason"]
    with pytest.raises(LeaseExpiredError):
        h.src.heartbeat(lease=h.leases[("a", 0)])
    h2 = Harness(_config(STUDENTS[:1], epochs=1, state_dir=str(tmp_path)))
    h2.src.cfg.watchdog_s = 0.2
    time.sleep(0.3)
    h2.src.tick()
    with pytest.raises(SourceStalledError, match="state dumped to .*watchdog-"):
        h2.src.next_window(lease=h2.leases[("a", 0)], timeout=0)
    dumps = list(tmp_path.glob("watchdog-*.json"))
    assert dumps and "in_flight_samples" in dumps[0].read_text()


def test_resume_from_different_checkpoints_exactly_once():
    students = STUDENTS[:2]
    h = Harness(_config(students, epochs=2), seed=3)
    h.run(until=lambda: len(h.log["a"]) >= 12 and len(h.log["b"]) >= 2)
    ck = {"a": h.log["a"][10], "b": h.log["b"][1]}  # a is in epoch 1, b in epoch 0: different checkpoints
    assert ck["a"]["cursor"]["epoch"] == 1 and ck["b"]["cursor"]["epoch"] == 0
    h2 = Harness(_config(students, epochs=2), resume={n: c["cursor"] for n, c in ck.items()}, seed=4)
    assert h2.plan["start_epoch"] == 0
    h2.run()
    assert h2.store.objects() == []
    for name in ("a", "b"):
        k = ck[name]["step"]
        lineage = [r for r in h.log[name] if r["step"] <= k] + h2.log[name]
        assert [r["step"] for r in lineage] == list(range(1, len(lineage) + 1))
        for epoch in (0, 1):
            seen = [i for r in lineage if r["epoch"] == epoch for i in r["ids"]]
            assert len(seen) == len(set(seen)), (name, epoch)  # no duplicates
            assert set(seen) <= _ids(epoch)
            # no gaps: as many as an uninterrupted run (a: 14 + 14 per epoch; b: 3 windows of 4 + 2)
            assert len(seen) == {"a": 28, "b": 18}[name], (name, epoch, len(seen))
    # samples every student had already settled were not produced again
    assert h2.src.counters["skipped"] > 0
    cur = StudentCursor.from_dict(ck["a"]["cursor"])
    assert cur.epoch == 1 and set(cur.settled) <= _ids(1)


def test_dead_producer_requeue_bumps_generation_and_drops_stale_publish():
    from shared_teacher.errors import StaleRefError
    from shared_teacher.refs import SampleRef

    h = Harness(_config(STUDENTS[:1], epochs=1))
    src, store = h.src, h.store
    first = src.admit(node="n0", lengths=[LENS[src.locate("n0", s)[1]] for s in range(3)], timeout=0)
    assert [d["generation"] for d in first] == [1, 1, 1]
    old = [store.put({"x": torch.ones(2)}, sample_id=d["sample_id"], generation=1, node="n0", num_tokens=2,
                     schema_key=h.plan["schema_key"], epoch=0, position=2 * d["s"]) for d in first]
    src.publish(refs=[asdict(old[0])])  # the producer published one object, then died
    assert src.stats()["nodes"]["n0"]["in_flight_samples"] == 3
    assert src.requeue_unpublished(node="n0") == 2
    assert src.stats()["nodes"]["n0"]["in_flight_samples"] == 1 and src._admit_pos["n0"] == 1
    again = src.admit(node="n0", lengths=[LENS[src.locate("n0", s)[1]] for s in (1, 2)], timeout=0)
    assert [(d["s"], d["generation"]) for d in again] == [(1, 2), (2, 2)]
    src.publish(refs=[asdict(old[1])])  # late publish of the dead attempt: released as stale
    with pytest.raises(StaleRefError):
        store.get(SampleRef(**asdict(old[1])))
    assert src.stats()["nodes"]["n0"]["ready"] == 1


def test_starving_student_reopens_a_latched_node():
    """The hysteresis-remainder case on the real source: H = 10, L = 0, Q = 4 on one node. After two
    windows 2 samples stay in flight (< Q, > L); a plain latch would wait forever, the starvation
    release reopens admission and the run completes with every gauge under its hard cap."""
    spec = StudentSpec(name="u", ranks_per_node={"n0": 2}, micro_batch_size=2)
    cfg = SourceConfig(key=KEY, nodes={"n0": NodeLimits(high_samples=10, low_samples=0)}, students=[spec],
                       dataset_size=N, num_epochs=1, max_sample_bytes=600, max_seq_len=16, min_seq_len=2,
                       lease_timeout_s=60, teardown_timeout_s=0.5, watchdog_s=120)
    h = Harness(cfg, seed=3)
    h.run()
    assert h.src._gates["n0"].starvation_releases > 0
    assert h.src.stats()["counters"]["freed"] == N and h.store.objects() == []
