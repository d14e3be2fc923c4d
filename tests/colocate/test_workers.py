"""Forked colocated workers: env overrides, readiness, kill of the whole group, no orphans when
the owner dies hard, start timeouts, GPU id resolution; the Slurm path on a real one-node Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate import WorkerSpec
from colocate.errors import ConfigError
from colocate.workers import (
    LocalScheduler,
    SlurmScheduler,
    WorkerError,
    WorkerStartTimeout,
    ipc_key,
    merge_env,
    physical_gpu_ids,
    scheduler_for,
)
from tests._procs import gone_within

from . import _slurm

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tests.colocate._worker"]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` does not exist or is a zombie (reaping is the parent's business)."""
    return not gone_within([pid], timeout)


def _owner_env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), FOO="owner", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env.update(extra)
    return env


def test_env_merge_gpu_ids_and_ipc_keys():
    assert merge_env({"A": "1", "B": "2"}, {"B": "", "C": "3"}) == {"A": "1", "C": "3"}
    env = {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert physical_gpu_ids(env) == ["3", "1"] and physical_gpu_ids({}) is None
    assert ipc_key(1, env=env, host="n0") == "n0:1" and ipc_key(0, env=env, host="n0") == "n0:3"
    assert ipc_key(0, env={"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, host="n0") == "n0:GPU-aa"
    with pytest.raises(ValueError, match="logical device 2 outside"):
        ipc_key(2, env=env)
    with pytest.raises(ConfigError, match="WorkerSpec.command"):
        WorkerSpec(role="rollout", command=[])
    with pytest.raises(ConfigError, match="WorkerSpec.scheduler"):
        WorkerSpec(role="rollout", command=["x"], scheduler="k8s")
    with pytest.raises(ConfigError, match="WorkerSpec.devices"):
        WorkerSpec(role="rollout", command=["x"], devices=[-1])


@pytest.mark.timeout(90)
def test_local_fork_env_health_kill_and_timeouts():
    sched = LocalScheduler(owner_env=_owner_env(CUDA_VISIBLE_DEVICES="5,2"))
    spec = WorkerSpec(role="rollout", command=WORKER, env={"PYTORCH_CUDA_ALLOC_CONF": "", "BAR": "role"},
                      health_timeout_s=60, kill_grace_s=2)
    w = sched.fork(spec)
    info = w.info
    assert info["alloc"] is None and info["foo"] == "owner" and info["bar"] == "role" and info["role"] == "rollout"
    assert info["cuda_visible_devices"] == "5,2"  # same physical devices as the owner
    assert w.healthy()
    grandchild = info["child"]
    one = sched.fork(WorkerSpec(role="teacher", command=WORKER, devices=[1], health_timeout_s=60, kill_grace_s=2))
    assert one.info["cuda_visible_devices"] == "2"  # owner's logical 1 is physical 2
    one.kill()
    with pytest.raises(WorkerError, match=r"devices=\[2\] outside"):
        sched.fork(WorkerSpec(role="teacher", command=WORKER, devices=[2]))
    w.kill()
    assert not w.alive() and _gone(w.pid) and _gone(info["pid"]) and _gone(grandchild)
    w.kill()  # idempotent

    never = WorkerSpec(role="teacher", command=[sys.executable, "-c", "import time; time.sleep(60)"],
                       health_timeout_s=1.0, kill_grace_s=1)
    t0 = time.monotonic()
    with pytest.raises(WorkerStartTimeout, match="not ready within 1.0s"):
        sched.fork(never)
    assert time.monotonic() - t0 < 10
    assert all(not x.alive() for x in sched.workers if x.spec.role == "teacher")
    with pytest.raises(WorkerError, match="exited with 3 before ready"):
        sched.fork(WorkerSpec(role="teacher", command=[sys.executable, "-c", "raise SystemExit(3)"]))
    with pytest.raises(WorkerError, match="cannot start worker"):
        sched.fork(WorkerSpec(role="teacher", command=["/nonexistent/binary"]))
    sched.shutdown()


@pytest.mark.timeout(90)
def test_kill_reaps_a_prompt_worker_without_waiting_the_grace():
    """The guard's SIGTERM handler runs while its main loop waits on the worker: it must reap a
    worker that exits on SIGTERM at once (it used to sleep the whole ``kill_grace_s``, the wait
    lock being held by the interrupted wait), and still SIGKILL one that ignores SIGTERM after
    the grace; the worker's own children die with the group either way."""
    sched = LocalScheduler(owner_env=_owner_env())
    w = sched.fork(WorkerSpec(role="prompt", command=WORKER, health_timeout_s=60, kill_grace_s=30))
    t0 = time.monotonic()
    w.kill()
    took = time.monotonic() - t0
    assert took < 10, f"kill of a worker that exits on SIGTERM took {took:.1f}s (grace 30 s)"
    assert _gone(w.info["pid"]) and _gone(w.info["child"]) and not w.alive()

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "from colocate.workers import mark_ready; mark_ready(); time.sleep(120)")
    s = sched.fork(WorkerSpec(role="stubborn", command=[sys.executable, "-c", stubborn], health_timeout_s=60,
                              kill_grace_s=1))
    t0 = time.monotonic()
    s.kill()
    assert time.monotonic() - t0 >= 1.0  # it was given its grace before the SIGKILL
    assert _gone(s.info["pid"]) and not s.alive()
    sched.shutdown()


@pytest.mark.timeout(90)
def test_spec_scheduler_is_read_and_log_path_collects_output(tmp_path):
    """``WorkerSpec.scheduler`` names the scheduler that may start the role: another kind refuses
    the spec before starting anything, ``scheduler_for`` builds the named one. ``log_path``
    receives the worker's stdout and stderr."""
    sched = LocalScheduler(owner_env=_owner_env())
    with pytest.raises(WorkerError, match=r"WorkerSpec.scheduler='slurm' for role 'rollout', but LocalScheduler"):
        sched.fork(WorkerSpec(role="rollout", command=WORKER, scheduler="slurm"))
    assert sched.workers == []
    assert type(scheduler_for(None, owner_env={})) is LocalScheduler
    assert type(scheduler_for("local", owner_env={})) is LocalScheduler
    with pytest.raises(WorkerError, match="SLURM_JOB_ID is not set"):
        scheduler_for("slurm", owner_env={})
    with pytest.raises(WorkerError, match="unknown scheduler 'k8s'"):
        scheduler_for("k8s")
    say = "import sys; print('to stdout', flush=True); print('to stderr', file=sys.stderr, flush=True); " \
          "from colocate.workers import mark_ready; mark_ready(); import time; time.sleep(60)"
    w = sched.fork(WorkerSpec(role="rollout", command=[sys.executable, "-c", say], scheduler="local",
                              log_path=str(tmp_path / "logs" / "rollout.log"), health_timeout_s=60, kill_grace_s=1))
    w.kill()
    text = (tmp_path / "logs" / "rollout.log").read_text()
    assert "to stdout" in text and "to stderr" in text
    sched.shutdown()


@pytest.mark.timeout(90)
def test_shutdown_kills_every_worker_even_when_one_kill_fails():
    """One worker's kill raising does not leave the others running: shutdown tries all of them,
    then names the failure."""
    sched = LocalScheduler(owner_env=_owner_env())
    spec = dict(command=WORKER, health_timeout_s=60, kill_grace_s=1)
    a, b = sched.fork(WorkerSpec(role="a", **spec)), sched.fork(WorkerSpec(role="b", **spec))
    real_kill = a.kill

    def failing_kill():
        real_kill()
        raise OSError("simulated kill failure")

    a.kill = failing_kill
    with pytest.raises(WorkerError, match=r"killing worker 'a' failed \(1 of 2 failed\): simulated"):
        sched.shutdown()
    assert _gone(a.pid) and _gone(b.pid) and not b.alive() and sched.workers == []
    sched.shutdown()  # idempotent: nothing left


@pytest.mark.timeout(90)
def test_a_killed_guard_stops_its_group_without_sitting_out_the_grace():
    """Ray's raylet SIGKILLs the direct children of a dead actor, the guard among them; the guard's
    watcher then stops the worker's process group. A worker that exits on SIGTERM must not make the
    watcher sit out the whole ``kill_grace_s`` (it slept it unconditionally and outlived the
    Ray no-orphans test); one that ignores SIGTERM still gets its grace before the SIGKILL."""
    import signal

    from tests._procs import group_gone, group_pids

    sched = LocalScheduler(owner_env=_owner_env())
    w = sched.fork(WorkerSpec(role="prompt", command=WORKER, health_timeout_s=60, kill_grace_s=30))
    pgid = w.proc.pid  # the guard leads the worker's process group
    assert len(group_pids(pgid)) >= 3  # guard, its watcher, the worker
    os.kill(pgid, signal.SIGKILL)
    t0 = time.monotonic()
    assert group_gone(pgid, timeout=10), f"still running 10 s after the guard's SIGKILL: {group_pids(pgid)}"
    assert time.monotonic() - t0 < 10

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "from colocate.workers import mark_ready; mark_ready(); time.sleep(120)")
    s = sched.fork(WorkerSpec(role="stubborn", command=[sys.executable, "-c", stubborn], health_timeout_s=60,
                              kill_grace_s=2))
    pgid = s.proc.pid
    os.kill(pgid, signal.SIGKILL)
    t0 = time.monotonic()
    assert group_gone(pgid, timeout=15)
    assert time.monotonic() - t0 >= 1.5  # the grace was given before the SIGKILL
    sched.shutdown()


@pytest.mark.timeout(90)
def test_no_orphans_when_the_owner_is_killed():
    out = subprocess.run([sys.executable, "-m", "tests.colocate._owner"], env=_owner_env(), capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == -9, out.stderr
    worker_pid, grandchild = (int(x) for x in out.stdout.split())
    assert _gone(worker_pid), "worker outlived its owner"
    assert _gone(grandchild), "the worker's child outlived the owner"


@pytest.mark.timeout(150)
@pytest.mark.skipif(not _slurm.available(), reason="slurm binaries absent (apt: slurmctld slurmd slurm-client munge)")
def test_slurm_overlap_step_in_owner_allocation(tmp_path):
    with _slurm.slurm_cluster(tmp_path / "slurm") as env:
        alloc = subprocess.run(["salloc", "--no-shell", "-n1", "-N1", "--job-name=owner"], env=env,
                               capture_output=True, text=True, timeout=60)
        assert alloc.returncode == 0, alloc.stderr
        job = next(tok for tok in alloc.stderr.split() if tok.isdigit())
        owner = _owner_env(SLURM_CONF=env["SLURM_CONF"], SLURM_JOB_ID=job, SLURMD_NODENAME="localhost")
        sched = SlurmScheduler(owner_env=owner)
        spec = WorkerSpec(role="rollout", command=WORKER, env={"PYTORCH_CUDA_ALLOC_CONF": "", "BAR": "role"},
                          scheduler="slurm", health_timeout_s=60, kill_grace_s=2)
        w = sched.fork(spec)
        assert w.info["slurm_job_id"] == job and w.info["slurm_step_id"] is not None
        assert w.info["alloc"] is None and w.info["foo"] == "owner" and w.info["bar"] == "role"
        steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env=env, capture_output=True,
                               text=True, timeout=30).stdout.split()
        assert f"{job}.{w.info['slurm_step_id']}" in steps
        w.kill()
        assert _gone(w.info["pid"]) and _gone(w.info["child"])

        def step_listed():
            out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env=env, capture_output=True,
                                 text=True, timeout=30).stdout.split()
            return f"{job}.{w.info['slurm_step_id']}" in out
        deadline = time.monotonic() + 20
        while step_listed() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not step_listed()
        subprocess.run(["scancel", job], env=env, timeout=30)
        with pytest.raises(WorkerError, match="SLURM_JOB_ID is not set"):
            SlurmScheduler(owner_env={})
