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

* ``--peers`` (issue #23): 1e9 fp32 params in 64 tensors (1.07M-66.7M), AdamW with fp32 moments:
  torch fused AdamW on the GPU, torchao 0.18 ``CPUOffloadOptimizer`` without and with
  ``offload_gradients``, and StagedAdamW designs (all in slots; auto-balanced host/slot split; each
  with gradients on the device or offloaded in hooks; fixed splits), built once and timed
  interleaved (min of ``--runs``): backward + step + synchronize, peak GPU memory, host bytes, GB/s
  per direction, fraction of each design's floor; host AdamW rates (torch's fused CPU AdamW per
  tensor as torchao runs it, our host lane, and the lane under PCIe traffic); a Megatron GPT step
  (~0.5B, 4 micro-batches) with native Adam vs staged vs HybridDeviceOptimizer 1.0 (torchao-style):
  exposed optimizer time. Writes ``optim_peers.json`` (the issue's record), ``optim_staged_peers.json``
  and ``optim_peers.png``. torchao is the ``bench`` extra (CUDA only; imported lazily).

Run: ``python -m bench.optim_staged`` (H200: ~2 min) or ``--quick`` (CPU/GPU smoke, seconds);
``--only adamw|muon|megatron`` runs one section; ``--targets`` runs only the cases behind the
issue's targets (H200: well under a minute).
Writes ``optim_staged.json`` / ``optim_staged.png`` into ``$OUT`` (or ``outputs/bench``)."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import traceback
from pathlib import Path

import torch

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results
from optim_staged import SlotConfig, StagedAdamW
from optim_staged.update import adamw_update_

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
GB = 1e9


def _timer(fn, iters):
    return (time_cuda(fn, warmup=2, iters=iters) if CUDA else time_cpu(fn, warmup=1, iters=iters))["p50"]


def bandwidth(nbytes: int, host_memory: torch.Tensor | None = None) -> dict[str, float]:
    """GB/s of pinned copies: H2D, D2H, and both at once (per direction). ``host_memory``: pinned
    host memory to copy from and to (its two halves) instead of two new ``nbytes`` buffers."""
    if host_memory is None:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        raw = host_memory.view(torch.uint8)
        nbytes = raw.numel() // 2
        host, host2 = raw[:nbytes], raw[nbytes:2 * nbytes]
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


# ----------------------------------------------------------------------------------------------
# Peers: the issue-#23 case (1e9 fp32 params in 64 tensors, AdamW, fp32 moments), torchao's
# CPUOffloadOptimizer (both modes) vs StagedAdamW's designs, all built once and timed interleaved.


PEER_PROVIDERS = {
    "torch_fused_gpu": "torch.optim.AdamW(fused=True), state on the GPU",
    "torchao_offload": "torchao 0.18 CPUOffloadOptimizer(torch.optim.AdamW) (fused CPU AdamW per tensor)",
    "torchao_offload_grads": "the same with offload_gradients=True",
    "staged_stream": "StagedAdamW(host_fraction=0): every update in the GPU slots, gradients on the device",
    "staged_stream_offload": "StagedAdamW(host_fraction=0, offload_gradients=True): slot updates in the backward pass",
    "staged_split": "StagedAdamW, host share found by auto_balance, gradients on the device",
    "staged_split_offload": "StagedAdamW, host share found by auto_balance, offload_gradients=True",
    "staged_stream_offload_budget4x": (
        "staged_stream_offload with offload_budget_bytes = 4 x the largest gradient "
        "(freed gradients in flight may take more *reserved* memory; allocated unchanged)"),
    "staged_stream_offload_noprefetch": (
        "staged_stream_offload without the hook prefetch (offload_prefetch=False)"),
    "staged_fit_offload": (
        "StagedAdamW.offload_plan(): the largest parameters on the host lane and slots sized so that "
        "slots + any slot-lane gradient <= the largest gradient (allocated peak of torchao's "
        "offload_gradients=True); offload_budget_bytes = 4 x the largest gradient"),
    "staged_fit_offload_t8": "staged_fit_offload with an 8-thread host lane (host_threads=8)",
    "staged_fit_offload_tmax": (
        "staged_fit_offload with the host lane on one thread fewer than PyTorch's intra-op count (the "
        "default until 2026-12-01 23:15; the default now is half of it)"),
    "staged_fit2_offload_t8": (
        "offload_plan(min_slot_numel=2 Mi): more of the largest parameters on the host lane for slots of "
        ">= 2 Mi elements, 8-thread host lane"),
}


def geometric_sizes(total: int, count: int, first: int) -> list[int]:
    """``count`` tensor sizes growing geometrically from ``first`` and summing to ``total``
    (1e9 / 64 / 1.07M gives 1.07M ... 66.7M, the peer note's set)."""
    lo, hi = 1.0, 2.0
    for _ in range(100):  # ratio r with first * (r^count - 1) / (r - 1) = total
        r = 0.5 * (lo + hi)
        if first * (r**count - 1) / (r - 1) > total:
            hi = r
        else:
            lo = r
    sizes = [int(first * lo**i) for i in range(count)]
    sizes[-1] += total - sum(sizes)
    return sizes


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _alloc() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


class _Harness:
    """``loss = sum_i <p_i, g_i>``: every backward pass produces the same gradients ``g_i`` through
    autograd, so post-accumulate-grad hooks (torchao, ``offload_gradients``) fire as in training."""

    def __init__(self, sizes: list[int]):
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.sizes = sizes
        self.grads = [torch.randn(s, device=DEV, generator=gen) * 1e-3 for s in sizes]
        self.grad_bytes = sum(g.numel() * 4 for g in self.grads)

    def params(self) -> list[torch.Tensor]:
        gen = torch.Generator(device=DEV).manual_seed(1)
        return [(torch.randn(s, device=DEV, generator=gen) * 0.02).requires_grad_() for s in self.sizes]

    def backward(self, ps: list[torch.Tensor]) -> None:
        torch.stack([torch.dot(p, g) for p, g in zip(ps, self.grads)]).sum().backward()

    def iteration(self, ps, opt) -> None:
        self.backward(ps)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def measured_iteration(self, ps, opt) -> tuple[float, int]:
        """One warm iteration (slots, events after a switch), then one timed: its wall ms and the
        device bytes allocated above the start at its peak (0 on CPU)."""
        self.iteration(ps, opt)
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        before = _alloc()
        t0 = time.perf_counter()
        self.iteration(ps, opt)
        _sync()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, (torch.cuda.max_memory_allocated() - before) if CUDA else 0


def use_config(opt: StagedAdamW, c: dict, slots: SlotConfig) -> None:
    """Switch one StagedAdamW (one set of host slabs) to configuration ``c`` between steps:
    ``host_fraction``, ``offload_gradients`` and optionally ``slots`` (else ``slots``),
    ``budget`` (``offload_budget_bytes``), ``host_threads``, ``prefetch`` (default on)."""
    want = c.get("slots", slots)
    if opt.slot_config != want:
        opt.set_slot_config(want)
    opt.offload_budget_bytes = c.get("budget")
    opt.host_threads = c.get("host_threads")
    opt.offload_prefetch = c.get("prefetch", True)
    opt.set_split(c["host_fraction"], auto_balance=False, offload_gradients=c["offload_gradients"])


def _gpu_state_bytes(opt) -> int:
    if isinstance(opt, StagedAdamW):
        return opt.gpu_state_bytes
    n = 0
    inner = getattr(opt, "d_opt", None) if not isinstance(opt, torch.optim.AdamW) else opt
    for st in (inner.state.values() if inner is not None else []):
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.is_cuda)
    return n


