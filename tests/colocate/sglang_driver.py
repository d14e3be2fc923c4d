"""Driver process of ``tests/colocate/test_sglang_gpu.py``: runs one case in a real
``sglang.Engine`` (``python -m tests.colocate.sglang_driver CASE.pt RESULT.json``) and records every
measurement in RESULT.json (rewritten after each step); the test asserts on it.

Its own module, whose top level imports only the standard library: SGLang starts its scheduler
with multiprocessing "spawn", which re-imports the parent's ``__main__`` (this module) in the child
as ``__mp_main__``, so nothing heavy should run at import. (The exit -9 during engine start with
``enable_memory_saver`` + CUDA graphs seen on 2026-11-29 had another cause: SGLang's scheduler
imported ``megatron.core``, which switches torch_memory_saver's hook mode;
:meth:`colocate.sglang_engine.SGLangEngine.launch` now hides Megatron from SGLang's processes.)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [3, 100, 200, 300, 7, 11, 400, 12]]


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


def _lp_stats(got: list[list[float]], ref: list) -> dict:  # ref: CPU torch tensors
    import torch

    d = torch.cat([(torch.tensor(g, dtype=torch.float64) - r.double()).abs() for g, r in zip(got, ref, strict=True)])
    return {"max": d.max().item(), "mean": d.mean().item(), "n": d.numel()}


def _driver(case_file: str, result_file: str) -> None:
    rec = _Recorder(result_file)
    rec["megatron_imported"] = any(m.startswith("megatron") for m in sys.modules)
    import torch

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
    # the MoE case runs every engine call through the deadline's helper thread (call_timeout_s)
    eng = SGLangEngine.launch(spec=spec, call_timeout_s=case.get("call_timeout_s"),
                              **sglang_engine_args(init_dir, cuda_graph=True, tp_size=tp))
    rec["engine_start_s"] = round(time.time() - t, 1)
    try:
        rec["has_bracket"] = eng.has_bracket
        rec["cuda_graph_enabled"] = not eng.client.engine.server_args.disable_cuda_graph
        rec["checksum_initial"] = eng.checksum()
        rec["lp_before"] = _lp_stats([eng.prompt_logprobs(p) for p in PROMPTS], ref_lp)

        meta = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
        packed = Publisher(eng, PublishConfig(bucket_bytes=256 << 10), share_min_bytes=None)
        rep = packed.publish(((n, t.cuda()) for n, t in weights.items()), version=1, meta=meta)
        rec["packed"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared, "handles": rep.handles,
                         "ms": {k: round(v * 1e3, 2) for k, v in rep.timings.items()}, "verify": rep.verify}
        rec["checksum_publish"] = eng.checksum()
        rec["lp_after"] = _lp_stats([eng.prompt_logprobs(p) for p in PROMPTS], ref_lp)

        eng.restore_from_disk(same_dir, version=1)
        eng.client.flush_cache()
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
        # the trainer writes its storage the moment publish returns (negated: exact, undone below):
        # the engine must already hold the published bytes (SGLang answered after its copies)
        flat.neg_()
        rec["checksum_inplace"] = eng.checksum()
        flat.neg_()
        rec["inplace"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared, "handles": rep.handles,
                          "ms": {k: round(v * 1e3, 2) for k, v in rep.timings.items()}}
        # the same storage as SGLang's flattened_bucket (one handle for all tensors), and packed that way
        flat_ad = SGLangEngine(eng.client, spec=spec, flattened=True)
        eng.restore_from_disk(init_dir, version=None)
        rep = Publisher(flat_ad, PublishConfig(bucket_bytes=1 << 20), share_min_bytes=1).publish(inplace, version=20)
        flat.neg_()
        rec["checksum_flattened_inplace"] = eng.checksum()
        flat.neg_()
        rec["flattened_inplace"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared}
        eng.restore_from_disk(init_dir, version=None)
        rep = Publisher(flat_ad, PublishConfig(bucket_bytes=256 << 10), share_min_bytes=None).publish(
            ((n, t.cuda()) for n, t in weights.items()), version=21, meta=meta)
        rec["checksum_flattened_packed"] = eng.checksum()
        rec["flattened_packed"] = {"num_buckets": rep.num_buckets, "num_shared": rep.num_shared}
        rec["lp_flattened"] = _lp_stats([eng.prompt_logprobs(p) for p in PROMPTS], ref_lp)
        direct.publish(inplace, version=22)  # back to the adapter under test (same bytes)

        rec["greedy_before_cycle"] = [o["output_ids"] for o in eng.generate(PROMPTS, max_new_tokens=8)]
        rec["tag_bytes"] = eng.tag_bytes()  # SGLang's own accounting while resident
        rec["freed"] = eng.release_memory(["kv_cache", "weights", "cuda_graph"])
        rec["second_release"] = eng.release_memory()
        try:
            eng.generate(PROMPTS, max_new_tokens=2)
            rec["generate_refused_while_released"] = False
        except NotResidentError:
            rec["generate_refused_while_released"] = True
        rec["resumed_weights"] = eng.resume_memory(["weights"])
        direct.publish(inplace, version=23)
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
