"""The optim_staged benchmarks stay runnable: ``--quick`` CPU runs of ``bench.optim_staged --peers``
and ``bench.optim_split_probe`` write their JSON with a timed row for every configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    env = {**os.environ, "BENCH_OUT": str(tmp_path),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", *args, "--quick"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_peers_bench_quick(tmp_path):
    _run(tmp_path, "bench.optim_staged", "--peers", "--no-megatron")
    rows = json.loads((tmp_path / "optim_staged_peers.json").read_text())["rows"]
    staged = {r["provider"]: r for r in rows if r["provider"].startswith("staged")}
    assert {"staged_stream", "staged_stream_offload", "staged_fit_offload", "staged_fit_offload_tmax",
            "staged_split", "staged_split_offload"} <= set(staged)
    assert all(r["ms"] > 0 and "error" not in r for r in staged.values())


@pytest.mark.timeout(300)
def test_split_probe_quick(tmp_path):
    _run(tmp_path, "bench.optim_split_probe")
    rows = json.loads((tmp_path / "optim_split_probe.json").read_text())["rows"]
    split = [r for r in rows if r["case"] == "split"]
    assert {r["provider"] for r in split} >= {"thp_split0", "4k_split0", "thp_fit1Mi_t8"}
    assert all(r["ms"] > 0 for r in split)
