"""Staged optimizers: step time, achieved PCIe bandwidth and HBM, against baselines in one run.

Sections (each row: case, provider, ms p50, ratio vs the case baseline):
* ``bw``: pinned H2D, D2H and concurrent H2D+D2H (duplex) bandwidth, 1 GiB transfers.
* ``adamw/N=<n>``: torch fused AdamW with everything on the GPU (baseline, fp32 params = master),
  :class:`optim_staged.StagedAdamW` over a slot sweep (``staged_<size>Mi_x<count>``, bf16 params and
  fp32 ``decoupled_grad`` on the GPU, fp32 master/m/v in pinned host slabs; ``_nocache`` = slots
  not kept as a write-back cache), Megatron ``HybridDeviceOptimizer`` at fraction 1.0 and 0.5.
  ``ms`` = step + write-back of all state to the host; ``ms_loop`` = back-to-back steps.
  ``floor_ms`` = 12 B/param / measured duplex per-direction bandwidth; ``pct_floor`` = floor/ms.
* ``muon/<case>``: ``TensorParallelMuon`` (fp32 param, grad, momentum on the GPU; baseline) vs
  :class:`optim_staged.muon.StagedMuon` (bf16 param, fp32 grad on the GPU), back-to-back steps;
  ``slot_state_frac`` = slot bytes / native state bytes.
* ``megatron``: one train step of a ~0.5B Megatron GPT (bf16, distributed optimizer, 1 GPU):
  native Megatron Adam vs staged; step time, peak HBM, optimizer-state HBM; allocator snapshots
  ``optim_staged_snapshot_{gpu,staged}.pickle`` and ``optim_staged_memory.json``.

Run: ``python -m bench.optim_staged`` (H200: ~2 min) or ``--quick`` (CPU/GPU smoke, seconds);
``--only adamw|muon|megatron`` runs one section; ``--targets`` runs only the cases behind the
issue's targets (H200: well under a minute).
Writes ``optim_staged.json`` / ``optim_staged.png`` into ``$OUT`` (or ``outputs/bench``)."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import traceback

import torch

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results
from optim_staged import SlotConfig, StagedAdamW

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


def _grads(ps, *, fp32: bool = False):
    """Random gradients; ``fp32`` puts fp32 ones in ``decoupled_grad`` (what Megatron's distributed
    optimizer hands a precision-aware inner optimizer) instead of ``.grad``."""
    for p in ps:
        if fp32:
            p.decoupled_grad = torch.randn(p.shape, device=p.device, dtype=torch.float32) * 1e-3
        else:
            p.grad = torch.randn_like(p) * 1e-3


def _error_row(case, provider, e):
    traceback.print_exc()
    return {"case": case, "provider": provider, "error": f"{type(e).__name__}: {e}"[:300]}


def _free():
    gc.collect()  # free (and unregister) host slabs before the next provider allocates its own
    if CUDA:
        torch.cuda.empty_cache()


def adamw_rows(n: int, duplex: float | None, iters: int, sweep, hdo_fractions=(1.0, 0.5)) -> list[dict]:
    """torch fused AdamW (GPU state) vs StagedAdamW over a slot sweep (one set of host slabs,
    re-sliced per config) vs Megatron's HybridDeviceOptimizer."""
    rows: list[dict] = []
    case = f"adamw/N={n / 1e6:.0f}M"
    chunk = 1 << 24
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    floor = 12 * n / (duplex * 1e6) if duplex else None

    try:
        ps = [torch.zeros(s, device=DEV, requires_grad=True) for s in sizes]
        opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        _grads(ps)
        rows.append({"case": case, "provider": "torch_fused_gpu", "ms": _timer(opt.step, iters), "params": n})
        del ps, opt
    except Exception as e:  # noqa: BLE001 - one provider failing must not hide the others
        rows.append(_error_row(case, "torch_fused_gpu", e))
    _free()

    try:  # one optimizer, one set of pinned slabs; set_slot_config re-slices the ring per config
        ps = [torch.zeros(s, device=DEV, dtype=torch.bfloat16, requires_grad=True) for s in sizes]
        opt = StagedAdamW(ps, lr=1e-4)
        opt.initialize_state()
        _grads(ps, fp32=True)
        for slot_mi, nslots, keep in sweep:
            provider = f"staged_{slot_mi}Mi_x{nslots}" + ("" if keep else "_nocache")
            try:
                opt.set_slot_config(SlotConfig(slot_numel=slot_mi << 20, num_slots=nslots, keep_resident=keep))
                # ms: step + write-back of everything to the host (conservative, host authoritative);
                # ms_loop: back-to-back steps as in a training loop (the D2H tail overlaps what follows).
                ms = _timer(functools.partial(_step_and_drain, opt), iters)
                ms_loop = _timer(opt.step, iters)
                row = {"case": case, "provider": provider, "ms": ms, "ms_loop": ms_loop, "params": n,
                       "pinned_host_bytes": opt.residency["host_bytes"], "slot_bytes": opt.gpu_state_bytes}
                if floor:
                    row.update(floor_ms=floor, GBps_dir=12 * n / ms / 1e6, pct_floor=floor / ms,
                               pct_floor_loop=floor / ms_loop)
                rows.append(row)
            except Exception as e:  # noqa: BLE001
                rows.append(_error_row(case, provider, e))
        del ps, opt
    except Exception as e:  # noqa: BLE001
        rows.append(_error_row(case, "staged", e))
    _free()

    if CUDA:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        for frac in hdo_fractions:
            try:
                ps = [torch.zeros(s, device=DEV, dtype=torch.bfloat16, requires_grad=True) for s in sizes]
                opt = HybridDeviceOptimizer(ps, offload_fraction=frac, cpu_optimizer_cls=torch.optim.AdamW,
                                            gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                            overlap_cpu_optimizer_d2h_h2d=False, lr=1e-4, fused=True)
                _grads(ps)
                rows.append({"case": case, "provider": f"megatron_hdo_{frac}", "ms": _timer(opt.step, iters),
                             "params": n})
                del ps, opt
            except Exception as e:  # noqa: BLE001
                rows.append(_error_row(case, f"megatron_hdo_{frac}", e))
            _free()
    base = next((r["ms"] for r in rows if r.get("provider") == "torch_fused_gpu" and "ms" in r), None)
    staged = [r for r in rows if r.get("provider", "").startswith("staged") and "ms" in r]
    if staged:
        min(staged, key=lambda r: r["ms"])["best"] = True
    for r in rows:
        if base and "ms" in r:
            r["ratio"] = r["ms"] / base
    return rows


