"""GPU lane, real SGLang (0.5.17 via ``.sgl/scripts/go.sh``): Megatron weights published into an
in-process ``sglang.Engine`` through our publisher, checked three ways, plus the residency cycle
with CUDA graphs on. Dense and MoE tiny Qwen3 at TP=1 (TP=2 on a two-GPU machine).

The engine never runs inside pytest: SGLang aborts its parent (SIGQUIT) when a scheduler dies,
and Megatron's import sets torch_memory_saver's hook mode to ``torch``, which breaks pauseable
CUDA graphs. So pytest builds the Megatron weights in spawned ranks, saves them, and starts this
same file as a driver (``python -m tests.colocate.test_sglang_gpu CASE.pt RESULT.json``) in its
own process group, without Megatron imported; the driver records every measurement in a JSON
file (rewritten after each step) and pytest asserts on it. The group is killed in ``finally``.

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
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [3, 100, 200, 300, 7, 11, 400, 12]]
LP_MAX, LP_MEAN = 0.05, 0.01  # nats: bf16 engine vs fp32 reference on the same bf16 weights
ROOT = Path(__file__).resolve().parents[2]

TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (Megatron TP=2 and SGLang tp_size=2)")


def _run_driver(case_file: Path, result_file: Path, log_file: Path, timeout_s: float) -> dict:
    env = dict(os.environ, SGLANG_MEMORY_SAVER_CUDA_GRAPH="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # expandable segments silently disable the memory saver
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.colocate.test_sglang_gpu", str(case_file),
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
    {"id": "moe", "experts": 4, "tied": True},
    pytest.param({"id": "dense-tp2", "tp": 2}, marks=TWO_GPUS),
], ids=lambda c: c["id"])
def test_publish_megatron_into_sglang_with_residency_cycle(case, tmp_path, prewarm):
    from mcore_distill.testing import run_ranks

    from ._ranks import megatron_hf_weights

    tp = case.get("tp", 1)
    got = run_ranks(megatron_hf_weights, tp, case, backend="nccl", timeout=240)[0]
    case_file = tmp_path / "case.pt"
    torch.save({"spec": got["spec"], "weights": got["weights"], "tp": tp}, case_file)
    prewarm.wait()
    r = _run_driver(case_file, tmp_path / "result.json", tmp_path / "driver.log", timeout_s=420)
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
    assert r["checksum_inplace"] == r["checksum_publish"]
    # 4. residency cycle with CUDA graphs on
    assert r["cuda_graph_enabled"] is True
    freed = r["freed"]
    assert freed["kv_cache"] > 0 and freed["weights"] > 0, freed
    assert r["second_release"] == {} and r["final_resume_noop"] == {}
    assert r["checksum_after_cycle"] == r["checksum_publish"]
    assert r["greedy_after_cycle"] == r["greedy_before_cycle"]
    assert r["generate_refused_while_released"] is True
    assert r["inplace_buffer_returned"] is True, "the buffer SGLang read in place stayed in CUDA IPC limbo"


# ------------------------------------------------------------------------ the driver process
class _Recorder(dict):
    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.t0 = time.time()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        print(f"[{time.time() - self.t0:6.1f}s] {key} = {str(value)[:300]}", flush=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _lp_stats(got: list[list[float]], ref: list[torch.Tensor]) -> dict:
    d = torch.cat([(torch.tensor(g, dtype=torch.float64) - r.double()).abs() for g, r in zip(got, ref, strict=True)])
    return {"max": d.max().item(), "mean": d.mean().item(), "n": d.numel()}


def _driver(case_file: str, result_file: str) -> None:
    rec = _Recorder(result_file)
    rec["megatron_imported"] = any(m.startswith("megatron") for m in sys.modules)
    from colocate import PublishConfig
    from colocate.convert import hf_param_specs
    from colocate.engines import build_hf_model, hf_checkpoint_views
    from colocate.publish import Publisher
    from colocate.residency import NotResidentError
    from colocate.sglang_engine import SGLangEngine, sglang_engine_args, write_hf_checkpoint

    case = torch.load(case_file, weights_only=False)
    spec, tp = case["spec"], case["tp"]
    specs = hf_param_specs(spec, dtype=torch.bfloat16)  # bf16, except fp32 router parts if configured
    weights = {n: t.to(specs[n][1]) for n, t in case["weights"].items()}
    base = os.path.dirname(result_file)

    torch.manual_seed(123)
    init = build_hf_model(spec, dtype=torch.bfloat16)
    init_dir, same_dir = os.path.join(base, "init"), os.path.join(base, "same")
    write_hf_checkpoint(init_dir, hf_checkpoint_views(init), spec=spec)
    write_hf_checkpoint(same_dir, weights, spec=spec)
    del init

    ref_model = build_hf_model(spec, dtype=torch.float32, device="cuda")
    views = hf_checkpoint_views(ref_model)
    ref_lp = []
    with torch.no_grad():
        for n, t in weights.items():
            views[n].copy_(t.float())
        for p in PROMPTS:
            lp = torch.log_softmax(ref_model(input_ids=torch.tensor([p], device="cuda")).logits[0, :-1].double(), -1)
            ref_lp.append(lp.gather(-1, torch.tensor(p[1:], device="cuda")[:, None])[:, 0].cpu())
    del ref_model, views
    torch.cuda.empty_cache()

    import sglang.srt.entrypoints.engine as sgl_engine_mod

    rec["engine_class_has_bracket"] = hasattr(sgl_engine_mod.Engine, "begin_weight_update")
    t = time.time()
    eng = SGLangEngine.launch(spec=spec, **sglang_engine_args(init_dir, cuda_graph=True, tp_size=tp))
    rec["engine_start_s"] = round(time.time() - t, 1)
    try:
        rec["has_bracket"] = eng.has_bracket
        rec["cuda_graph_enabled"] = not eng.engine.server_args.disable_cuda_graph
        rec["checksum_initial"] = eng.checksum()
        rec["lp_before"] = _lp_stats([eng.prompt_logprobs(p) for p in PROMPTS], ref_lp)

        meta = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
        packed = Publisher(eng, PublishConfig(bucket_bytes=256 << 10), share_min_bytes=None)
        rep = packed.publish(((n, t.cuda()) for n, t in weights.items()), version=1, meta=meta)
        rec["packed"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared, "handles": rep.handles,
                         "ms": {k: round(v * 1e3, 2) for k, v in rep.timings.items()}, "verify": rep.verify}
        rec["checksum_publish"] = eng.last_checksum
        rec["lp_after"] = _lp_stats([eng.prompt_logprobs(p) for p in PROMPTS], ref_lp)

        eng.restore_from_disk(same_dir, version=1)
        eng.engine.flush_cache()
        rec["checksum_disk"] = eng.checksum()

        # in place: every tensor a view of one CUDA storage (as in a DDP param buffer)
        # ≥ 32 MiB: its own allocator segment, so its release shows in memory_reserved below
        flat = torch.empty(max(sum(t.numel() for t in weights.values()), 16 << 20), dtype=torch.bfloat16,
                           device="cuda")
        inplace, off = {}, 0
        for n, t in weights.items():
            inplace[n] = flat[off: off + t.numel()].view(t.shape)
            inplace[n].copy_(t)
            off += t.numel()
        direct = Publisher(eng, PublishConfig(bucket_bytes=1 << 20), share_min_bytes=1)
        direct.last_good = 1
        eng.restore_from_disk(init_dir, version=None)  # other weights first, so the check can fail
        rep = direct.publish(inplace, version=2)
        rec["inplace"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared, "handles": rep.handles,
                          "ms": {k: round(v * 1e3, 2) for k, v in rep.timings.items()}}
        rec["checksum_inplace"] = eng.last_checksum

        rec["greedy_before_cycle"] = [o["output_ids"] for o in eng.generate(PROMPTS, max_new_tokens=8)]
        rec["freed"] = eng.release_memory(["kv_cache", "weights", "cuda_graph"])
        rec["second_release"] = eng.release_memory()
        try:
            eng.generate(PROMPTS, max_new_tokens=2)
            rec["generate_refused_while_released"] = False
        except NotResidentError:
            rec["generate_refused_while_released"] = True
        rec["resumed_weights"] = eng.resume_memory(["weights"])
        direct.publish(inplace, version=3)
        rec["resumed_rest"] = eng.resume_memory(["cuda_graph", "kv_cache"])
        rec["checksum_after_cycle"] = eng.checksum()
        rec["greedy_after_cycle"] = [o["output_ids"] for o in eng.generate(PROMPTS, max_new_tokens=8)]
        rec["final_resume_noop"] = eng.resume_memory()
        # no IPC leak: once the trainer drops the buffer, its memory goes back (SGLang let go of it)
        torch.cuda.synchronize()
        reserved, nbytes = torch.cuda.memory_reserved(), flat.numel() * flat.element_size()
        del inplace, flat
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        rec["inplace_buffer_returned"] = torch.cuda.memory_reserved() <= reserved - nbytes
        rec["done"] = True
    except Exception as e:  # noqa: BLE001 - recorded for the test process, which asserts
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        eng.shutdown()


if __name__ == "__main__":
    try:
        _driver(sys.argv[1], sys.argv[2])
    except BaseException:  # noqa: BLE001 - the log tail reaches the test's failure message
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(0)
