"""An SGLang server started by ``SGLangEngine.launch_server`` is a colocated worker of its owner:
guarded (killed with it, also when the owner is SIGKILLed), with the role's environment
(Megatron hidden, allocator settings removed) and its GPUs mapped through the owner's
``CUDA_VISIBLE_DEVICES`` with ``base_gpu_id`` 0. On CPU the server is
``tests/colocate/_contract_server.py`` (SGLang's HTTP contract over a transformers model, loaded
from the checkpoint at ``--model-path`` as SGLang would); the real server runs on the GPU lane
(``test_sglang_http.py::test_real_sglang_http_server``)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate import PublishConfig, Publisher, SGLangEngine
from colocate.errors import ConfigError
from colocate.sglang_clients import engine_devices
from colocate.sglang_engine import hide_megatron_dir, write_hf_checkpoint
from colocate.workers import LocalScheduler

from ._contract_server import SPEC, sha, weights
from .test_workers import _gone

ROOT = Path(__file__).resolve().parents[2]
SERVER = "tests.colocate._contract_server"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_engine_devices_map_owner_gpus_and_zero_the_base():
    args = {"tp_size": 2, "base_gpu_id": 1}
    assert engine_devices(args, None) == [1, 2] and args == {"tp_size": 2, "base_gpu_id": 0}
    args = {"tp_size": 1}
    assert engine_devices(args, [3]) == [3] and args["base_gpu_id"] == 0
    assert engine_devices({"tp_size": 2}, None) is None  # neither: the server sees the owner's devices
    with pytest.raises(ConfigError, match="not both"):
        engine_devices({"base_gpu_id": 2}, [0])
    with pytest.raises(ConfigError, match="fewer than tp_size·dp_size=4"):
        engine_devices({"tp_size": 2, "dp_size": 2}, [0, 1])


@pytest.mark.timeout(240)
def test_launch_server_runs_as_a_guarded_worker_with_the_role_env(tmp_path):
    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    sched = LocalScheduler(owner_env=_env(CUDA_VISIBLE_DEVICES="4,5,6,7", MCD_ROLE_VAR="owner",
                                          PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))
    eng = SGLangEngine.launch_server(spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu", devices=[2],
                                     env={"PYTORCH_CUDA_ALLOC_CONF": None, "MCD_ROLE_VAR": "role",
                                          "MCD_MP_AUTHKEY": multiprocessing.current_process().authkey.hex()},
                                     log_path=str(tmp_path / "server.log"), start_timeout_s=180, server_module=SERVER,
                                     model_path=str(tmp_path / "ckpt"), tp_size=1)
    try:
        p = eng.client.get("/probe")
        argv, env = p["argv"], p["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == "6"  # the owner's logical 2
        assert argv[argv.index("--base-gpu-id") + 1] == "0" and argv[argv.index("--tp-size") + 1] == "1"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] is None and env["MCD_ROLE_VAR"] == "role"
        assert env["COLOCATE_ROLE"] == "rollout" and env["PYTHONPATH"].split(os.pathsep)[0] == hide_megatron_dir()
        assert p["megatron"].startswith("ImportError: megatron is hidden")
        assert p["ppid"] == eng.client.worker.pid and eng.client.worker in sched.workers  # under the guard
        assert eng.residency.allocator == "default"  # the server's settings, not the owner's
        assert eng.checksum() == sha(weights(1))  # loaded from --model-path
        w = weights(2)
        Publisher(eng, PublishConfig(bucket_bytes=16 << 10)).publish(w, version=1)
        assert eng.weight_version() == 1 and eng.checksum() == sha(w)
    finally:
        eng.shutdown()
    assert _gone(p["pid"]) and not sched.workers[0].alive()


@pytest.mark.timeout(240)
def test_launched_server_dies_with_its_killed_owner(tmp_path):
    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    out = subprocess.run([sys.executable, "-m", "tests.colocate._server_owner", str(tmp_path / "ckpt"),
                          str(tmp_path / "server.log")], env=_env(), capture_output=True, text=True, timeout=200,
                         cwd=ROOT)
    assert out.returncode == -9, out.stderr[-3000:]
    server, guard = (int(x) for x in out.stdout.split())
    assert _gone(guard, timeout=20) and _gone(server, timeout=20), "the SGLang server outlived its owner"
