"""Fault promises of the shared teacher source (docs/shared_teacher.md, "Faults"): each test injects
the fault and checks the documented outcome: a typed error, a bounded wait, or the healthy
students carrying on."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, replace

import pytest
import torch

from mcore_distill.errors import ConfigError, McoreDistillError
from shared_teacher import (
    CompatKey,
    IncompatibleSubscriptionError,
    NodeLimits,
    SharedTeacherError,
    SharedTeacherSource,
    ShmStore,
    SourceConfig,
    SourceConfigError,
    SourceServer,
    SourceStalledError,
    StudentReader,
    StudentSpec,
    run_producer,
)
from shared_teacher.admission import NodeGate
from shared_teacher.errors import PublishError, SourceTeardownBlockedError, WaitTimeoutError
from shared_teacher.rpc import SourceClient
from tests.shared_teacher.test_source import _OPEN, KEY, LENS, STUDENTS, Harness, _config  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:allow_unproven_layout=True:RuntimeWarning")


@pytest.fixture(autouse=True)
def _close_harnesses():
    yield
    while _OPEN:
        h = _OPEN.pop()
        h.src.close()
        h.store.close(remove=True)


def _wait_status(h, name, status, *, timeout=10.0):
    deadline = time.monotonic() + timeout
    while h.src.stats()["students"][name]["status"] != status:
        assert time.monotonic() < deadline, h.src.stats()["students"][name]
        h.src.tick()
        time.sleep(0.02)


def test_errors_share_the_foundation_bases():
    import mopd.errors as m

    assert issubclass(SharedTeacherError, McoreDistillError) and issubclass(SourceConfigError, ConfigError)
    assert issubclass(m.MOPDError, McoreDistillError) and issubclass(m.ConfigError, ConfigError)
    assert not issubclass(SourceStalledError, TimeoutError) and issubclass(WaitTimeoutError, TimeoutError)


# ---- item 17: the watchdog must outlast a handled failure ----------------------------------------

@pytest.mark.parametrize("lease,teardown,watchdog", [(10.0, 10.0, 5.0), (10.0, 10.0, 25.5), (1.0, 0.1, float("nan"))])
def test_watchdog_shorter_than_failure_recovery_is_refused(lease, teardown, watchdog):
    """A dead reader is detected after lease_timeout_s and fenced within teardown_timeout_s + kill
    grace (min(teardown, 5) + 0.5); a watchdog shorter than that fails every student first. A NaN
    watchdog is refused by the field check before the cross-field rule."""
    match = (r"SourceConfig.watchdog_s must be a finite number, got nan" if watchdog != watchdog else
             r"SourceConfig.watchdog_s=.* must exceed lease_timeout_s \+ teardown_timeout_s \+ kill grace")
    with pytest.raises(SourceConfigError, match=match):
        _config(STUDENTS[:1], lease_timeout_s=lease, teardown_timeout_s=teardown, watchdog_s=watchdog)
    ok = _config(STUDENTS[:1], lease_timeout_s=lease, teardown_timeout_s=teardown, watchdog_s=25.6)
    assert ok.recovery_bound_s < ok.watchdog_s


# ---- item 12: a reader without a timeout ends when the producer is gone ---------------------------

@pytest.mark.timeout(60)
def test_reader_without_timeout_raises_stall_instead_of_spinning():
    spec = StudentSpec(name="s", ranks_per_node={"n0": 1}, micro_batch_size=2)
    cfg = SourceConfig(key=KEY, nodes={"n0": NodeLimits(high_samples=8, low_samples=4)}, students=[spec],
                       dataset_size=30, max_sample_bytes=600, max_seq_len=16, lease_timeout_s=3.0,
                       teardown_timeout_s=0.1, watchdog_s=4.0)  # a lease that survives a loaded host
    store = ShmStore()
    src = SharedTeacherSource(cfg, store)
    server = SourceServer(src)
    reader = StudentReader(server.connect_info, student="s", rank=0, key=KEY, store_spec=store.spec(),
                           heartbeat_s=0.1, timeout=None)
    calls, real = [], reader.client.call
    reader.client.call = lambda method, **kw: (calls.append(method), real(method, **kw))[1]
    got: list[BaseException] = []

    def wait():
        try:
            reader.next_window()  # no producer ever publishes: the watchdog fires after 4 s
        except BaseException as e:  # noqa: BLE001 - checked below
            got.append(e)

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    th.join(timeout=30)
    spinning = th.is_alive()
    n = len(calls)
    server.close()  # ends a spinning reader (its calls fail with ConnectionError)
    th.join(timeout=10)
    reader.close()
    src.close()
    store.close(remove=True)
    assert not spinning, f"next_window still retrying after 30 s ({n} RPCs)"
    assert len(got) == 1 and isinstance(got[0], SourceStalledError), got
    assert n <= 3, f"{n} next_window RPCs for one stall"


# ---- item 13: blocked students are fenced once their processes exit; leave never kills -----------

def test_blocked_student_is_fenced_once_its_processes_exit():
    h = Harness(_config(STUDENTS[:2], epochs=1))
    owner = subprocess.Popen(["sleep", "60"])  # a live reader process the source does not own
    try:
        h.src._students["b"].leases[0].pid = owner.pid
        h.run(until=lambda: h.src.stats()["students"]["b"]["pins"] > 0 and h.log["a"], skip=("b",))
        h.src.fail_student("b", "test: reader lost")
        with pytest.raises(SourceTeardownBlockedError):
            h.src.fence("b", timeout=0.2)
        assert h.src.stats()["students"]["b"]["status"] == "blocked"
        h.src.tick()
        assert h.src.stats()["students"]["b"]["status"] == "blocked"  # still alive: nothing changes
        owner.kill()
        owner.wait()
        _wait_status(h, "b", "fenced")  # the monitor fences it again, now that it has exited
        h.run(skip=("b",))
        assert h.store.objects() == [] and h.src.stats()["counters"]["freed"] == h.produced
    finally:
        owner.kill()
        owner.wait()


def test_student_that_left_is_not_killed_and_is_fenced_when_it_exits():
    h = Harness(_config(STUDENTS[:2], epochs=1))  # teardown_timeout_s=0.5
    proc = subprocess.Popen(["sleep", "60"])  # still writing its last checkpoint after leave()
    try:
        for ls in h.src._students["b"].leases.values():
            ls.pid = proc.pid
        h.src.register_owned_pids("b", [proc.pid])  # owned: a failed student would be SIGKILLed
        h.run(until=lambda: h.src.stats()["students"]["b"]["pins"] > 0 and h.log["a"], skip=("b",))
        h.src.leave(lease=h.leases[("b", 0)], reason="step limit")
        _wait_status(h, "b", "blocked")
        time.sleep(0.3)
        assert proc.poll() is None, "a student that left was killed"
        proc.terminate()
        proc.wait()
        _wait_status(h, "b", "fenced")
        h.run(skip=("b",))
        assert h.store.objects() == []
    finally:
        proc.kill()
        proc.wait()


# ---- item 14: a student that fails before the start does not hold it back -------------------------

def _subscribe_then_fail_b(src):
    gone = subprocess.Popen(["true"])
    gone.wait()  # b's readers have exited
    for r in range(STUDENTS[1].world_size):
        src.subscribe(student="b", rank=r, pid=gone.pid, key=asdict(KEY))
    src.fail_student("b", "crashed while the others were starting")


@pytest.mark.parametrize("before", [lambda src: src.fail_student("b", "never came"), _subscribe_then_fail_b],
                         ids=["before-subscribing", "after-subscribing"])
def test_student_failing_before_the_start_does_not_block_it(before):
    h = Harness(_config(STUDENTS[:2], epochs=1), absent=("b",), before=before)  # plan() inside returns
    assert h.plan["start_epoch"] == 0
    _wait_status(h, "b", "fenced")
    h.run(skip=("b",))
    st = h.src.stats()
    assert st["students"]["a"]["status"] == "done" and h.store.objects() == []


def test_partly_subscribed_student_that_dies_expires_and_the_source_starts():
    """Rank 0 of b subscribed, then its process died before rank 1 came: its lease expires like a
    live student's, b fails, and the source starts for a (it waited for b forever before)."""
    cfg = _config(STUDENTS[:2], epochs=1, lease_timeout_s=0.3)
    store = ShmStore()
    src = SharedTeacherSource(cfg, store)  # with the monitor thread
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        src.subscribe(student="b", rank=0, pid=gone.pid, key=asdict(KEY))  # never heartbeats again
        for r in range(STUDENTS[0].world_size):
            src.subscribe(student="a", rank=r, pid=os.getpid(), key=asdict(KEY))
        leases = [lid for lid, (name, _) in src._leases.items() if name == "a"]
        stop = threading.Event()

        def beat():  # a's readers are alive
            while not stop.wait(0.05):
                for lid in leases:
                    src.heartbeat(lease=lid)

        th = threading.Thread(target=beat, daemon=True)
        th.start()
        try:
            plan = src.plan(key=asdict(KEY), timeout=20)
        finally:
            stop.set()
            th.join(5)
        assert plan["start_epoch"] == 0
        assert src.stats()["students"]["b"]["status"] in ("failed", "fencing", "fenced")
        assert "missed heartbeats" in src.stats()["students"]["b"]["reason"]
    finally:
        src.close()
        store.close(remove=True)


