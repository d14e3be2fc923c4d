"""TeacherPool state machine with real in-process teachers (tiny transformers Qwen3)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from mopd.backends import TeacherBackend, TransformersTeacher
from mopd.config import TeacherPoolConfig
from mopd.errors import DrainError, TeacherBrokenError, TeacherStateError, TeacherTimeoutError
from mopd.teachers import TeacherPool, TeacherState
from tests.mopd.mopd_helpers import tiny_qwen3, token_batch

S = TeacherState
MODEL = None


def _model():
    global MODEL
    if MODEL is None:
        MODEL = tiny_qwen3(0)
    return MODEL


class Counting(TransformersTeacher):
    """A real teacher that counts lifecycle calls and can fail or stall one of them."""

    def __init__(self, tid, *, fail=None, stall_s=0.0):
        self.calls = {k: 0 for k in ("prefetch", "load", "offload", "onload", "score", "close", "build")}
        self.fail, self.stall_s = fail, stall_s
        super().__init__(tid, self._factory)

    def _factory(self):
        self.calls["build"] += 1
        if self.stall_s:
            time.sleep(self.stall_s)
        return _model()

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in ("prefetch", "load", "offload", "onload", "score", "close"):
            def wrapped(*a):
                self.calls[name] += 1
                if self.fail == name:
                    raise RuntimeError(f"injected {name} failure")
                return attr(*a)
            return wrapped
        return attr


def _pool(*backends, **cfg):
    events = []
    pool = TeacherPool({b.teacher_id: b for b in backends}, config=TeacherPoolConfig(**cfg),
                       on_event=lambda t, e: events.append((t, e)))
    return pool, events


def _use(pool, tid, **kw):
    with pool.acquire(tid, **kw) as lease:
        t = lease.score(token_batch(2, 5)).take()
        assert t.shape == (2, 5) and torch.isfinite(t).all()
        del t


def test_protocol_and_transitions():
    a, b = Counting("a"), Counting("b")
    assert isinstance(a, TeacherBackend)
    pool, events = _pool(a, b, prefetch=False)
    assert pool.states() == {"a": S.EMPTY, "b": S.EMPTY}
    _use(pool, "a", prefetch_next="b")  # pool.prefetch=False: no staging
    assert pool.states() == {"a": S.RESIDENT, "b": S.EMPTY} and b.calls["prefetch"] == 0
    _use(pool, "a")  # reuse: no second load
    _use(pool, "b")
    assert pool.states() == {"a": S.OFFLOADED, "b": S.RESIDENT}
    _use(pool, "a")  # offloaded → onload, not load
    assert pool.states() == {"a": S.RESIDENT, "b": S.OFFLOADED}
    assert events == [("a", "load"), ("a", "offload"), ("b", "load"), ("b", "offload"), ("a", "onload")]
    pool.offload("b")  # already offloaded: no second offload call
    assert b.calls["offload"] == 1 and a.calls["load"] == 1 and a.calls["onload"] == 1
    pool.close()
    pool.close()
    assert a.calls["close"] == 1 and pool.states() == {"a": S.CLOSED, "b": S.CLOSED}
    with pytest.raises(TeacherStateError, match="closed"):
        pool.acquire("a")


def test_release_refused_until_drained():
    pool, _ = _pool(Counting("a"))
    lease = pool.acquire("a")
    out = lease.score(token_batch(2, 5))
    with pytest.raises(DrainError, match="1 outputs issued, 0 taken"):
        pool.release(lease, lease.drain())
    kept = out.take()
    with pytest.raises(DrainError, match="1 still referenced by a consumer"):
        pool.release(lease, lease.drain())
    with pytest.raises(TeacherStateError, match="lease .* is held"):
        pool.offload("a")
    stale = lease.drain()  # receipt taken while the consumer still held the tensor
    del kept
    with pytest.raises(DrainError):
        pool.release(lease, stale)
    pool.release(lease, lease.drain())
    with pytest.raises(TeacherStateError, match="not the active lease"):
        pool.release(lease, lease.drain())
    other = pool.acquire("a")
    with pytest.raises(DrainError, match="does not match"):
        pool.release(other, lease.drain())
    pool.release(other, other.drain())
    pool.close()


@pytest.mark.parametrize("stage", ["load", "onload", "offload", "score"])
def test_any_failure_breaks_and_cleans_up_without_retry(stage):
    a, b = Counting("a", fail=stage if stage != "onload" else None), Counting("b")
    pool, events = _pool(a, b, prefetch=False)
    if stage == "onload":
        _use(pool, "a")
        _use(pool, "b")
        a.fail = "onload"
    target = "a"
    if stage == "offload":
        a.fail = None
        _use(pool, "a")
        a.fail = "offload"
        target = "b"  # acquiring b offloads a, which fails
    with pytest.raises(RuntimeError, match=f"injected {stage} failure"):
        _use(pool, target)
    assert pool.state("a") is S.BROKEN and ("a", "broken") in events
    assert a.calls["close"] == 1 and a.module is None  # cleaned up
    assert a.calls[stage] == 1  # never retried
    with pytest.raises(TeacherBrokenError, match=f"'a' is BROKEN after: RuntimeError: injected {stage} failure"):
        pool.acquire("a")
    if stage != "offload":
        _use(pool, "b")  # the pool stays usable for other teachers
    pool.close()
    assert a.calls["close"] == 1  # a broken teacher is not closed twice


def test_prefetch_stages_next_teacher_once():
    a, b = Counting("a"), Counting("b", stall_s=0.2)
    pool, events = _pool(a, b)
    with pool.acquire("a", prefetch_next="b") as lease:
        assert pool.state("b") is S.EMPTY and ("b", "prefetch") in events
        t = lease.score(token_batch(2, 5)).take()
        del t
    _use(pool, "b")
    assert b.calls["prefetch"] == 1 and b.calls["build"] == 1 and b.calls["load"] == 1
    pool.close()


def test_prefetch_failure_and_timeout_break_the_teacher():
    a, b = Counting("a"), Counting("b", fail="prefetch")
    pool, _ = _pool(a, b)
    _use(pool, "a", prefetch_next="b")
    with pytest.raises(RuntimeError, match="injected prefetch failure"):
        pool.acquire("b")
    assert pool.state("b") is S.BROKEN and pool.state("a") is S.OFFLOADED
    pool.close()
    a, slow = Counting("a"), Counting("slow", stall_s=1.0)
    pool, _ = _pool(a, slow, wait_timeout_s=0.1)
    _use(pool, "a", prefetch_next="slow")
    with pytest.raises(TeacherTimeoutError, match="prefetch of teacher 'slow' did not finish in pool.wait_timeout_s=0.1s"):
        pool.acquire("slow")
    assert pool.state("slow") is S.BROKEN
    pool.close()


def test_acquire_waits_for_holder_with_timeout():
    pool, _ = _pool(Counting("a"), wait_timeout_s=0.2)
    lease = pool.acquire("a")
    t0 = time.monotonic()
    with pytest.raises(TeacherTimeoutError, match="waited pool.wait_timeout_s=0.2s for the lease held on 'a'"):
        pool.acquire("a")
    assert time.monotonic() - t0 < 5
    pool.config.wait_timeout_s = 10.0
    got = []
    th = threading.Thread(target=lambda: got.append(pool.acquire("a")))
    th.start()
    time.sleep(0.1)
    assert not got
    pool.release(lease, lease.drain())
    th.join(timeout=10)
    assert got and got[0].lease_id == lease.lease_id + 1
    pool.release(got[0], got[0].drain())
    pool.close()


def test_consumer_exception_ends_lease_without_breaking():
    pool, _ = _pool(Counting("a"))
    with pytest.raises(ValueError, match="consumer bug"):
        with pool.acquire("a") as lease:
            lease.score(token_batch(2, 5))
            raise ValueError("consumer bug")
    assert pool.state("a") is S.RESIDENT
    _use(pool, "a")
    pool.close()


class _Failing:
    """A back-end whose ``score`` builds a large tensor and then fails (a device error mid-forward)."""

    teacher_id = "f"

    def __init__(self):
        self.made, self.scores, self.closed = None, 0, False

    def prefetch(self):
        return None

    load = offload = onload = prefetch

    def score(self, batch):
        self.scores += 1
        activations = torch.ones(64, 1024)
        self.made = weakref.ref(activations)
        raise RuntimeError("injected device error")

    def close(self):
        self.closed = True


def test_broken_teacher_record_keeps_no_frame_or_tensor_alive():
    """The pool keeps the cause of a failure, not its traceback: the failed call's frames (and
    the tensors in them) are freed once the caller drops the exception."""
    backend = _Failing()
    pool = TeacherPool({"f": backend}, config=TeacherPoolConfig())
    gc.disable()  # frames must be freed by reference counting, not by a later cycle collection
    try:
        lease = pool.acquire("f")
        with pytest.raises(RuntimeError, match="injected device error") as info:
            lease.score(token_batch(2, 5))
        del info
        assert backend.made() is None, "the failed forward's tensor is still referenced"
        with pytest.raises(TeacherBrokenError, match="BROKEN after: RuntimeError: injected device error") as info:
            pool.acquire("f")
        assert isinstance(info.value.__cause__, RuntimeError) and info.value.__cause__.__traceback__ is None
    finally:
        gc.enable()
    pool.close()


def test_lease_of_a_broken_teacher_never_calls_it_again():
    backend = _Failing()
    pool = TeacherPool({"f": backend}, config=TeacherPoolConfig())
    lease = pool.acquire("f")
    with pytest.raises(RuntimeError):
        lease.score(token_batch(2, 5))
    with pytest.raises(TeacherBrokenError, match="'f' is BROKEN"):
        lease.score(token_batch(2, 5))
    assert backend.scores == 1 and backend.closed
    pool.close()


def test_close_does_not_wait_forever_for_a_stuck_prefetch():
    release = threading.Event()

    class Stuck(Counting):
        def prefetch(self):
            release.wait(30)  # a hung disk read; released at the end of the test

    a, stuck = Counting("a"), Stuck("stuck")
    pool, _ = _pool(a, stuck, wait_timeout_s=0.3)
    try:
        _use(pool, "a", prefetch_next="stuck")
        t0 = time.monotonic()
        pool.close()
        assert time.monotonic() - t0 < 5.0  # bounded by wait_timeout_s, not by the prefetch
        assert pool.states() == {"a": S.CLOSED, "stuck": S.CLOSED}
        assert "still running after pool.wait_timeout_s=0.3s" in str(pool._errors["stuck"])
    finally:
        release.set()
