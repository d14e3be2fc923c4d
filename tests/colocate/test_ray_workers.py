"""Ray colocated workers on a real local Ray cluster: node placement, env merge (command and
actor), physical GPU ids, readiness, kill of the whole group, no orphans when the owner dies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colocate import WorkerSpec
from colocate.workers import WorkerError, WorkerStartTimeout
from tests._procs import group_gone

from .test_workers import _gone, _owner_env

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray): Ray scheduler tests need it")

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tests.colocate._worker"]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "false"}


def test_ray_scheduler_needs_an_initialized_runtime():
    from colocate.workers import RayScheduler

    if ray.is_initialized():
        pytest.skip("a Ray runtime is initialized in this process")
    with pytest.raises(WorkerError, match="ray is not initialized"):
        RayScheduler()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the module (2 CPUs, no dashboard); the test process is its driver.

    The raylet sub-reaper is switched *off*, so the only thing that kills a role's command when
    its actor dies is our guard (the test would pass vacuously otherwise)."""
    if ray.is_initialized():
        pytest.skip("a Ray runtime is already initialized in this process")
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ctx = ray.init(num_cpus=2, include_dashboard=False, namespace="colocate-test", log_to_driver=False,
                   _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        yield ctx
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.timeout(180)
def test_ray_actor_on_owner_node_env_gpu_ids_kill(ray_cluster):
    from colocate.workers import RayScheduler

    sched = RayScheduler(owner_env=_owner_env(CUDA_VISIBLE_DEVICES="5,2"))
    spec = WorkerSpec(role="rollout", command=WORKER, env={"PYTORCH_CUDA_ALLOC_CONF": "", "BAR": "role"},
                      health_timeout_s=90, kill_grace_s=2)
    w = sched.fork(spec)
    info = w.info
    # the command sees owner env + role overrides (a removal included) and the owner's physical GPUs
    assert info["alloc"] is None and info["foo"] == "owner" and info["bar"] == "role" and info["role"] == "rollout"
    assert info["cuda_visible_devices"] == "5,2"
    # the actor process runs on the owner's node and sees the overrides through runtime_env
    pr = w.probe(["BAR", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"])
    assert pr["node_id"] == ray.get_runtime_context().get_node_id() == w.node_id
    assert pr["env"]["BAR"] == "role" and pr["env"]["CUDA_VISIBLE_DEVICES"] == "5,2"
    assert pr["pid"] != os.getpid() and w.healthy() and w.alive()

    one = sched.fork(WorkerSpec(role="teacher", command=WORKER, devices=[1], health_timeout_s=90, kill_grace_s=2))
    assert one.info["cuda_visible_devices"] == "2"  # owner's logical 1 is physical 2
    with pytest.raises(WorkerError, match=r"devices=\[2\] outside"):
        sched.fork(WorkerSpec(role="teacher", command=WORKER, devices=[2]))
    # the actor dies under us (ray.kill, no stop() first): its command and the command's child
    # go too, through the guard's watcher; health reports it
    ray.kill(one.actor, no_restart=True)
    assert _gone(one.info["pid"], timeout=30) and _gone(one.info["child"], timeout=30)
    assert not one.alive() and not one.healthy()
    one.kill()  # still fine after the actor is gone

    w.kill()
    assert _gone(info["pid"]) and _gone(info["child"]), "command or its child outlived kill()"
    assert _gone(pr["pid"], timeout=30), "the actor process outlived kill()"
    assert not w.alive() and not w.healthy()
    w.kill()  # idempotent

    with pytest.raises(WorkerError, match="exited with 3 before ready"):
        sched.fork(WorkerSpec(role="teacher", command=[sys.executable, "-c", "raise SystemExit(3)"],
                              health_timeout_s=90))
    with pytest.raises(WorkerStartTimeout, match="not ready within"):
        sched.fork(WorkerSpec(role="teacher", command=[sys.executable, "-c", "import time; time.sleep(60)"],
                              health_timeout_s=3, kill_grace_s=1))
    with pytest.raises(WorkerError, match="cannot start worker"):
        sched.fork(WorkerSpec(role="teacher", command=["/nonexistent/binary"]))
    sched.shutdown()


@pytest.mark.timeout(180)
def test_ray_no_orphans_when_the_owner_is_killed(ray_cluster):
    addr = ray_cluster.address_info["address"]
    out = subprocess.run([sys.executable, "-m", "tests.colocate._ray_owner", addr], env=_owner_env(),
                         capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert out.returncode == -9, out.stderr[-3000:]
    cmd_pid, grandchild, actor_pid, group = (int(x) for x in out.stdout.split())
    assert _gone(actor_pid, timeout=60), "the actor outlived its owner"
    assert _gone(cmd_pid, timeout=30), "the role command outlived its owner"
    assert _gone(grandchild, timeout=30), "the command's child outlived its owner"
    # the guard's watcher ends a poll (≤ 50 ms) after the last other member: wait for the whole group,
    # or the leak check after the test can still see it (CI's intermittent LeakedProcessWarning)
    assert group_gone(group, timeout=30), f"a process of the role's group {group} (guard, watcher) outlived its owner"


@pytest.mark.timeout(240)
def test_sglang_server_launched_under_ray_lands_on_the_owner_gpu(ray_cluster, tmp_path):
    """``SGLangEngine.launch_server`` with a Ray scheduler: the server runs under the role actor
    on the owner's node, sees exactly the owner's GPU picked by ``base_gpu_id`` (owner-logical,
    mapped to the physical id) as its ``cuda:0`` (``--base-gpu-id 0``), and goes with ``shutdown``."""
    import torch

    from colocate import SGLangEngine
    from colocate.sglang_engine import write_hf_checkpoint
    from colocate.workers import RayScheduler

    from ._contract_server import SPEC, sha, weights

    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    sched = RayScheduler(owner_env=_owner_env(CUDA_VISIBLE_DEVICES="3,1"))
    eng = SGLangEngine.launch_server(spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu", base_gpu_id=1,
                                     tp_size=1, start_timeout_s=200, model_path=str(tmp_path / "ckpt"),
                                     server_module="tests.colocate._contract_server")
    try:
        p = eng.client.get("/probe")
        assert p["env"]["CUDA_VISIBLE_DEVICES"] == "1" and p["env"]["COLOCATE_ROLE"] == "rollout"
        assert p["argv"][p["argv"].index("--base-gpu-id") + 1] == "0"
        assert eng.client.worker.node_id == ray.get_runtime_context().get_node_id()
        assert eng.checksum() == sha(weights(1))
    finally:
        eng.shutdown()
        sched.shutdown()
    assert _gone(p["pid"], timeout=30), "the server outlived shutdown()"