def test_plan_timeout_names_the_students_still_missing():
    cfg = _config(STUDENTS[:2], epochs=1)
    src = SharedTeacherSource(cfg, ShmStore(), monitor=False)
    try:
        src.subscribe(student="b", rank=0, pid=1, key=asdict(KEY))
        with pytest.raises(WaitTimeoutError, match=r"students \{'a': '0 of 2 ranks', 'b': '1 of 3 ranks'\} did not "
                                                    r"subscribe within 0.2s"):
            src.plan(key=asdict(KEY), timeout=0.2)
    finally:
        src.close()
        src.store.close(remove=True)


# ---- item 15: objects over max_sample_bytes are refused; the byte cap holds ----------------------

def test_node_gate_refuses_an_object_over_the_reserved_size():
    gate = NodeGate(NodeLimits(high_samples=4, low_samples=0, byte_cap=4 * 600), max_sample_bytes=600)
    gate.admit(3)
    with pytest.raises(PublishError, match="object of 12000 bytes exceeds max_sample_bytes=600"):
        gate.publish(12000)
    gate.publish(512)
    assert gate.bytes == 512


def _admit(h, node="n0", k=1):
    src = h.src
    s0 = src._admit_pos[node]
    return src.admit(node=node, lengths=[LENS[src.locate(node, s)[1]] for s in range(s0, s0 + k)], timeout=0)


