"""``bench.harts_gdn`` stays runnable on CPU: the ``--quick`` model section writes a row per
provider (``tree_eager``: CUDA graphs off) with the host-side columns, the default ``tree`` reports the schedule ``auto`` chose and a
forced schedule equal to it repeats its row; the Qwen3-Next widths build a hybrid model that runs
the tree path (one GDN and one attention layer, small vocabulary, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path):
    return {**os.environ, "BENCH_OUT": str(tmp_path),
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.timeout(300)
def test_gdn_bench_quick_model_rows(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.harts_gdn", "--quick", "--sections", "model"], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "harts_gdn.json").read_text())["rows"]
    for case in ("rho=0.0", "rho=0.75"):
        got = {r["provider"]: r for r in rows if r["case"] == case}
        assert set(got) == {"chain", "tree", "tree_level", "tree_unaligned", "tree_chainsched", "tree_eager"}
        tree = got["tree"]
        assert tree["schedule"] in ("level", "chain") and "same_as" not in tree
        forced = "tree_level" if tree["schedule"] == "level" else "tree_chainsched"
        assert got[forced]["same_as"] == "tree" and got[forced]["ms_p50"] == tree["ms_p50"]
        other = "tree_chainsched" if forced == "tree_level" else "tree_level"
        assert "same_as" not in got[other] and got[other]["schedule"] != tree["schedule"]
        for r in got.values():
            assert r["issue_ms"] > 0 and r["ms_p50"] > 0 and r["host_top"], r["provider"]
            # each timed sample's host issue time, within its wall time
            assert len(r["issue_ms_samples"]) == len(r["ms_samples"]) > 0, r["provider"]
            assert all(0 < i <= w for i, w in zip(r["issue_ms_samples"], r["ms_samples"])), r["provider"]


@pytest.mark.timeout(300)
def test_gdn_bench_microbatches_report_per_microbatch(tmp_path):
    """``--microbatches 2``: each timed step issues two microbatches back to back; rows and header say
    so and every time is per microbatch (the issue time of a sample stays within its wall time)."""
    proc = subprocess.run([sys.executable, "-m", "bench.harts_gdn", "--quick", "--sections", "model", "--cases",
                           "rho=0.75", "--providers", "tree_eager", "--microbatches", "2"], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fwd+bwd per microbatch, 2 per synchronized step" in proc.stdout
    data = json.loads((tmp_path / "harts_gdn.json").read_text())
    assert data["extra"]["microbatches"] == 2
    rows = data["rows"]
    assert {r["provider"] for r in rows} == {"chain", "tree", "tree_eager"}
    for r in rows:
        assert r["microbatches"] == 2 and r["ms_min"] == min(r["ms_samples"]) > 0
        assert all(0 < i <= w for i, w in zip(r["issue_ms_samples"], r["ms_samples"])), r["provider"]
    bad = subprocess.run([sys.executable, "-m", "bench.harts_gdn", "--quick", "--microbatches", "0"], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--microbatches must be >= 1, got 0" in bad.stderr


@pytest.mark.timeout(300)
def test_qwen3_next_widths_run_the_tree_path(tmp_path):
    code = """
import torch
from bench import harts_gdn as hg
from harts.forest import build_forest
from harts.gdn import GdnTreeConfig
from harts.gdn_megatron import make_gdn_tree_params
from harts.megatron import tree_forward
hg._setup()
hg.WIDTHS["probe"] = dict(hg.WIDTHS["qwen3-next"], vocab_size=1024)
model, cfg = hg._model(False, "cpu", "GA", "probe")
c = model.config
assert (c.hidden_size, c.kv_channels, c.num_query_groups, c.linear_num_value_heads) == (2048, 256, 2, 32)
model = model.float()
f = build_forest([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]])
out = tree_forward(model, f, params=make_gdn_tree_params(f, config=GdnTreeConfig(chunk_size=16), backend="dense"))
assert out.logp.shape == (f.num_nodes,) and bool(torch.isfinite(out.logp).all())
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
