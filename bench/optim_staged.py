"""Staged optimizers: step time, achieved PCIe bandwidth and HBM, against baselines in one run.

Sections (each row: case, provider, ms p50, ratio vs the case baseline, GB/s per direction):
* ``bw``: pinned H2D, D2H and concurrent H2D+D2H (duplex) bandwidth, 1 GiB transfers.
* ``adamw/N=<n>``: torch fused AdamW with everything on the GPU (baseline, fp32 params = master),
  :class:`optim_staged.StagedAdamW` (bf16 params on the GPU, fp32 master/m/v in pinned host slabs),
  Megatron ``HybridDeviceOptimizer`` (CPU AdamW for the offloaded part) at fraction 1.0 and 0.5.
  ``floor_ms`` = 12 B/param / measured duplex per-direction bandwidth; ``pct_floor`` = floor/ms.
* ``muon/<shape>x<count>``: ``TensorParallelMuon`` (fp32 param + momentum on GPU; baseline) vs
  :class:`optim_staged.muon.StagedMuon` (bf16 param on GPU), ``count`` matrices per step.
* ``megatron``: one train step of a ~0.5B Megatron GPT (bf16, distributed optimizer, 1 GPU):
  native Megatron Adam vs staged; peak HBM and step time.

Run: ``python bench/optim_staged.py`` (H200: ~2 min) or ``--quick`` (CPU/GPU smoke, seconds).
Writes ``optim_staged.json`` / ``optim_staged.png`` into ``$OUT`` (or ``outputs/bench``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results  # noqa: E402
from optim_staged import SlotConfig, StagedAdamW  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
GB = 1e9


def _timer(fn, iters):
    return (time_cuda(fn, warmup=2, iters=iters) if CUDA else time_cpu(fn, warmup=1, iters=iters))["p50"]


def bandwidth(nbytes: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    h2d = _timer(lambda: dev.copy_(host, non_blocking=True), 5)
    d2h = _timer(lambda: host.copy_(dev, non_blocking=True), 5)

    def duplex():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    dup = _timer(duplex, 5)
    return {"h2d": nbytes / h2d / 1e6, "d2h": nbytes / d2h / 1e6, "duplex_per_dir": nbytes / dup / 1e6}


def _step_and_drain(opt) -> None:
    opt.step()
    opt.drain(release=False)


def _grads(ps):
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3


def adamw_rows(n: int, duplex: float | None, iters: int) -> list[dict]:
    rows = []
    case = f"adamw/N={n / 1e6:.0f}M"
    chunk = 1 << 24
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])

    def run(provider, make):
        try:
            ps, opt = make()
            _grads(ps)
            if hasattr(opt, "drain"):  # conservative: each step includes its own D2H tail
                ms = _timer(functools.partial(_step_and_drain, opt), iters)
            else:
                ms = _timer(opt.step, iters)
            row = {"case": case, "provider": provider, "ms": ms, "params": n}
            if duplex:
                row["floor_ms"] = 12 * n / (duplex * 1e6)
                row["GBps_dir"] = 12 * n / ms / 1e6 if provider.startswith("staged") else None
                row["pct_floor"] = row["floor_ms"] / ms if provider.startswith("staged") else None
            if hasattr(opt, "residency"):
                row["pinned_host_bytes"] = opt.residency["host_bytes"]
                row["slot_bytes"] = opt.gpu_state_bytes
            rows.append(row)
            del ps, opt
        except Exception as e:  # noqa: BLE001 - one provider failing must not hide the others
            rows.append({"case": case, "provider": provider, "error": f"{type(e).__name__}: {e}"[:300]})
            traceback.print_exc()
        gc.collect()  # free (and unregister) host slabs before the next provider allocates its own
        if CUDA:
            torch.cuda.empty_cache()

    def fused():
        ps = [torch.zeros(s, device=DEV, requires_grad=True) for s in sizes]
        return ps, torch.optim.AdamW(ps, lr=1e-4, fused=True)

    run("torch_fused_gpu", fused)
    sweep = ((4, 2), (4, 3), (16, 2)) if n < 500_000_000 else ((4, 2),)  # keep the 1B run short
    for slot_mi, nslots in sweep:
        def staged(slot_mi=slot_mi, nslots=nslots):
            ps = [torch.zeros(s, device=DEV, dtype=torch.bfloat16, requires_grad=True) for s in sizes]
            opt = StagedAdamW(ps, lr=1e-4, slots=SlotConfig(slot_numel=slot_mi << 20, num_slots=nslots))
            opt.initialize_state()
            return ps, opt
        run(f"staged_{slot_mi}Mi_x{nslots}", staged)
    if CUDA:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        for frac in (1.0, 0.5):
            def hdo(frac=frac):
                ps = [torch.zeros(s, device=DEV, dtype=torch.bfloat16, requires_grad=True) for s in sizes]
                opt = HybridDeviceOptimizer(ps, offload_fraction=frac, cpu_optimizer_cls=torch.optim.AdamW,
                                            gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                            overlap_cpu_optimizer_d2h_h2d=False, lr=1e-4, fused=True)
                return ps, opt
            run(f"megatron_hdo_{frac}", hdo)
    base = next((r["ms"] for r in rows if r.get("provider") == "torch_fused_gpu" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r:
            r["ratio"] = r["ms"] / base
    return rows


def muon_rows(shape: tuple[int, int], count: int, iters: int) -> list[dict]:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from optim_staged.muon import StagedMuon

    case = f"muon/{shape[0]}x{shape[1]}x{count}"
    rows = []
    numel = shape[0] * shape[1]
    try:
        ps = [torch.randn(shape, device=DEV, requires_grad=True) for _ in range(count)]
        opt = TensorParallelMuon(ps, lr=1e-3)
        _grads(ps)
        rows.append({"case": case, "provider": "native_muon", "ms": _timer(opt.step, iters), "params": numel * count})
        del ps, opt
        if CUDA:
            torch.cuda.empty_cache()
        ps = [torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(count)]
        opt = StagedMuon.from_tensor_parallel_muon(TensorParallelMuon(ps, lr=1e-3),
                                                   slots=SlotConfig(slot_numel=numel, num_slots=2))
        opt.initialize_state()
        _grads(ps)
        rows.append({"case": case, "provider": "staged_muon", "ms": _timer(opt.step, iters), "params": numel * count,
                     "slot_bytes": opt.gpu_state_bytes, "pinned_host_bytes": opt.residency["host_bytes"]})
        del ps, opt
        gc.collect()
    except Exception as e:  # noqa: BLE001
        rows.append({"case": case, "provider": "error", "error": f"{type(e).__name__}: {e}"[:300]})
        traceback.print_exc()
    if CUDA:
        torch.cuda.empty_cache()
    if len(rows) == 2:
        rows[1]["ratio"] = rows[1]["ms"] / rows[0]["ms"]
        rows[0]["ratio"] = 1.0
    return rows


def _megatron_step_fn(model, opt, tokens):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    B, S = tokens.shape
    pos = torch.arange(S, device=tokens.device).expand(B, S)

    def fwd(it, m):
        return m(tokens, pos, None, labels=tokens), lambda o: (o.float().mean(), {})

    def step():
        model.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([None]), model=[model],
                                    num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=False)
        opt.step()

    return step


def megatron_rows(quick: bool, snapshot: bool = False) -> list[dict]:
    """One train step of a Megatron GPT on 1 GPU: native distributed Adam vs staged."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron
    from optim_staged.config import AdamWConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        init_megatron(tp=1, pp=1, seed=1)
    cfg = (TinyGPTConfig(vocab_size=512, hidden_size=256, num_layers=2, ffn_hidden_size=512, num_attention_heads=4,
                         num_query_groups=2, params_dtype=torch.bfloat16, max_sequence_length=256) if quick else
           TinyGPTConfig(vocab_size=32768, hidden_size=2048, num_layers=8, ffn_hidden_size=5632,
                         num_attention_heads=16, num_query_groups=4, params_dtype=torch.bfloat16,
                         max_sequence_length=1024))
    B, S = (2, 128) if quick else (4, 1024)
    rows = []
    for residency in ("gpu", "staged"):
        torch.cuda.empty_cache()
        model = build_tiny_gpt(cfg).cuda()
        model = Float16Module(model.config, model)
        model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                use_distributed_optimizer=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        opt = get_staged_optimizer(StagedOptimizerConfig(residency=residency, adamw=AdamWConfig(lr=1e-4)), [model])
        step = _megatron_step_fn(model, opt, torch.randint(0, cfg.vocab_size, (B, S), device="cuda"))
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if snapshot:  # CUDA caching-allocator history of the timed steps (view at pytorch.org/memory_viz)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        ms = time_cuda(step, warmup=1, iters=3)["p50"]
        nparams = sum(p.numel() for p in model.parameters())
        if snapshot:
            torch.cuda.memory._dump_snapshot(str(out_dir() / f"optim_staged_snapshot_{residency}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        t_opt = time_cuda(opt.step, warmup=1, iters=3)["p50"]
        rows.append({"case": f"megatron/{nparams / 1e6:.0f}M", "provider": f"mcore_{residency}", "ms": ms,
                     "opt_step_ms": t_opt, "peak_hbm_GiB": torch.cuda.max_memory_allocated() / 2**30,
                     "params": nparams})
        del model, opt
        gc.collect()
    rows[1]["ratio"] = rows[1]["ms"] / rows[0]["ms"]
    rows[0]["ratio"] = 1.0
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--no-megatron", action="store_true", help="skip the Megatron model step")
    ap.add_argument("--snapshot", action="store_true", help="dump CUDA allocator snapshots of the Megatron steps")
    args = ap.parse_args()
    rows: list[dict] = []
    extra: dict = {}
    duplex = None
    if CUDA:
        bw = bandwidth((64 << 20) if args.quick else (1 << 30))
        extra["bandwidth_GBps"] = bw
        duplex = bw["duplex_per_dir"]
        rows += [{"case": "bw", "provider": k, "GBps_dir": v} for k, v in bw.items()]
    sizes = [1 << 20] if args.quick else [134_000_000, 1_000_000_000]
    for n in sizes:
        rows += adamw_rows(n, duplex, iters=3 if args.quick else 5)
    shapes = [(256, 512)] if args.quick else [(4096, 4096), (4096, 14336), (8192, 28672)]
    for shape in shapes:
        rows += muon_rows(shape, count=2 if args.quick else 4, iters=3)
    if CUDA and not args.no_megatron:
        try:
            rows += megatron_rows(args.quick, args.snapshot)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": "megatron", "provider": "error", "error": f"{type(e).__name__}: {e}"[:300]})
            traceback.print_exc()
    path = write_results("optim_staged", rows, extra)
    _plot(rows)
    print(f"wrote {path}")
    print_table(rows, ["case", "provider", "ms", "ratio", "floor_ms", "pct_floor", "GBps_dir", "peak_hbm_GiB",
                       "opt_step_ms", "error"])


def _plot(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    timed = [r for r in rows if "ms" in r]
    cases = list(dict.fromkeys(r["case"] for r in timed))
    fig, axes = plt.subplots(1, max(1, len(cases)), figsize=(3.2 * max(1, len(cases)), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rs = [r for r in timed if r["case"] == case]
        ax.bar(range(len(rs)), [r["ms"] for r in rs], color="tab:blue")
        ax.set_xticks(range(len(rs)), [r["provider"] for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_title(case, fontsize=8)
        ax.set_ylabel("ms / step")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out_dir() / "optim_staged.png", dpi=120)


if __name__ == "__main__":
    main()