def _put(h, d, *, nbytes=8, **over):
    """Store the object of admission decision ``d`` (of node n0) with the given ref fields overridden."""
    pos = (d["s"] % h.src.sizes["n0"]) * len(h.cfg.nodes)
    kw = {"sample_id": d["sample_id"], "generation": d["generation"], "node": "n0", "num_tokens": 2,
          "schema_key": h.plan["schema_key"], "epoch": d["epoch"], "position": pos, **over}
    return h.store.put({"x": torch.zeros(nbytes, dtype=torch.uint8)}, **kw)


def test_oversize_object_is_refused_and_fails_the_source():
    h = Harness(_config(STUDENTS[:1], epochs=1))  # max_sample_bytes=600, byte_cap=4800
    (d,) = _admit(h)
    big = _put(h, d, nbytes=12000)
    with pytest.raises(PublishError, match=r"object of \d+ bytes exceeds SourceConfig.max_sample_bytes=600"):
        h.src.publish(refs=[asdict(big)])
    assert h.src.stats()["nodes"]["n0"]["in_flight_bytes"] <= h.cfg.nodes["n0"].byte_cap
    assert (big.node, big.sample_id, big.generation) not in h.store.objects()  # released
    with pytest.raises(PublishError):  # fatal: every waiting or later call raises it
        h.src.next_window(lease=h.leases[("a", 0)], timeout=0)


# ---- item 16: the producer's key and its refs are checked ---------------------------------------

def test_producer_with_another_key_is_refused():
    h = Harness(_config(STUDENTS[:1], epochs=1))
    other = CompatKey(**{**asdict(KEY), "seed": 6, "max_length": 32, "teacher_fingerprint": "t9"})
    with pytest.raises(IncompatibleSubscriptionError, match="producer is incompatible") as info:
        h.src.plan(key=asdict(other), timeout=0)
    assert set(info.value.fields) == {"seed", "max_length", "teacher_fingerprint"}
    with pytest.raises(SourceConfigError, match=r"key has unknown CompatKey fields \['colour'\]"):
        h.src.plan(key={**asdict(KEY), "colour": 1}, timeout=0)


@pytest.mark.timeout(60)
def test_run_producer_with_another_key_fails_before_scoring():
    spec = StudentSpec(name="s", ranks_per_node={"n0": 1}, micro_batch_size=1)
    cfg = SourceConfig(key=KEY, nodes={"n0": NodeLimits(high_samples=4, low_samples=2)}, students=[spec],
                       dataset_size=4, max_sample_bytes=4096, max_seq_len=16)
    store = ShmStore()
    src = SharedTeacherSource(cfg, store)
    server = SourceServer(src)
    scored = []
    try:
        src.subscribe(student="s", rank=0, pid=os.getpid(), key=asdict(KEY))
        with pytest.raises(IncompatibleSubscriptionError, match="seed: source=5 producer=7"):
            run_producer(server.connect_info, store_spec=store.spec(), teacher=lambda seqs: scored.extend(seqs),
                         dataset=[torch.arange(4)] * 4, key=replace(KEY, seed=7))
        assert scored == []
    finally:
        server.close()
        src.close()
        store.close(remove=True)


