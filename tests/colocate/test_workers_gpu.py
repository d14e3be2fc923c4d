"""GPU lane: colocated roles land on their owner's *physical* GPU.

Local scheduler: the owner sees GPU ``CUDA_VISIBLE_DEVICES=<last>`` as logical 0; the worker
(given the owner's logical device 0) must report the same device UUID. Ray: an owner actor
that Ray gave one GPU (Ray sets its ``CUDA_VISIBLE_DEVICES`` to the physical id) forks a role
actor; the role reports the same UUID and ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from colocate import WorkerSpec

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# Reports the UUID of its logical device 0, then stays up until killed.
PROBE = [sys.executable, "-c", "import time, torch; from colocate.workers import mark_ready; "
         "mark_ready(uuid=str(torch.cuda.get_device_properties(0).uuid)); time.sleep(300)"]


def _uuid(physical: str) -> str:
    import subprocess

    code = "import torch; print(torch.cuda.get_device_properties(0).uuid)"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=physical)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_local_worker_gets_owner_physical_gpu():
    from colocate.workers import LocalScheduler, ipc_key

    physical = str(torch.cuda.device_count() - 1)
    owner_env = dict(os.environ, CUDA_VISIBLE_DEVICES=physical, PYTHONPATH=str(ROOT))
    sched = LocalScheduler(owner_env=owner_env)
    try:
        w = sched.fork(WorkerSpec(role="rollout", command=PROBE, devices=[0], health_timeout_s=120, kill_grace_s=2))
        assert w.info["cuda_visible_devices"] == physical
        assert w.info["uuid"] == _uuid(physical)
        assert ipc_key(0, env=owner_env, host="h") == ipc_key(0, env=w.env, host="h") == f"h:{physical}"
    finally:
        sched.shutdown()


class _Owner:
    """A Ray actor holding one GPU that forks a colocated role (defined here, shipped by value)."""

    def run(self, probe: list[str]) -> dict:
        import torch

        from colocate.workers import RayScheduler

        sched = RayScheduler()
        try:
            w = sched.fork(WorkerSpec(role="rollout", command=probe, health_timeout_s=120, kill_grace_s=2))
            return {"owner_cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "owner_uuid": str(torch.cuda.get_device_properties(0).uuid),
                    "worker_cvd": w.info["cuda_visible_devices"], "worker_uuid": w.info["uuid"],
                    "same_node": w.probe()["node_id"] == w.node_id}
        finally:
            sched.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ray_role_lands_on_owner_physical_gpu(tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    ray.init(num_cpus=2, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path), runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        owner = ray.remote(num_gpus=1, num_cpus=0)(_Owner).remote()
        r = ray.get(owner.run.remote(PROBE), timeout=240)
    finally:
        ray.shutdown()
    assert r["owner_cvd"] is not None and r["worker_cvd"] == r["owner_cvd"], r
    assert r["worker_uuid"] == r["owner_uuid"] and r["same_node"], r
