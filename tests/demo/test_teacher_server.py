"""The demo's teacher server started from a torchrun rank (the job's real launch): the server
process gets the role's environment without the rank's torchrun variables, among them
``TORCHELASTIC_USE_AGENT_STORE=True``, which blocks the ``tcp://`` rendezvous of SGLang's
schedulers (see ``colocate.sglang_clients.sglang_env_overrides``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_teacher_server_of_a_torchrun_rank_gets_no_launcher_env(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          "-m", "tests.demo._server_env", str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    rank, server = got["rank"], got["server"]
    assert rank["TORCHELASTIC_USE_AGENT_STORE"] == "True" and rank["RANK"] == "0"  # torchrun set them for the rank
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RUN_ID")
    assert {k: server[k] for k in launcher} == dict.fromkeys(launcher), server
    assert server["HF_HUB_OFFLINE"] == "1" and server["COLOCATE_ROLE"] == "teacher"
    assert "teacher server (hf)" in out.stderr + out.stdout and "healthy in" in out.stderr + out.stdout