@pytest.mark.parametrize("case", ["unknown-node", "position-not-on-node", "other-sample", "never-admitted",
                                  "other-schema"])
def test_misplaced_publish_is_refused(case):
    """Refs the source cannot place were silently dropped as "stale"; now they are a PublishError."""
    h = Harness(_config(STUDENTS[:1], epochs=1))
    (d,) = _admit(h)
    over = {"unknown-node": {"node": "n9"}, "position-not-on-node": {"position": 1},
            "other-sample": {"sample_id": "e0-i999"}, "never-admitted": {"generation": 5},
            "other-schema": {"schema_key": "0123456789abcdef"}}[case]
    ref = _put(h, d, **over)
    match = {"unknown-node": "unknown node 'n9'", "position-not-on-node": "epoch position 1 is not on node 'n0'",
             "other-sample": "holds e0-i.*, not e0-i999 .*another order", "never-admitted": "was never admitted",
             "other-schema": "schema_key '0123456789abcdef' is not this source's"}[case]
    with pytest.raises(PublishError, match=match):
        h.src.publish(refs=[asdict(ref)])
    assert (ref.node, ref.sample_id, ref.generation) not in h.store.objects()


def test_stale_and_repeated_publishes_stay_silent():
    h = Harness(_config(STUDENTS[:1], epochs=1))
    first = _admit(h, k=2)
    refs = [_put(h, d) for d in first]
    h.src.publish(refs=[asdict(refs[0])])
    h.src.publish(refs=[asdict(refs[0])])  # a retried publish whose reply was lost: a no-op
    assert h.src.stats()["nodes"]["n0"]["in_flight_bytes"] == refs[0].nbytes + h.cfg.max_sample_bytes
    assert h.src.requeue_unpublished(node="n0") == 1
    h.src.publish(refs=[asdict(refs[1])])  # the requeued attempt, late: released, no error
    assert (refs[1].node, refs[1].sample_id, refs[1].generation) not in h.store.objects()
    (again,) = _admit(h)
    assert again["generation"] == 2
    h.src.publish(refs=[asdict(_put(h, again))])
    assert h.src.stats()["nodes"]["n0"]["ready"] == 2


# ---- typed errors for bad calls -------------------------------------------------------------------

def test_bad_calls_are_typed_errors():
    h = Harness(_config(STUDENTS[:1], epochs=1))
    with pytest.raises(SourceConfigError, match="unknown node 'zz'"):
        h.src.admit(node="zz", lengths=[3], timeout=0)
    with pytest.raises(SourceConfigError, match="unknown student 'zz'"):
        h.src.fail_student("zz", "no such student")
    with pytest.raises(SourceConfigError, match="student 'a': key is not a CompatKey"):
        h.src.subscribe(student="a", rank=0, pid=1, key={"tokenizer": "tok"})


# ---- the control plane: connecting and the handshake are bounded ----------------------------------

def _in_thread(fn, timeout):
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out.append(("err", e))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    return out[0] if out else ("hung", None)


def test_client_to_a_hung_server_fails_within_connect_timeout():
    """A server process that hangs (here: a socket that listens and never accepts; the kernel
    still completes the connect) must not hang its clients."""
    path = os.path.join(tempfile.mkdtemp(prefix="hung-"), "sock")
    hung = socket.socket(socket.AF_UNIX)
    hung.bind(path)
    hung.listen(8)
    try:
        info = {"address": path, "family": "AF_UNIX", "authkey": os.urandom(16).hex()}
        t0 = time.monotonic()
        kind, err = _in_thread(lambda: SourceClient(info, connect_timeout=0.5), timeout=15)
        assert kind == "err" and isinstance(err, ConnectionError), (kind, err)
        assert "handshake failed (connect_timeout=0.5s)" in str(err) and time.monotonic() - t0 < 10
    finally:
        hung.close()
        os.unlink(path)


def test_a_client_stalled_in_the_handshake_does_not_block_the_others():
    cfg = _config(STUDENTS[:1], epochs=1)
    src = SharedTeacherSource(cfg, ShmStore(), monitor=False)
    server = SourceServer(src)
    mute = socket.socket(socket.AF_UNIX)
    try:
        mute.connect(server.address)  # connects and never answers the challenge
        kind, stats = _in_thread(lambda: SourceClient(server.connect_info, connect_timeout=5).call("stats"), 15)
        assert kind == "ok" and "students" in stats, (kind, stats)
    finally:
        mute.close()
        server.close()
        src.close()
        src.store.close(remove=True)
