"""GPU lane, real SGLang (0.5.17 via ``.sgl/scripts/go.sh``): Megatron weights published into an
in-process ``sglang.Engine`` through our publisher, checked three ways, plus the residency cycle
with CUDA graphs on. Dense and MoE tiny Qwen3 at TP=1 (TP=2 on a two-GPU machine).

The engine never runs inside pytest: SGLang aborts its parent (SIGQUIT) when a scheduler dies,
and Megatron's import sets torch_memory_saver's hook mode to ``torch``, which breaks pauseable
CUDA graphs. So pytest builds the Megatron weights in spawned ranks, saves them, and starts the
driver module ``tests/colocate/sglang_driver.py`` (``python -m tests.colocate.sglang_driver CASE.pt
RESULT.json``; no import-time work there, see its docstring) in its own process group, without
Megatron imported; the driver records every measurement in a JSON file (rewritten after each
step) and pytest asserts on it. The group is killed in ``finally``. With ``MCD_TEST_ARTIFACTS``
set, the driver's log and JSON are also copied there (``sglang_driver_<case>.log``/``.json``).

Checks per case:

* the engine's weight checksum after our publish equals its checksum after SGLang's own disk
  loader read the same weights (and differs from the initial random weights);
* the engine's prompt log-probs match an fp32 ``transformers`` model built from the same
  (bf16-rounded) weights: max |Δ| ≤ 0.05, mean |Δ| ≤ 0.01 nats (bf16 activations; measured
  values are printed), while before the publish they differed by far more;
* the in-place path (all weights views of one CUDA storage: one handle, no packing) gives the
  same checksum as the packed path, and the storage's memory returns once the trainer frees it;
* residency: release ``kv_cache``/``weights``/``cuda_graph`` (memory comes back, a second
  release is a no-op), resume weights, re-publish, resume the rest: same checksum, same greedy
  tokens as before the cycle;
* the begin/end weight-update bracket is feature-detected (absent in 0.5.17).

Run: ``bash .sgl/scripts/go.sh -m pytest -m sglang -x -q -s tests/colocate/test_sglang_gpu.py``
(≈3–4 min on a fresh H200: one engine start per case; SGLang's JIT kernels are built in
parallel by the lane's ``.sgl/scripts/prewarm.py`` while the Megatron weights are built).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

LP_MAX, LP_MEAN = 0.05, 0.01  # nats: bf16 engine vs fp32 reference on the same bf16 weights
ROOT = Path(__file__).resolve().parents[2]

TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (Megatron TP=2 and SGLang tp_size=2)")


def _run_driver(case_file: Path, result_file: Path, log_file: Path, timeout_s: float, name: str) -> dict:
    env = dict(os.environ, SGLANG_MEMORY_SAVER_CUDA_GRAPH="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # expandable segments silently disable the memory saver
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.colocate.sglang_driver", str(case_file),
                                 str(result_file)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            else:  # SGLang's own children may outlive the driver
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if out := os.environ.get("MCD_TEST_ARTIFACTS"):  # kept past pytest's tmp_path
        os.makedirs(out, exist_ok=True)
        for src, ext in ((log_file, "log"), (result_file, "json")):
            if src.exists():
                shutil.copyfile(src, os.path.join(out, f"sglang_driver_{name}.{ext}"))
    res = json.loads(result_file.read_text()) if result_file.exists() else {}
    res["_exit"] = proc.returncode
    res["_log_tail"] = log_file.read_text(errors="replace")[-6000:]
    return res


class _Prewarm:
    """SGLang's JIT kernels (tvm-ffi + nvcc, ~20–25 s each when built one after another inside
    the first engine start) built in parallel processes by the GPU lane's ``prewarm.py``, while
    the test builds the Megatron weights. Best effort: a kernel not built here is built by the
    engine itself."""

    OPS = ("silu", "qknorm", "rope", "store256")  # store256: 2 KV heads x head_dim 64 x bf16

    def __init__(self):
        script = ROOT / ".sgl" / "scripts" / "prewarm.py"
        self.procs = []
        if script.exists():
            for op in self.OPS:
                self.procs.append(subprocess.Popen([sys.executable, str(script), op], cwd=ROOT,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                   start_new_session=True))

    def wait(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                print("prewarm:", (out or "").strip().splitlines()[-1:] or f"exit {p.returncode}")
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs = []


@pytest.fixture(scope="module")
def prewarm():
    pw = _Prewarm()
    yield pw
    pw.wait(1.0)


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [
    {"id": "dense"},
    {"id": "moe", "experts": 4, "tied": True, "call_timeout_s": 120.0},
    pytest.param({"id": "dense-tp2", "tp": 2}, marks=TWO_GPUS),
], ids=lambda c: c["id"])
def test_publish_megatron_into_sglang_with_residency_cycle(case, tmp_path, prewarm):
    from mcore_distill.testing import run_ranks

    from ._ranks import megatron_hf_weights

    tp = case.get("tp", 1)
    got = run_ranks(megatron_hf_weights, tp, case, backend="nccl", timeout=240)[0]
    case_file = tmp_path / "case.pt"
    torch.save({"spec": got["spec"], "weights": got["weights"], "tp": tp, "call_timeout_s": case.get("call_timeout_s")},
               case_file)
    prewarm.wait()
    r = _run_driver(case_file, tmp_path / "result.json", tmp_path / "driver.log", timeout_s=420,
                    name=case["id"])
    summary = {k: v for k, v in r.items() if k != "_log_tail"}
    print(json.dumps(summary, indent=1, default=str))
    assert r.get("done"), f"driver did not finish: {summary}\n--- driver log tail ---\n{r['_log_tail']}"

    assert r["megatron_imported"] is False
    assert r["has_bracket"] is r["engine_class_has_bracket"]
    # 1. checksum: our publish == SGLang's own disk load of the same weights != initial weights
    assert r["checksum_publish"] != r["checksum_initial"]
    assert r["checksum_disk"] == r["checksum_publish"]
    assert r["packed"]["num_shared"] == 0 and r["packed"]["num_buckets"] >= 2
    # 2. log-probs against the fp32 HF reference built from the same weights
    assert r["lp_after"]["max"] <= LP_MAX and r["lp_after"]["mean"] <= LP_MEAN, r["lp_after"]
    assert r["lp_before"]["mean"] >= 5 * LP_MEAN, ("the initial weights must be distinguishable", r["lp_before"])
    # 3. in-place path: one storage handed over, nothing packed, same bytes in the engine
    assert r["inplace"]["num_shared"] == 1 and r["inplace"]["num_buckets"] == 0, r["inplace"]
    assert r["checksum_inplace"] == r["checksum_publish"]  # also: the storage was overwritten at once after
    # SGLang's flattened_bucket hand-over (in place: one handle; packed: per bucket), tied-MoE lm_head included
    assert r["flattened_inplace"] == {"num_buckets": 0, "num_shared": 1}, r["flattened_inplace"]
    assert r["checksum_flattened_inplace"] == r["checksum_flattened_packed"] == r["checksum_publish"]
    assert r["lp_flattened"]["max"] <= LP_MAX and r["lp_flattened"]["mean"] <= LP_MEAN, r["lp_flattened"]
    # 4. residency cycle with CUDA graphs on
    assert r["cuda_graph_enabled"] is True
    freed = r["freed"]
    assert freed["kv_cache"] > 0 and freed["weights"] > 0, freed
    # the release returns what SGLang accounts to those tags (≥ 90 %: SGLang rounds to 1 MiB, the
    # free-memory deltas to the driver's 2 MiB pages)
    held = r["tag_bytes"]
    assert held["weights"] > 0 and held["kv_cache"] > 0, held
    assert sum(freed.values()) >= 0.9 * sum(held.values()), (freed, held)
    assert r["second_release"] == {} and r["final_resume_noop"] == {}
    assert r["checksum_after_cycle"] == r["checksum_publish"]
    assert r["greedy_after_cycle"] == r["greedy_before_cycle"]
    assert r["generate_refused_while_released"] is True
    assert r["inplace_buffer_returned"] is True, "the buffer SGLang read in place stayed in CUDA IPC limbo"