def host_adamw_pass(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, batch: int) -> None:
    """One AdamW update of flat host tensors as the host lane runs it: ``torch._fused_adamw_`` over
    ``batch``-element ranges (the bench's hyper-parameters, step 10)."""
    step = torch.tensor(10.0)
    for a in range(0, p.numel(), batch):
        b = min(p.numel(), a + batch)
        adamw_update_([p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.01)


def host_adamw_rates(n: int, batch: int, tao=None, staged: StagedAdamW | None = None, iters: int = 3) -> dict:
    """Host AdamW speed on this machine, in ms per ``n`` params: PyTorch's fused CPU AdamW as
    torchao runs it (one ``torch.optim.AdamW(fused=True).step()`` per tensor), our host lane's
    kernel calls (``torch._fused_adamw_`` over ``batch``-element slab ranges), and the latter while
    pinned copies run both ways on the GPU (DRAM shared with DMA, as in a split step)."""

    out = {"threads": torch.get_num_threads(), "host_batch_numel": batch}

    def best(fn):
        fn()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return min(ts)

    if tao is not None:
        opts = list(tao.optim_dict.values())
        out["torch_fused_cpu_per_tensor_ms"] = best(lambda: [o.step() for o in opts])
    if staged is not None:
        sl = staged.slabs

        def lane():
            host_adamw_pass(sl["master_param"], staged._grads["grad"], sl["exp_avg"], sl["exp_avg_sq"], batch)

        out["host_lane_ms"] = best(lane)
        if CUDA:  # the same with PCIe traffic both ways (host DRAM shared with the DMA engines)
            nb = 1 << 30
            h1 = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
            h2 = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
            d1 = torch.empty(nb, dtype=torch.uint8, device="cuda")
            d2 = torch.empty(nb, dtype=torch.uint8, device="cuda")
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
            reps = max(4, int(out["host_lane_ms"] * 50e6 / nb * (iters + 2)))  # ~50 GB/s per direction
            for _ in range(reps):
                with torch.cuda.stream(s1):
                    d1.copy_(h1, non_blocking=True)
                with torch.cuda.stream(s2):
                    h2.copy_(d2, non_blocking=True)
            out["host_lane_with_dma_ms"] = best(lane)
            out["dma_still_running"] = not (s1.query() and s2.query())
            torch.cuda.synchronize()
            del h1, h2, d1, d2
    scale = 1e9 / n
    for k in [k for k in out if k.endswith("_ms")]:
        out[k.replace("_ms", "_ms_per_1e9")] = out[k] * scale
    return out


def peers_rows(n: int, count: int, runs: int, bw: dict | None, quick: bool) -> tuple[list[dict], dict]:
    """torch fused AdamW (GPU state), torchao ``CPUOffloadOptimizer`` (both modes) and StagedAdamW
    designs on the same parameter set, interleaved ``runs`` times; min wall ms of backward + step +
    synchronize, peak GPU memory, host bytes, GB/s per direction and fraction of each design's floor."""

    sizes = geometric_sizes(n, count, max(1, int(n * 1.07e6 / 1e9)))
    h = _Harness(sizes)
    kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gib = 2**30
    providers: dict[str, dict] = {}  # name -> {params, opt, setup, host_bytes, ...}
    errors: list[dict] = []

    def add(name, build, host_bytes_fn=None):
        try:
            _sync()
            gc.collect()
            rss0 = _rss()
            ps = h.params()
            opt = build(ps)
            for _ in range(2):
                h.iteration(ps, opt)
            _sync()
            providers[name] = {"params": ps, "opt": opt, "rss_delta": _rss() - rss0}
        except Exception as e:  # noqa: BLE001
            errors.append(_error_row("peers", name, e))

    # fwd+bwd of the harness alone (no optimizer)
    ps0 = h.params()

    def fb_only():
        h.backward(ps0)
        for p in ps0:
            p.grad = None

    add("torch_fused_gpu", lambda ps: torch.optim.AdamW(ps, fused=CUDA, **kw))
    if CUDA:
        try:
            from torchao.optim import CPUOffloadOptimizer  # bench extra / GPU-lane wheel; imported lazily
        except ImportError as e:
            errors.append(_error_row("peers", "torchao", e))
            CPUOffloadOptimizer = None
        if CPUOffloadOptimizer is not None:
            add("torchao_offload", lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, **kw))
            add("torchao_offload_grads", lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW,
                                                                         offload_gradients=True, **kw))
    slots = SlotConfig(slot_numel=1 << 16) if quick else SlotConfig()
    add("staged", lambda ps: StagedAdamW(ps, **kw, host_fraction=0.5, slots=slots))
    staged = providers.get("staged", {}).get("opt")
    staged_rss = providers.get("staged", {}).get("rss_delta", 0)
    # Staged configurations, one optimizer (one set of host slabs) switched by set_split().
    configs: dict[str, dict] = {"staged_stream": dict(host_fraction=0.0, offload_gradients=False),
                                "staged_stream_offload": dict(host_fraction=0.0, offload_gradients=True)}
    found = {}
    big = 4 * max(sizes)  # the largest gradient (fp32)
    if staged is not None:
        configs["staged_stream_offload_budget4x"] = dict(host_fraction=0.0, offload_gradients=True,
                                                         budget=4 * big)
        configs["staged_stream_offload_noprefetch"] = dict(host_fraction=0.0, offload_gradients=True,
                                                           prefetch=False)
        share, fit_slots = staged.offload_plan()
        configs["staged_fit_offload"] = dict(host_fraction=share, offload_gradients=True, budget=4 * big,
                                             slots=fit_slots)
        # host-lane threads: the default (half of the intra-op threads) takes less of the host DRAM
        # bandwidth the DMA engines share than the former default (all but one; bench.optim_split_probe)
        configs["staged_fit_offload_tmax"] = dict(configs["staged_fit_offload"],
                                                  host_threads=max(1, torch.get_num_threads() - 1))
        share2, fit2 = staged.offload_plan(min_slot_numel=2 << 20)
        configs["staged_fit2_offload_t8"] = dict(host_fraction=share2, offload_gradients=True, budget=4 * big,
                                                 slots=fit2, host_threads=8)
        for offload in (False, True):  # auto_balance finds the split; timed runs then use it fixed
            staged.set_split(0.0, auto_balance=True, offload_gradients=offload)
            ps = providers["staged"]["params"]
            for _ in range(staged.balance_steps + 2):
                h.iteration(ps, staged)
            _sync()
            found[offload] = staged.split
        configs["staged_split"] = dict(host_fraction=found[False], offload_gradients=False)
        configs["staged_split_offload"] = dict(host_fraction=found[True], offload_gradients=True)

    def use(name):
        use_config(staged, configs[name], slots)
    order = [k for k in providers if k != "staged"] + (list(configs) if staged is not None else [])
    times: dict[str, list[float]] = {k: [] for k in order}
    peaks: dict[str, int] = {k: 0 for k in order}
    persist: dict[str, int] = {}
    fb_times = []
    for _ in range(runs):
        _sync()
        t0 = time.perf_counter()
        fb_only()
        _sync()
        fb_times.append((time.perf_counter() - t0) * 1e3)
        for name in order:
            if name in configs:
                use(name)
                ps, opt = providers["staged"]["params"], staged
            else:
                ps, opt = providers[name]["params"], providers[name]["opt"]
            ms, transient = h.measured_iteration(ps, opt)
            times[name].append(ms)
            if CUDA:
                peaks[name] = max(peaks[name], transient)
            persist[name] = sum(p.numel() * p.element_size() for p in ps) + _gpu_state_bytes(opt)
    # Reserved (not only allocated) transient memory: gradients freed while a copy or kernel still
    # reads them stay reserved until it is done. One extra iteration each, from an emptied cache.
    reserved: dict[str, int] = {}
    if CUDA:
        for name in order:
            if name in configs:
                use(name)
                ps, opt = providers["staged"]["params"], staged
            else:
                ps, opt = providers[name]["params"], providers[name]["opt"]
            h.iteration(ps, opt)
            _sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_reserved()
            h.iteration(ps, opt)
            _sync()
            reserved[name] = torch.cuda.max_memory_reserved() - before
    rates = host_adamw_rates(n, staged.host_batch_numel if staged else 16 << 20,
                             tao=providers.get("torchao_offload", {}).get("opt"), staged=staged)
    # floors
    dup = (bw or {}).get("duplex_per_dir")
    r_torch = rates.get("torch_fused_cpu_per_tensor_ms")
    r_lane = rates.get("host_lane_ms")
    rows = []
    for name in order:
        t = sorted(times[name])
        row = {"case": f"peers/N={n / 1e6:.0f}M", "provider": name, "ms": t[0], "ms_p50": t[len(t) // 2],
               "runs": len(t), "params": n, "peak_GiB": (h.grad_bytes + persist[name] + peaks[name]) / gib,
               "transient_GiB": peaks[name] / gib}
        if name in reserved:
            row["transient_reserved_GiB"] = reserved[name] / gib
        if name in configs:
            use(name)
            b = staged.bytes_per_step()
            host_bytes = staged.slabs.nbytes + (staged._grads.nbytes if b["host_numel"] else 0)
            row.update(slot_numel=staged.slot_config.slot_numel, num_slots=staged.slot_config.num_slots,
                       offload_budget_bytes=staged.offload_budget_bytes, host_threads=staged.host_threads)
            row.update(host_fraction=b["host_numel"] / n, offload_gradients=staged.offload_gradients,
                       host_GiB=host_bytes / gib, pinned_GiB=host_bytes / gib, h2d_GB=b["h2d"] / 1e9,
                       d2h_GB=b["d2h"] / 1e9, GBps_h2d=b["h2d"] / t[0] / 1e6, GBps_d2h=b["d2h"] / t[0] / 1e6)
            if dup:
                floor = max(b["h2d"], b["d2h"]) / (dup * 1e6)
                if r_lane:
                    floor = max(floor, r_lane * b["host_numel"] / n)
                row.update(floor_ms=floor, pct_floor=floor / t[0])
        elif name.startswith("torchao"):
            opt = providers[name]["opt"]
            pinned = sum(ph.numel() * 4 * 2 for ph in opt.param_d2h_map.values())
            row.update(host_GiB=providers[name]["rss_delta"] / gib, pinned_GiB=pinned / gib,
                       offload_gradients=name.endswith("grads"), host_fraction=1.0, h2d_GB=4 * n / 1e9,
                       d2h_GB=4 * n / 1e9, GBps_h2d=4 * n / t[0] / 1e6, GBps_d2h=4 * n / t[0] / 1e6)
            if r_torch and bw:
                floor = max(r_torch, 4 * n / (bw["d2h"] * 1e6), 4 * n / (bw["h2d"] * 1e6))
                row.update(floor_ms=floor, pct_floor=floor / t[0])
        else:
            row.update(host_GiB=0.0, pinned_GiB=0.0)
        rows.append(row)
    best_tao, tao_grads, best = mark_staged_best(rows)
    extra = {"sizes": [min(sizes), max(sizes)], "count": count, "fwd_bwd_ms": min(fb_times),
             "staged_rss_delta_GiB": staged_rss / gib,
             "host_adamw": rates, "auto_split": {"grads_on_device": found.get(False), "offload": found.get(True)},
             "errors": errors}
    if dup and r_lane:
        # floor of any split with offloaded gradients, slot share s: per direction the slot lane moves
        # its moments (8 B/param) and the host lane a gradient or a weight (4 B/param), so
        # max((4 + 4 s) N / B, (1 - s) R N) if the lanes did not share host DRAM (they do)
        ss = [i / 1000 for i in range(1001)]
        fl = [max((4 + 4 * x) * n / (dup * 1e6), (1 - x) * r_lane) for x in ss]
        i = min(range(len(ss)), key=fl.__getitem__)
        extra["split_floor"] = {"ms": fl[i], "slot_share": ss[i], "duplex_GBps": dup, "host_lane_ms": r_lane}
    if best is not None and best_tao is not None:
        extra["target"] = {
            "speedup_vs_best_torchao": best_tao["ms"] / best["ms"], "target_speedup": 1.5,
            "best_torchao": best_tao["provider"], "staged_best": best["provider"], "peak_GiB": best["peak_GiB"],
            "torchao_offload_grads_peak_GiB": tao_grads["peak_GiB"] if tao_grads else None,
            "peak_ok": tao_grads is not None and best["peak_GiB"] <= tao_grads["peak_GiB"],
            "met": best_tao["ms"] / best["ms"] >= 1.5 and tao_grads is not None
            and best["peak_GiB"] <= tao_grads["peak_GiB"]}
    for v in providers.values():
        v.clear()
    providers.clear()
    staged = h = ps0 = None  # free the parameter set before the next section
    _free()
    return rows + errors, extra


def mark_staged_best(rows: list[dict]) -> tuple[dict | None, dict | None, dict | None]:
    """``staged_best``: the fastest StagedAdamW configuration with offloaded gradients (the memory
    class of torchao's ``offload_gradients=True``) whose allocated peak is <= torchao's in that
    mode; the fastest with offloaded gradients if none is. Returns (best torchao row, torchao
    offload_grads row, staged_best row)."""
    peers = [r for r in rows if r.get("case", "").startswith("peers/") and "ms" in r]
    best_tao = min((r for r in peers if r["provider"].startswith("torchao")), key=lambda r: r["ms"], default=None)
    tao_grads = next((r for r in peers if r["provider"] == "torchao_offload_grads"), None)
    staged = [r for r in peers if r["provider"].startswith("staged") and r.get("offload_gradients")]
    within = [r for r in staged if tao_grads is not None and r["peak_GiB"] <= tao_grads["peak_GiB"]]
    best = min(within or staged, key=lambda r: r["ms"], default=None)
    for r in peers:
        r.pop("staged_best", None)
    if best is not None:
        best["staged_best"] = True
    return best_tao, tao_grads, best


def rewrite_peers(path: str) -> None:
    """Re-write optim_peers.json and optim_peers.png from a saved optim_staged_peers.json (same
    rows and header; the staged_best rule of :func:`mark_staged_best`)."""
    import json

    d = json.loads(Path(path).read_text())
    rows, extra = d["rows"], d["extra"]
    prow = [r for r in rows if r.get("case", "").startswith("peers/")]
    best_tao, tao_grads, best = mark_staged_best(prow)
    if best is not None and best_tao is not None:
        extra["target"] = {
            "speedup_vs_best_torchao": best_tao["ms"] / best["ms"], "target_speedup": 1.5,
            "best_torchao": best_tao["provider"], "staged_best": best["provider"], "peak_GiB": best["peak_GiB"],
            "torchao_offload_grads_peak_GiB": tao_grads["peak_GiB"] if tao_grads else None,
            "peak_ok": tao_grads is not None and best["peak_GiB"] <= tao_grads["peak_GiB"],
            "met": best_tao["ms"] / best["ms"] >= 1.5 and tao_grads is not None
            and best["peak_GiB"] <= tao_grads["peak_GiB"]}
    n = prow[0]["params"]
    write_peers(prow, extra, n, extra.get("count", 64), prow[0].get("runs", 5), header=d["header"])
    plot_peers(rows)
    print("target:", extra.get("target"))


def write_peers(rows: list[dict], extra: dict, n: int, count: int, runs: int, header: dict | None = None) -> Path:
    """``optim_peers.json`` as issue #23's Record asks: header, params, rows of {provider, ms,
    peak_GiB, host_GiB} (torchao_offload, torchao_offload_grads, staged_best, ... from one run)."""
    import json

    from bench._common import machine_header

    out = []
    for r in rows:
        if "ms" not in r:
            continue
        out.append({k: r.get(k) for k in ("provider", "ms", "peak_GiB", "host_GiB")})
        if r.get("staged_best"):
            out.append({"provider": "staged_best", **{k: r.get(k) for k in ("ms", "peak_GiB", "host_GiB")}})
    best = next((r for r in rows if r.get("staged_best")), {})
    payload = {"header": header or machine_header(),
               "params": {"numel": n, "tensors": count, "sizes": extra.get("sizes"), "dtype": "float32",
                          "optimizer": "AdamW lr=1e-4 betas=(0.9,0.999) eps=1e-8 wd=0.01", "moments": "float32",
                          "timing": f"min wall ms over {runs} interleaved runs of backward (loss = sum <p_i, g_i>) "
                                    "+ step + synchronize",
                          "peak": "fixed gradient inputs + params + GPU optimizer state + transient peak of the run",
                          "staged_best": {"provider": best.get("provider"), "host_fraction": best.get("host_fraction"),
                                          "offload_gradients": best.get("offload_gradients"),
                                          "slot_numel": best.get("slot_numel"),
                                          "num_slots": best.get("num_slots"),
                                          "offload_budget_bytes": best.get("offload_budget_bytes"),
                                          "host_threads": best.get("host_threads"),
                                          "rule": ("fastest StagedAdamW configuration with "
                                                   "offload_gradients=True whose peak_GiB <= "
                                                   "torchao_offload_grads's (the fastest with "
                                                   "offload_gradients=True if none is)")},
                          "providers": PEER_PROVIDERS},
               "rows": out}
    path = out_dir() / "optim_peers.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def plot_peers(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rs = [r for r in rows if "ms" in r and r.get("case", "").startswith("peers/")]
    if not rs:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["provider"] + (" *" if r.get("staged_best") else "") for r in rs]
    colors = ["tab:orange" if r["provider"].startswith("torchao") else
              "tab:green" if r.get("staged_best") else "tab:gray" if r["provider"] == "torch_fused_gpu"
              else "tab:blue" for r in rs]
    a1.barh(range(len(rs)), [r["ms"] for r in rs], color=colors)
    a1.set_yticks(range(len(rs)), names, fontsize=7)
    a1.invert_yaxis()
    a1.set_xlabel("ms per step (backward + step, min of runs)")
    for i, r in enumerate(rs):
        if r.get("floor_ms"):
            a1.plot([r["floor_ms"]] * 2, [i - 0.4, i + 0.4], color="k", lw=1)
    a2.barh(range(len(rs)), [r["peak_GiB"] for r in rs], color=colors)
    for i, r in enumerate(rs):
        if r.get("transient_reserved_GiB") is not None and r.get("offload_gradients"):
            res = r["peak_GiB"] - r["transient_GiB"] + r["transient_reserved_GiB"]
            a2.plot([res] * 2, [i - 0.4, i + 0.4], color="k", lw=1)
    a2.set_yticks(range(len(rs)), [""] * len(rs))
    a2.invert_yaxis()
    a2.set_xlabel("peak GPU GiB allocated (ticks, offloaded gradients: transient peak reserved)")
    fig.suptitle(f"AdamW, {rs[0]['params'] / 1e9:.2g}e9 fp32 params: torchao CPUOffloadOptimizer vs StagedAdamW "
                 "(black ticks left: each design's floor; * staged_best)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir() / "optim_peers.png", dpi=120)


def megatron_exposed_rows(quick: bool, runs: int, microbatches: int = 4) -> list[dict]:
    """A Megatron GPT train step (bf16, distributed optimizer, 1 GPU, ``microbatches`` micro-batches):
    native Megatron Adam (GPU state) vs StagedAdamW (all in slots; auto-balanced host/slot split) vs
    Megatron's HybridDeviceOptimizer at fraction 1.0 (torchao-style: gradients down, CPU AdamW,
    weights up). Exposed optimizer time = full step - forward/backward alone, min over
    interleaved runs."""

    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron
    from optim_staged.config import AdamWConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer, staged_leaves

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not CUDA:  # smoke runs: Megatron on CPU/gloo
        from mcore_distill import cpu_compat

        cpu_compat.enable()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
        init_megatron(tp=1, pp=1, seed=1)
    cfg = (TinyGPTConfig(vocab_size=512, hidden_size=128, num_layers=2, ffn_hidden_size=256, num_attention_heads=4,
                         num_query_groups=2, params_dtype=torch.bfloat16, max_sequence_length=128) if quick else
           TinyGPTConfig(vocab_size=32768, hidden_size=2048, num_layers=8, ffn_hidden_size=5632,
                         num_attention_heads=16, num_query_groups=4, params_dtype=torch.bfloat16,
                         max_sequence_length=1024))
    B, S = (2, 64) if quick else (2, 1024)
    gib = 2**30
    lr = 1e-4
    base = dict(optimizer="adam", lr=lr, weight_decay=0.01, use_distributed_optimizer=True, bf16=True,
                params_dtype=torch.bfloat16, clip_grad=1.0)
    kinds = {"mcore_native": None, "mcore_staged_split": "auto"}
    if CUDA:
        kinds["mcore_hdo_1.0"] = "hdo"
    built, rows = {}, []
    for name, kind in kinds.items():
        try:
            model = build_tiny_gpt(cfg)
            if CUDA:
                model = model.cuda()
            model = Float16Module(model.config, model)
            model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                    use_distributed_optimizer=True), model)
            model.config.finalize_model_grads_func = finalize_model_grads
            if kind == "hdo":
                opt = get_megatron_optimizer(OptimizerConfig(**base, optimizer_cpu_offload=True,
                                                             optimizer_offload_fraction=1.0,
                                                             use_precision_aware_optimizer=True,
                                                             overlap_cpu_optimizer_d2h_h2d=True), [model])
            else:
                a = AdamWConfig(lr=lr, weight_decay=0.01, host_fraction=0.0, auto_balance=kind == "auto")
                opt = get_staged_optimizer(StagedOptimizerConfig(residency="gpu" if kind is None else "staged",
                                                                 adamw=a), [model])
            gen = torch.Generator().manual_seed(0)
            data = [torch.randint(0, cfg.vocab_size, (B, S), generator=gen).to(DEV) for _ in range(microbatches)]
            pos = torch.arange(S, device=DEV).expand(B, S)

            def fwd(it, m, pos=pos):
                t = next(it)
                return m(t, pos, None, labels=t), lambda o: (o.float().mean(), {})

            def fb(model=model, opt=opt, data=data, fwd=fwd):
                model.zero_grad_buffer()
                opt.zero_grad()
                get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(data), model=[model],
                                            num_microbatches=len(data), seq_length=S, micro_batch_size=B,
                                            forward_only=False)

            def full(fb=fb, opt=opt):
                fb()
                opt.step()

            for _ in range(10 if kind == "auto" else 2):  # auto: the balance steps
                full()
            _sync()
            leaves = staged_leaves(opt)
            built[name] = {"fb": fb, "full": full, "model": model, "opt": opt, "leaves": leaves, "fb_t": [],
                           "full_t": [], "peak": 0,
                           "params": sum(p.numel() for p in model.parameters())}
        except Exception as e:  # noqa: BLE001
            rows.append(_error_row("megatron_exposed", name, e))
    for _ in range(runs):
        for b in built.values():
            for key, fn in (("fb_t", b["fb"]), ("full_t", b["full"])):
                _sync()
                if CUDA and key == "full_t":
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                fn()
                _sync()
                b[key].append((time.perf_counter() - t0) * 1e3)
                if CUDA and key == "full_t":  # this model's transient (all models stay resident)
                    b["peak"] = max(b["peak"], torch.cuda.max_memory_allocated() - before)
    for name, b in built.items():
        fb_ms, full_ms = min(b["fb_t"]), min(b["full_t"])
        row = {"case": f"megatron_exposed/{b['params'] / 1e6:.0f}M_x{microbatches}mb", "provider": name,
               "ms": full_ms, "fwd_bwd_ms": fb_ms, "exposed_opt_ms": full_ms - fb_ms, "step_transient_GiB": b["peak"] / gib,
               "params": b["params"], "runs": runs}
        if b["leaves"]:
            inner = b["leaves"][0].optimizer
            row.update(host_fraction=inner.split, opt_gpu_state_GiB=inner.gpu_state_bytes / gib)
        rows.append(row)
    base_row = next((r for r in rows if r.get("provider") == "mcore_native" and "ms" in r), None)
    for r in rows:
        if base_row and "ms" in r:
            r["ratio"] = r["ms"] / base_row["ms"]
    built.clear()
    _free()
    return rows


