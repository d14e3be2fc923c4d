"""``bench/hf_load.py --quick`` (CPU, tiny shape, TP=2 through torchrun on gloo) writes its JSON
and PNG, and each TP=2 rank reads about half the bytes one rank reads at TP=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_quick_bench_runs(tmp_path):
    import socket

    taken = socket.socket()  # a MASTER_PORT inherited from the caller (e.g. a live gloo store) is busy
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    env = {**os.environ, "BENCH_OUT": str(tmp_path), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(taken.getsockname()[1])}
    with taken:
        proc = subprocess.run([sys.executable, "-m", "bench.hf_load", "--quick", "--runs", "1"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "hf_load.json").read_text())
    assert (tmp_path / "hf_load.png").stat().st_size > 0
    assert {"date", "gpu", "commit", "versions"} <= set(res["header"])
    summary = {r["provider"]: r for r in res["extra"]["summary"]}
    assert set(summary) == {"megatron_tp1", "megatron_tp2", "transformers", "safetensors"}
    assert res["extra"]["files"] > 1
    tp1, tp2 = summary["megatron_tp1"]["bytes_read_per_rank_MiB"], summary["megatron_tp2"]["bytes_read_per_rank_MiB"]
    assert tp2 < 0.65 * tp1 and abs(tp1 - res["extra"]["checkpoint_MiB"]) < 1e-6
    assert all(r["load_s"] > 0 for r in summary.values())
    print(proc.stdout[-1500:])
