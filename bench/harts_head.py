"""LM head at the real vocabulary: :func:`harts.tree_lm_head` against the peers a user would pick.

Case: ``T`` rows (default 16,384), hidden 2048, vocabulary 151,936 (Qwen3), bf16 weights and
hidden states (hidden ~ N(0, 1), weights ~ N(0, 0.02²)), fwd+bwd of the summed token log-prob.

Providers on chain rows (one packed sequence: row ``u`` predicts token ``u + 1``):

* ``harts_default``: ``tree_lm_head`` with no options (on CUDA the Triton kernels, autotuned on
  the first call per shape; that call's time is reported as ``first_call_s``);
* ``liger_flce`` / ``liger_flce_fp32``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss``
  (``reduction="sum"``; default ``accum_dtype``, i.e. bf16 accumulation, and ``torch.float32``);
  it returns the summed NLL only (no per-token log-probs, entropies or trees);
* ``torch_full``: bf16 GEMM to full logits, fp32 ``log_softmax``, autograd.

Tree rows (GRPO ρ = 0.75: 4 groups of 16 × 1024 tokens; a caterpillar of 2 trees with 8 turns of
512 and 2 branches of 256 per turn; ≈ 16,384 compact rows each): ``harts_default`` and
``torch_full`` (the full-logits tree head), objective = Σ of every edge's log-prob.

Per provider: wall time of fwd+bwd (minimum over ``--iters`` ≥ 5 interleaved runs; median too), peak
memory above the inputs (``torch.cuda.max_memory_allocated``; the bf16 ``dW`` and ``dh`` that the
call returns count), and the gradients' relative Frobenius error ``‖g − g_ref‖ / ‖g_ref‖`` against
an fp32 reference (the same bf16 values upcast, full fp32 logits, TF32 off, fp32 results, not
rounded), for ``dW`` and ``dhidden``; ``grad_rel_err`` is the larger of the two. The roofline is the
issue's: 3 GEMMs of 2·T·H·V at 989 TFLOP/s (dense bf16, H100/H200 datasheet); ``harts`` runs 4 such
GEMMs (the logits twice), so its own ceiling is 4/3 of that time. The bf16 rate that cuBLAS reaches on
the head's ``[T, H] × [H, V]`` product in the same run is printed as the practical ceiling.

``--sweep`` times variants of the harts head (the per-tile rescaling of ``E`` instead of the
row references, the backward vocabulary block, the pointer-based Triton kernels alone, i.e. without
the tensor-descriptor/persistent family the autotuner may pick, a differentiable entropy).
``--profile`` adds the harts head's GPU kernel time by kernel and where the GPU idled during the
call (host-starved gaps vs launch latency). The Triton GEMMs' autotuning record
(every configuration's time, the chosen one) is printed and written too.

Run: ``python -m bench.harts_head`` (GPU; ``--quick`` on CPU: tiny sizes, torch path). Writes
``harts_head_peers.json`` (the record: ``header``, ``vocab``, ``rows``), ``harts_head.json`` (all
rows) and ``harts_head.png`` into ``bench._common.out_dir()``; prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench._common import machine_header, out_dir, peak_memory, print_table, sync, wall_ms, write_results

PEAK_TFLOPS = 989.4  # dense bf16, H100/H200 SXM datasheet


class Case:
    """bf16 leaves ``hid [T, H]``, ``w [V, H]`` and the rows' ``tokens``, ``parent``."""

    def __init__(self, name, tokens, parent, *, h, v, dev, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        t = tokens.numel()
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        self.name, self.t, self.h, self.v = name, t, h, v
        self.hid = torch.randn(t, h, device=dev, generator=g).to(dtype).requires_grad_(True)
        self.w = (0.02 * torch.randn(v, h, device=dev, generator=g)).to(dtype).requires_grad_(True)
        self.tokens, self.parent = tokens.to(dev), parent.to(dev)
        from harts.lm_head import head_edges

        self.edges = head_edges(self.tokens, self.parent)
        has = (self.parent >= 0).cpu()
        self.rows = self.parent[has.to(dev)]  # each edge's parent row and token (host-known count)
        self.targets = self.tokens[has.to(dev)]
        self.chain = bool((self.parent.cpu() == torch.arange(-1, t - 1)).all())

    def reset(self):
        self.hid.grad = self.w.grad = None

    def grads(self):
        return self.w.grad, self.hid.grad


def chain_case(t, h, v, dev):
    g = torch.Generator().manual_seed(1)
    return Case("chain", torch.randint(0, v, (t,), generator=g), torch.arange(-1, t - 1), h=h, v=v, dev=dev)


def tree_cases(h, v, dev, quick):
    from harts.forest import build_forest
    from harts.workload import caterpillar, grpo_for_sharing

    if quick:
        wl = [("grpo_rho0.75", grpo_for_sharing(0.75, num_groups=1, n=8, seq_len=32, vocab_size=v, seed=1)),
              ("caterpillar", caterpillar(1, turns=2, turn_len=8, branches=2, branch_len=4, vocab_size=v))]
    else:
        wl = [("grpo_rho0.75", grpo_for_sharing(0.75, num_groups=4, n=16, seq_len=1024, vocab_size=v, seed=1)),
              ("caterpillar", caterpillar(2, turns=8, turn_len=512, branches=2, branch_len=256, vocab_size=v))]
    out = []
    for name, seqs in wl:
        f = build_forest(seqs)
        out.append(Case(name, f.tokens, f.parent, h=h, v=v, dev=dev, seed=2))
    return out


def harts_fn(case, **kw):
    from harts.lm_head import tree_lm_head

    ent_grad = kw.get("entropy_requires_grad", False)

    def fn():
        lp, ent = tree_lm_head(case.hid, case.w, case.tokens, case.parent, edges=case.edges, **kw)
        (lp.sum() + ent.sum() if ent_grad else lp.sum()).backward()
    return fn


def torch_full_fn(case):
    def fn():
        z = (case.hid @ case.w.T).float()  # logits in the model dtype, softmax math in fp32
        lp = torch.log_softmax(z, -1)
        lp[case.rows, case.targets].sum().backward()
    return fn


def liger_fns(case):
    """``{name: fn}`` of Liger FLCE in both accumulation modes (empty without liger-kernel)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        print(f"note: liger-kernel not importable ({e}); its rows are skipped")
        return {}
    target = torch.full((case.t,), -100, dtype=torch.long, device=case.hid.device)
    target[case.rows] = case.targets  # row u predicts the token of its child
    out = {}
    for name, acc in (("liger_flce", None), ("liger_flce_fp32", torch.float32)):
        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=acc)

        def fn(loss_fn=loss_fn):
            (-loss_fn(case.w, case.hid, target)).backward()  # Σ log-prob = −Σ NLL
        out[name] = fn
    return out


def fp32_reference(case):
    """(dW, dhidden) of Σ edge log-probs in fp32 from full fp32 logits (TF32 off), unrounded."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h = case.hid.detach().float().requires_grad_(True)
        w = case.w.detach().float().requires_grad_(True)
        lp = torch.log_softmax(h @ w.T, -1)
        lp[case.rows, case.targets].sum().backward()
        return w.grad, h.grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def rel_err(g, ref) -> float:
    return float((g.float() - ref).norm() / ref.norm())


def measure(case, fns: dict, iters: int, ref=None) -> dict:
    """Warm-up (first-call time), then ``iters`` interleaved timed runs, peak memory and errors."""
    res = {}
    for name, fn in fns.items():
        case.reset()
        t0 = time.perf_counter()
        fn()
        sync()
        res[name] = {"first_call_s": time.perf_counter() - t0, "samples": []}
        if ref is not None:
            dw, dh = case.grads()
            res[name]["err_dW"], res[name]["err_dh"] = rel_err(dw, ref[0]), rel_err(dh, ref[1])
        case.reset()
    for _ in range(iters):  # interleaved: clock and allocator drift hit every provider alike
        for name, fn in fns.items():
            res[name]["samples"].append(wall_ms(fn))
            case.reset()
    for name, fn in fns.items():
        res[name]["peak"] = peak_memory(fn)
        case.reset()
    return res


def _flops(case) -> float:
    return 2.0 * case.t * case.h * case.v


def cublas_tflops(case) -> float:
    """TFLOP/s of one bf16 cuBLAS ``[T, H] × [H, V]`` product (minimum time of 5)."""
    if not torch.cuda.is_available():
        return float("nan")
    a, b = case.hid.detach(), case.w.detach()
    torch.mm(a, b.T)
    best = min(wall_ms(lambda: torch.mm(a, b.T)) for _ in range(5))
    return _flops(case) / (best * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------
# sweep-only alternatives (design record; not library code)


def sweep_variants(quick: bool):
    import harts.lm_head as lm_head
    import harts.lm_head_triton as tri

    if quick:
        return {"torch c16": ({"impl": "torch", "chunk_size": 16}, None)}
    return {
        "triton default": ({}, None),
        "triton, per-tile rescaling of E (no row reference)": ({}, (lm_head, "_ROW_REFERENCE", False)),
        "triton vb2048": ({"vocab_block": 2048}, None),
        "triton vb1024": ({"vocab_block": 1024}, None),
        "triton, pointer kernels only (no TMA)": ({}, (tri, "_tma_ok", lambda *ts: False)),
        "triton + entropy grad": ({"entropy_requires_grad": True}, None),
    }


def _patched(fn, patch):
    """``fn`` run with ``setattr(module, attr, value)`` in place for the call only."""
    if patch is None:
        return fn
    mod, attr, new = patch

    def call():
        old = getattr(mod, attr)
        setattr(mod, attr, new)
        try:
            return fn()
        finally:
            setattr(mod, attr, old)

    return call


def run_sweep(case, ref, quick, iters=5):
    """Every variant timed in the same interleaved loop (min of ``iters``); errors vs ``ref`` from
    each variant's warm-up call (none for the entropy-gradient variant: its gradients differ by design)."""
    from harts.lm_head import _triton_vocab_block

    variants = sweep_variants(quick)
    fns = {name: _patched(harts_fn(case, **kw), patch) for name, (kw, patch) in variants.items()}
    res = measure(case, fns, iters, ref=ref)
    rows = []
    for name, (kw, _patch) in variants.items():
        r = res[name]
        err_dw, err_dh = ((float("nan"), float("nan")) if kw.get("entropy_requires_grad")
                          else (r["err_dW"], r["err_dh"]))
        block = None if kw.get("impl") == "torch" else _triton_vocab_block(case.t, case.v, kw.get("chunk_size", 1024),
                                                                            kw.get("vocab_block"))
        rows.append({"variant": name, "T": case.t, "vocab_block": block, "ms_min": min(r["samples"]),
                     "ms_median": statistics.median(r["samples"]), "iters": len(r["samples"]),
                     "peak_GiB": r["peak"] / 2**30, "err_dW": err_dw, "err_dh": err_dh,
                     "first_call_s": r["first_call_s"]})
    return rows


def profile_kernels(fn) -> dict:
    """One profiled call of ``fn``: GPU kernel ms by kernel name (``kernel_ms``; Triton kernels by
    function name), the call's wall ms under the profiler and where the GPU idled
    (:func:`bench._common.gpu_idle`: gaps the host starved vs launch latency between queued kernels)."""
    if not torch.cuda.is_available():
        return {}
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    from bench._common import gpu_idle

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    by_name: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.key and not e.key.startswith("["):
            key = e.key.split("(")[0][:60]
            by_name[key] = by_name.get(key, 0.0) + e.device_time_total / 1e3
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        idle = gpu_idle(json.loads(Path(tmp.name).read_text()))
    return {"kernel_ms": dict(sorted(by_name.items(), key=lambda kv: -kv[1])), "wall_ms": wall, "idle": idle}


def _tuned_configs() -> dict:
    try:
        from harts import lm_head_triton as tri

        return {**{k: {"chosen": tri.tuned_config(k), "timed": tri.tuning_record(k)} for k in ("logit_tiles", "logit_grad")},
                "tma_failed": list(tri._TMA_FAILED)}
    except Exception as e:  # noqa: BLE001 - reporting only
        return {"error": repr(e)}


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"{r['provider']}\n{r['rows']}" for r in rows]
    colors = ["tab:green" if r["provider"].startswith("harts") else "tab:grey" for r in rows]
    for ax, key, title in zip(axes, ("ms", "peak_GiB", "grad_rel_err"),
                              ("fwd+bwd ms (min of interleaved runs)", "peak GiB above inputs",
                               "gradient rel. error vs fp32 (max of dW, dh)"), strict=True):
        vals = [r[key] for r in rows]
        ax.barh(range(len(rows)), vals, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        if key == "peak_GiB" and min(vals) > 0:
            ax.set_xscale("log")
        for i, val in enumerate(vals):
            ax.annotate(f"{val:.3g}", (val, i), fontsize=7, va="center")
    fig.suptitle(f"LM head, T={rows[0]['T']}, H={rows[0]['H']}, V={rows[0]['V']}, bf16 (one H200)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t_, h, v = (96, 32, 1000) if args.quick else (args.rows, 2048, args.vocab)
    iters = max(args.iters, 5) if not args.quick else 1
    chain = chain_case(t_, h, v, dev)
    table, rows = [], []
    cases = [chain] + tree_cases(h, v, dev, args.quick)
    for case in cases:
        ref = fp32_reference(case)
        fns = {"harts_default": harts_fn(case)}
        if getattr(args, "fused_head", False) and case.chain:
            fns["harts_torch_fused"] = harts_fn(case, fused=True)
        if case.chain and dev == "cuda":
            fns.update(liger_fns(case))
        fns["torch_full"] = torch_full_fn(case)
        res = measure(case, fns, iters, ref=ref)
        for name, r in res.items():
            ms = min(r["samples"])
            row = {"provider": name, "rows": case.name, "T": case.t, "H": h, "V": v, "ms": ms,
                   "ms_median": statistics.median(r["samples"]), "iters": len(r["samples"]),
                   "samples_ms": [round(s, 3) for s in r["samples"]],
                   "peak_GiB": r["peak"] / 2**30, "grad_rel_err": max(r["err_dW"], r["err_dh"]),
                   "grad_rel_err_dW": r["err_dW"], "grad_rel_err_dhidden": r["err_dh"],
                   "first_call_s": r["first_call_s"],
                   "roofline_3gemm_fraction": 3 * _flops(case) / (PEAK_TFLOPS * 1e12) / (ms * 1e-3)}
            rows.append(row)
        if case.chain:
            chain_ref = ref
        del ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    extra = {"cublas_tflops": cublas_tflops(chain), "tuned": _tuned_configs()}
    if args.sweep:
        extra["sweep"] = run_sweep(chain, chain_ref, args.quick, iters)
    if args.profile and dev == "cuda":
        prof = profile_kernels(harts_fn(chain))
        extra["kernel_ms"], extra["profile"] = prof["kernel_ms"], {k: prof[k] for k in ("wall_ms", "idle")}
        chain.reset()
    for r in rows:
        table.append({k: r[k] for k in ("rows", "provider", "ms", "ms_median", "peak_GiB", "grad_rel_err_dW",
                                        "grad_rel_err_dhidden", "roofline_3gemm_fraction", "first_call_s")})
    return {"rows": rows, "table": table, "extra": extra, "vocab": v, "T": t_, "H": h}


def write_record(result) -> None:
    """``harts_head_peers.json``: the issue's record (chain rows of the four providers)."""
    keep = ("harts_default", "liger_flce", "liger_flce_fp32", "torch_full")
    rec = {"header": {**machine_header(), "T": result["T"], "H": result["H"], "dtype": "bfloat16",
                      "objective": "fwd+bwd of the summed token log-prob, chain rows",
                      "ms": "minimum over >= 5 interleaved runs",
                      "peak_GiB": "torch.cuda.max_memory_allocated above the inputs (dW, dh included)",
                      "grad_rel_err": "max over dW, dhidden of ||g - g_fp32|| / ||g_fp32||, fp32 reference "
                                      "(TF32 off) on the same bf16 values"},
           "vocab": result["vocab"],
           "rows": [{"provider": r["provider"], "ms": r["ms"], "peak_GiB": r["peak_GiB"],
                     "grad_rel_err": r["grad_rel_err"], "grad_rel_err_dW": r["grad_rel_err_dW"],
                     "grad_rel_err_dhidden": r["grad_rel_err_dhidden"], "ms_median": r["ms_median"],
                     "samples_ms": r.get("samples_ms")}
                    for r in result["rows"] if r["rows"] == "chain" and r["provider"] in keep]}
    (out_dir() / "harts_head_peers.json").write_text(json.dumps(rec, indent=1, default=str))


def target_lines(result) -> list[str]:
    """The issue's head targets against this run's chain rows."""
    by = {r["provider"]: r for r in result["rows"] if r["rows"] == "chain"}
    out = []
    if "harts_default" in by and "liger_flce" in by:
        ours, lig = by["harts_default"], by["liger_flce"]
        out.append(f"target head time <= liger_flce: {ours['ms']:.1f} vs {lig['ms']:.1f} ms "
                   f"({'met' if ours['ms'] <= lig['ms'] else 'NOT met, +%.1f %%' % (100 * (ours['ms'] / lig['ms'] - 1))})")
        out.append(f"target head peak <= liger_flce: {ours['peak_GiB']:.3f} vs {lig['peak_GiB']:.3f} GiB "
                   f"({'met' if ours['peak_GiB'] <= lig['peak_GiB'] else 'NOT met'})")
    if "harts_default" in by and "liger_flce_fp32" in by:
        ours, lig = by["harts_default"], by["liger_flce_fp32"]
        for k in ("grad_rel_err_dW", "grad_rel_err_dhidden"):
            out.append(f"target {k} <= liger_flce_fp32: {ours[k]:.3e} vs {lig[k]:.3e} "
                       f"({'met' if ours[k] <= lig[k] else 'NOT met'})")
    if "harts_default" in by:
        r = by["harts_default"]
        out.append(f"harts_default: {r['roofline_3gemm_fraction']:.3f} of the 3-GEMM bf16 roofline "
                   f"({3 * 2 * r['T'] * r['H'] * r['V'] / PEAK_TFLOPS / 1e9:.1f} ms), "
                   f"{4 / 3 * r['roofline_3gemm_fraction']:.3f} of its own 4-GEMM one; first call {r['first_call_s']:.1f} s")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run (torch path)")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=7, help="interleaved timed runs (at least 5)")
    ap.add_argument("--sweep", action="store_true", help="also time variants of the harts head")
    ap.add_argument("--profile", action="store_true", help="GPU kernel ms of the harts head by kernel")
    ap.add_argument("--fused-head", action="store_true", help="also time the torch path with fused=True (compiles)")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    result = run(args)
    result["extra"]["wall_s"] = time.perf_counter() - t0
    path = write_results("harts_head", result["rows"], {**result["extra"], "table": result["table"]})
    write_record(result)
    plot(result["rows"], out_dir() / "harts_head.png")
    print(f"wrote {path}, harts_head_peers.json and harts_head.png in {result['extra']['wall_s']:.0f} s")
    ex = result["extra"]
    print(f"cuBLAS bf16 [T,H]x[H,V]: {ex['cublas_tflops']:.0f} TFLOP/s")
    for k, v in ex["tuned"].items():
        if isinstance(v, dict):
            print(f"tuned {k}: {v.get('chosen')}; timed: " + ", ".join(
                f"{'tma' if r.get('TMA') else 'ptr'}{'-persist' if r.get('PERSIST') else ''}"
                f"{'-flat' if r.get('FLAT') else ''} {r['BM']}x{r.get('BN', 128)}x{r['BK']} w{r['num_warps']}"
                f"s{r['num_stages']} {r['ms']:.3f}" for r in v.get("timed", [])))
    if "kernel_ms" in ex:
        total = sum(ex["kernel_ms"].values())
        idle = ex["profile"]["idle"]
        print(f"harts_default GPU kernel ms (sum {total:.2f}; profiled wall {ex['profile']['wall_ms']:.2f}, GPU busy "
              f"{idle.get('busy_ms', float('nan')):.2f}, starved {idle.get('starved_ms', float('nan')):.2f} in "
              f"{idle.get('starved_gaps')} gaps, queued {idle.get('queued_ms', float('nan')):.2f} in "
              f"{idle.get('queued_gaps')}; top starved {idle.get('starved_by_op')}): "
              + ", ".join(f"{k} {v:.2f}" for k, v in list(ex["kernel_ms"].items())[:12]))
    if "sweep" in ex:
        print_table(ex["sweep"], ["variant", "T", "vocab_block", "ms_min", "ms_median", "peak_GiB", "err_dW", "err_dh",
                                 "first_call_s"])
    print_table(result["table"], ["rows", "provider", "ms", "ms_median", "peak_GiB", "grad_rel_err_dW",
                                  "grad_rel_err_dhidden", "roofline_3gemm_fraction", "first_call_s"])
    for line in target_lines(result):
        print(line)
    return result


if __name__ == "__main__":
    main()