def peers_main(args) -> None:
    """``--peers``: bandwidth, the 1e9-parameter peer comparison, host AdamW rates and the Megatron
    exposed-optimizer-time step; writes optim_peers.json (issue #23's record),
    optim_staged_peers.json (all rows) and optim_peers.png."""
    n, count, runs = (4_000_000, 16, 3) if args.quick else (1_000_000_000, 64, args.runs)
    bw = bandwidth((64 << 20) if args.quick else (1 << 30)) if CUDA else None
    rows = [{"case": "bw", "provider": k, "GBps_dir": v} for k, v in (bw or {}).items()]
    prow, extra = peers_rows(n, count, runs, bw, args.quick)
    rows += prow
    extra["bandwidth_GBps"] = bw
    write_peers(prow, extra, n, count, runs)  # written before the Megatron section, in case it fails
    write_results("optim_staged_peers", rows, extra)
    plot_peers(rows)
    print("target:", extra.get("target"), flush=True)
    if not args.no_megatron:
        try:
            rows += megatron_exposed_rows(args.quick, runs=3 if args.quick else args.runs)
        except Exception as e:  # noqa: BLE001
            rows.append(_error_row("megatron_exposed", "error", e))
    path = write_results("optim_staged_peers", rows, extra)
    write_peers(prow, extra, n, count, runs)
    plot_peers(rows)
    print(f"wrote {path}")
    print("host AdamW:", {k: round(v, 1) if isinstance(v, float) else v for k, v in extra["host_adamw"].items()})
    print("split floor:", extra.get("split_floor"), "auto split:", extra.get("auto_split"))
    print("target:", extra.get("target"))
    print_table(rows, ["case", "provider", "ms", "ms_p50", "peak_GiB", "transient_reserved_GiB", "host_GiB",
                       "host_fraction", "GBps_h2d",
                       "GBps_d2h", "pct_floor", "fwd_bwd_ms", "exposed_opt_ms", "step_transient_GiB", "GBps_dir",
                       "error"])