# Qwen/Llama-like matrix stacks: (case, shapes). Counts are layer-stack sized; the x4 rows keep the
# earlier bench's case for comparison.
LLAMA8B_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                 (4096, 14336)]
MUON_CASES = [
    ("4096x4096x4", [(4096, 4096)] * 4),
    ("4096x4096x32", [(4096, 4096)] * 32),
    ("4096x14336x4", [(4096, 14336)] * 4),
    ("4096x14336x12", [(4096, 14336)] * 12),
    ("8192x28672x6", [(8192, 28672)] * 6),
    ("llama8b_4layers", LLAMA8B_LAYER * 4),
]
MUON_QUICK = [("256x512x6", [(256, 512)] * 6), ("mixed_quick", [(256, 512), (64, 512), (512, 256)] * 2)]


def muon_rows(case: str, shapes: list[tuple[int, int]], iters: int, num_slots: int = 3,
              variants: tuple[tuple[str, bool], ...] = (("staged_muon", True), ("staged_muon_nocache", False))
              ) -> list[dict]:
    """Native TensorParallelMuon (fp32 params, momentum and grads on the GPU) vs StagedMuon (bf16
    params on the GPU, fp32 grads as Megatron's main grads, fp32 master + momentum in host slabs)."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from optim_staged.muon import StagedMuon

    case = f"muon/{case}"
    rows: list[dict] = []
    numel = sum(a * b for a, b in shapes)
    try:
        ps = [torch.randn(s, device=DEV, requires_grad=True) for s in shapes]
        opt = TensorParallelMuon(ps, lr=1e-3)
        _grads(ps)
        rows.append({"case": case, "provider": "native_muon", "ms": _timer(opt.step, iters), "params": numel,
                     "gpu_state_bytes": 8 * numel})
        del ps, opt
    except Exception as e:  # noqa: BLE001
        rows.append(_error_row(case, "native_muon", e))
    _free()
    try:
        ps = [torch.randn(s, device=DEV, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
        opt = StagedMuon.from_tensor_parallel_muon(TensorParallelMuon(ps, lr=1e-3), slots=SlotConfig(
            slot_numel=max(a * b for a, b in shapes), num_slots=num_slots))
        opt.initialize_state()
        _grads(ps, fp32=True)
        for provider, keep in variants:
            opt.set_slot_config(SlotConfig(slot_numel=opt.slot_config.slot_numel, num_slots=num_slots,
                                           keep_resident=keep))
            ms = _timer(opt.step, iters)
            rows.append({"case": case, "provider": provider, "ms": ms, "params": numel, "num_slots": num_slots,
                         "gpu_state_bytes": opt.gpu_state_bytes, "pinned_host_bytes": opt.residency["host_bytes"],
                         "slot_state_frac": opt.gpu_state_bytes / (8 * numel)})
        del ps, opt
    except Exception as e:  # noqa: BLE001
        rows.append(_error_row(case, "staged_muon", e))
    _free()
    base = next((r["ms"] for r in rows if r.get("provider") == "native_muon" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r:
            r["ratio"] = r["ms"] / base
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


def megatron_rows(quick: bool, snapshot: bool = True) -> list[dict]:
    """One train step of a Megatron GPT on 1 GPU: native distributed Adam vs staged, with peak HBM,
    optimizer-state HBM and (``snapshot``) a CUDA caching-allocator snapshot of one step each."""
    import json

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
    rows, summary = [], {}
    gib = 2**30
    for residency in ("gpu", "staged"):
        _free()
        model = build_tiny_gpt(cfg).cuda()
        model = Float16Module(model.config, model)
        model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                use_distributed_optimizer=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        torch.cuda.synchronize()
        before_opt = torch.cuda.memory_allocated()
        opt = get_staged_optimizer(StagedOptimizerConfig(residency=residency, adamw=AdamWConfig(lr=1e-4)), [model])
        step = _megatron_step_fn(model, opt, torch.randint(0, cfg.vocab_size, (B, S), device="cuda"))
        step()  # native Adam allocates its state lazily here
        torch.cuda.synchronize()
        opt_state = torch.cuda.memory_allocated() - before_opt
        torch.cuda.reset_peak_memory_stats()
        snap = None
        if snapshot:  # one step's allocator history (view at pytorch.org/memory_viz)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            step()
            torch.cuda.synchronize()
            snap = out_dir() / f"optim_staged_snapshot_{residency}.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
        ms = time_cuda(step, warmup=1, iters=3)["p50"]
        peak = torch.cuda.max_memory_allocated()
        nparams = sum(p.numel() for p in model.parameters())
        t_opt = time_cuda(opt.step, warmup=1, iters=3)["p50"]
        rows.append({"case": f"megatron/{nparams / 1e6:.0f}M", "provider": f"mcore_{residency}", "ms": ms,
                     "opt_step_ms": t_opt, "peak_hbm_GiB": peak / gib, "opt_state_hbm_GiB": opt_state / gib,
                     "params": nparams})
        summary[residency] = {"params": nparams, "step_ms": ms, "optimizer_step_ms": t_opt,
                              "peak_allocated_GiB": peak / gib, "optimizer_state_allocated_GiB": opt_state / gib,
                              "allocated_before_optimizer_GiB": before_opt / gib,
                              "snapshot": None if snap is None else snap.name}
        del model, opt, step
    if len(rows) == 2:
        rows[1]["ratio"] = rows[1]["ms"] / rows[0]["ms"]
        rows[0]["ratio"] = 1.0
        summary["peak_saved_GiB"] = summary["gpu"]["peak_allocated_GiB"] - summary["staged"]["peak_allocated_GiB"]
    (out_dir() / "optim_staged_memory.json").write_text(json.dumps(summary, indent=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--no-megatron", action="store_true", help="skip the Megatron model step")
    ap.add_argument("--no-snapshot", action="store_true", help="skip the CUDA allocator snapshots")
    ap.add_argument("--only", choices=("adamw", "muon", "megatron"), default=None, help="run one section")
    ap.add_argument("--targets", action="store_true",
                    help="short run of the issue's target cases only (AdamW 134M sweep + HDO 1.0, Muon on the "
                         "issue's shapes at stack sizes; no Megatron step); H200: well under a minute")
    args = ap.parse_args()
    if args.targets:
        args.no_megatron = True
    rows: list[dict] = []
    extra: dict = {}
    duplex = None
    if CUDA and args.only in (None, "adamw"):
        bw = bandwidth((64 << 20) if args.quick else (1 << 30))
        extra["bandwidth_GBps"] = bw
        duplex = bw["duplex_per_dir"]
        rows += [{"case": "bw", "provider": k, "GBps_dir": v} for k, v in bw.items()]
    if args.only in (None, "adamw"):
        if args.quick:
            plan = [(1 << 20, [(1, 2, True), (1, 3, True), (1, 3, False)])]
        elif args.targets:
            plan = [(134_000_000, [(2, 3, True), (4, 3, True), (8, 3, True)])]
        else:
            plan = [(134_000_000, [(2, 3, True), (4, 2, True), (4, 3, True), (4, 4, True), (8, 3, True),
                                   (16, 3, True), (4, 3, False)]),
                    (1_000_000_000, [(4, 3, True), (8, 3, True), (4, 3, False)])]
        for n, sweep in plan:
            rows += adamw_rows(n, duplex, iters=3 if args.quick else 5, sweep=sweep,
                               hdo_fractions=(1.0,) if args.targets else (1.0, 0.5))
        best = {r["case"]: r["provider"] for r in rows if r.get("best")}
        extra["adamw_best_config"] = best
        extra["default_slots"] = repr(SlotConfig())
    if args.only in (None, "muon"):
        if args.targets:
            cases = [c for c in MUON_CASES if c[0] in ("4096x4096x32", "4096x14336x12", "8192x28672x6")]
            for case, shapes in cases:
                rows += muon_rows(case, shapes, iters=4, variants=(("staged_muon", True),))
        else:
            for case, shapes in (MUON_QUICK if args.quick else MUON_CASES):
                rows += muon_rows(case, shapes, iters=3 if args.quick else 4)
    if CUDA and not args.no_megatron and args.only in (None, "megatron"):
        try:
            rows += megatron_rows(args.quick, snapshot=not args.no_snapshot)
        except Exception as e:  # noqa: BLE001
            rows.append(_error_row("megatron", "error", e))
    extra["targets"] = _targets(rows)
    path = write_results("optim_staged", rows, extra)
    for line in extra["targets"]:
        print(line)
    _plot(rows)
    print(f"wrote {path}")
    print_table(rows, ["case", "provider", "ms", "ratio", "ms_loop", "pct_floor", "pct_floor_loop", "GBps_dir",
                       "gpu_state_bytes", "peak_hbm_GiB", "opt_state_hbm_GiB", "best", "error"])


def _targets(rows: list[dict]) -> list[str]:
    """The issue's targets, one line each: AdamW >= 95 % of the duplex floor and >= 3x faster than
    HybridDeviceOptimizer at fraction 1.0; StagedMuon <= 1.10x native Muon."""
    out = []
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r.get("case", ""), []).append(r)
    for case, rs in by_case.items():
        if case.startswith("adamw/"):
            best = next((r for r in rs if r.get("best")), None)
            hdo = next((r for r in rs if r.get("provider") == "megatron_hdo_1.0" and "ms" in r), None)
            if best and best.get("pct_floor") is not None:
                out.append(f"{case}: best {best['provider']} {best['pct_floor'] * 100:.1f} % of duplex floor "
                           f"(loop {best['pct_floor_loop'] * 100:.1f} %; target >= 95 %)")
            if best and hdo:
                out.append(f"{case}: {hdo['ms'] / best['ms']:.2f}x faster than HDO 1.0 (target >= 3x)")
        elif case.startswith("muon/"):
            for r in rs:
                if r.get("provider", "").startswith("staged") and "ratio" in r:
                    out.append(f"{case} {r['provider']}: {r['ratio']:.3f}x native (target <= 1.10)")
    return out


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