def offload_ab_main(args) -> None:
    """``--offload-ab``: on the ``--peers`` parameter set, StagedAdamW with offloaded gradients with
    the hook prefetch on and off, ``offload_plan``'s fit, and the stream path without offload, all on
    one set of host slabs, ``--runs`` interleaved runs; min/p50 ms and the allocated transient
    against the largest gradient (torchao's offload_gradients transient). Writes
    ``optim_staged_offload_ab.json``."""

    n, count, runs = (4_000_000, 16, 3) if args.quick else (1_000_000_000, 64, args.runs)
    sizes = geometric_sizes(n, count, max(1, int(n * 1.07e6 / 1e9)))
    h = _Harness(sizes)
    big = 4 * max(sizes)
    slots = SlotConfig(slot_numel=1 << 16) if args.quick else SlotConfig()
    ps = h.params()
    opt = StagedAdamW(ps, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, slots=slots,
                      host_fraction=0.5)
    share, fit = opt.offload_plan()
    configs = {"stream": dict(host_fraction=0.0, offload_gradients=False),
               "offload_prefetch": dict(host_fraction=0.0, offload_gradients=True),
               "offload_noprefetch": dict(host_fraction=0.0, offload_gradients=True, prefetch=False),
               "fit_offload": dict(host_fraction=share, offload_gradients=True, slots=fit, budget=4 * big)}

    times = {k: [] for k in configs}
    trans = {k: 0 for k in configs}
    for _ in range(runs):
        for name, c in configs.items():
            use_config(opt, c, slots)
            ms, transient = h.measured_iteration(ps, opt)
            times[name].append(ms)
            if CUDA:
                trans[name] = max(trans[name], transient)
            print(f"{name}: {times[name][-1]:.1f} ms, transient {trans[name] / 2**30:.4f} GiB", flush=True)
    rows = []
    for name, c in configs.items():
        t = sorted(times[name])
        rows.append({"case": f"offload_ab/N={n / 1e6:.0f}M", "provider": name, "ms": t[0],
                     "ms_p50": t[len(t) // 2],
                     "runs": len(t), "transient_GiB": trans[name] / 2**30, "largest_grad_GiB": big / 2**30,
                     "host_fraction": c["host_fraction"], "slot_numel": c.get("slots", slots).slot_numel,
                     "num_slots": c.get("slots", slots).num_slots})
    path = write_results("optim_staged_offload_ab", rows, {"sizes": [min(sizes), max(sizes)], "count": count})
    print(f"wrote {path}")
    print_table(rows, ["provider", "ms", "ms_p50", "transient_GiB", "largest_grad_GiB", "host_fraction",
                       "slot_numel", "num_slots"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--no-megatron", action="store_true", help="skip the Megatron model step")
    ap.add_argument("--no-snapshot", action="store_true", help="skip the CUDA allocator snapshots")
    ap.add_argument("--only", choices=("adamw", "muon", "megatron"), default=None, help="run one section")
    ap.add_argument("--targets", action="store_true",
                    help="short run of the issue's target cases only (AdamW 134M sweep + HDO 1.0, Muon on the "
                         "issue's shapes at stack sizes; no Megatron step); H200: well under a minute")
    ap.add_argument("--peers", action="store_true",
                    help="issue #23: 1e9 fp32 params vs torchao CPUOffloadOptimizer (both modes), host AdamW rates, "
                         "Megatron exposed optimizer time; writes optim_peers.json / .png")
    ap.add_argument("--runs", type=int, default=5, help="interleaved timed runs (--peers)")
    ap.add_argument("--offload-ab", action="store_true",
                    help="offloaded gradients, hook prefetch on/off, offload_plan's fit (no peers)")
    ap.add_argument("--rewrite-peers", metavar="JSON", default=None,
                    help="re-write optim_peers.json/.png from a saved optim_staged_peers.json (no timing)")
    args = ap.parse_args()
    if args.rewrite_peers:
        rewrite_peers(args.rewrite_peers)
        return
    if args.offload_ab:
        offload_ab_main(args)
        return
    if args.peers:
        peers_main(args)
        return
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
