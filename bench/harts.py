"""HARTS tree execution vs THD sequence packing on the same Megatron GPT and token cap, plus the
tree-aware chunked LM head vs full logits.

Sections:

* ``model``: GRPO groups swept over sharing ratio ρ ∈ {0, .05, .1, .25, .5, .75, .9}, GRPO shapes
  (P, R, n) and a multi-turn caterpillar tree, on a Qwen3-1.7B-width GPT (hidden 2048, FFN 6144,
  16 heads of 128, 8 KV groups, vocab 32000, 6 layers, bf16): token-linear work dominates, as in
  the real model. Providers (attention backend in brackets): ``thd`` [flex] and ``thdv`` [varlen]:
  every microbatch plain packing (a chain forest: block-diagonal causal FlexAttention, or
  FlashAttention-2 varlen with one sequence per packed sequence, i.e. standard THD, no gather);
  ``tree`` [flex] and ``treev`` [varlen]: every microbatch a prefix forest, no fallback (``treev``
  with the varlen plan that ``auto`` picks, the key gather; ``treevs`` the same gather keeping the
  gathered keys/values for the backward, ``save_gathered_kv=True``; ``treevl`` forced to the cascade
  ``levels``);
  ``harts`` [``--backend``]: the planner with THD fallback below ``--fallback``.
  Per step (all microbatches, fwd+bwd) the timed region holds only model work: the plan
  (``planner_ms``) and the per-microbatch metadata (forests, BlockMask / varlen plan, LM-head edges:
  ``prep_ms``) are built ahead and timed separately, as a trainer builds them in its data loader.
  Providers are timed interleaved (round robin, median of ``--iters``) so clock and allocator drift
  hits all of them alike. Rows are padded to 128 for FlexAttention providers and to 16 for varlen
  ones. Reported per case: ms per provider, C, packed C (after cap splits, which duplicate a
  prefix, and padding), S_attn, harts speedup vs the best THD, per C and per packed C, peak
  memory, planner and prep ms, and whether harts ran the same plan as ``treev`` or ``thdv``
  (then any gap between them is measurement noise). ``attn_share`` is softmax attention's share
  of the THD step's FLOPs, ``S_flops`` the FLOP ratio THD / harts of the two plans (the speedup
  that perfectly efficient kernels would give, padding and prefix duplication included).
  The calibration line reports the crossover: the smallest C at which the forced tree (best
  backend) is at least as fast as the best THD, interpolated between measured cases.
* ``head``: :mod:`bench.harts_head` (also runnable alone): fwd+bwd of the summed token log-prob at
  T = 16,384, H = 2048, V = 151,936 (Qwen3), bf16: :func:`harts.tree_lm_head` in its default
  configuration against liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (bf16 and fp32
  accumulation) and plain torch (full fp32 logits) on chain rows, and the harts head on tree rows
  (GRPO ρ = 0.75, caterpillar); minimum time over interleaved runs, peak memory, gradient error vs an
  fp32 reference. Writes ``harts_head_peers.json`` and ``harts_head.png`` too.

Run: ``python -m bench.harts`` on a GPU (≈2 min on an H200: providers thdv, treev, treevs, treevl, harts; add
``--providers all`` for the FlexAttention ones and ``--fused-head`` for the head's compiled torch
path, each costing compile time; ``--cases rho=0.75 --profile rho=0.75`` adds GPU kernel time by kind
per provider and chrome traces), ``python -m bench.harts --quick`` for a CPU smoke run (dense
attention backend, tiny sizes). Writes ``harts.json``, ``harts.png`` (and with ``--runs`` > 1 ``harts_xc_min5.json`` and ``harts_xc_min5.png``)
into ``bench._common.out_dir()`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from bench._common import (
    host_profile,
    kernel_profile,
    out_dir,
    peak_memory,
    plot_speedup_vs_c,
    print_table,
    sync,
    time_cpu,
    wall_ms,
    write_results,
)


def _setup():
    from mcore_distill import cpu_compat
    from mcore_distill.testing import free_port, init_megatron

    if not torch.cuda.is_available():
        cpu_compat.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1, seed=0)


def _model(quick: bool, dev: str):
    from harts.megatron import apply_harts
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt

    if quick:
        cfg = TinyGPTConfig(vocab_size=512, hidden_size=128, ffn_hidden_size=384, num_layers=2,
                            num_attention_heads=4, num_query_groups=2, max_sequence_length=4096)
        dtype = torch.float32
    else:  # Qwen3-1.7B widths, 6 of its 28 layers, a 32k vocabulary
        cfg = TinyGPTConfig(vocab_size=32000, hidden_size=2048, num_layers=6, num_attention_heads=16,
                            num_query_groups=8, kv_channels=128, ffn_hidden_size=6144, max_sequence_length=65536,
                            params_dtype=torch.bfloat16)
        dtype = torch.bfloat16
    model = build_tiny_gpt(cfg).to(device=dev, dtype=dtype)
    apply_harts(model)
    return model, cfg


def _workloads(quick: bool, vocab: int):
    from harts.workload import caterpillar, grpo_for_sharing, grpo_groups

    w = []
    if quick:
        for rho in (0.0, 0.1, 0.75):
            w.append((f"rho={rho}", grpo_for_sharing(rho, num_groups=2, n=8, seq_len=64, vocab_size=vocab)))
        return w
    for rho in (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9):
        w.append((f"rho={rho}", grpo_for_sharing(rho, num_groups=3, n=16, seq_len=1024, vocab_size=vocab, seed=1)))
    for p, r, n, groups in ((200, 300, 8, 12), (4000, 500, 8, 2), (4800, 1000, 16, 1), (300, 4000, 16, 1)):
        w.append((f"P{p}-R{r}-n{n}", grpo_groups(groups, prompt_len=p, response_len=r, n=n, vocab_size=vocab, seed=2)))
    w.append(("caterpillar", caterpillar(2, turns=8, turn_len=512, branches=2, branch_len=256, vocab_size=vocab)))
    return w


PROVIDERS = {  # name: (fallback threshold, backend or None for --backend)
    "thd": (math.inf, "flex"), "thdv": (math.inf, "varlen"), "tree": (0.0, "flex"),
    "treev": (0.0, "varlen"), "treevs": (0.0, "varlen"), "treevl": (0.0, "varlen"), "harts": (None, None),
}
TREE_OPTS = {"treevl": {"varlen_mode": "levels"}, "treevs": {"save_gathered_kv": True}}  # make_tree_params


def _prepare(seqs, plan, backend, dev, opts):
    """Per-microbatch metadata built ahead of the step (forest, attention plan, head edges; for a
    shared-prefix group the prefix microbatch's and every part's)."""
    from harts.megatron import make_shared_params, make_tree_params

    out = []
    for mb in plan.microbatches:
        if mb.mode == "shared":
            b = mb.build_shared(seqs, device=dev)
            out.append((b, make_shared_params(b, backend=backend, **{k: v for k, v in opts.items() if k != "varlen_mode"})))
            continue
        f = mb.build(seqs, device=dev)
        out.append((f, make_tree_params(f, backend=backend, **(opts if backend == "varlen" else {}))))
    return out


def _step_fn(model, prepared):
    from harts.forest import Forest
    from harts.loss import sequence_entropy, sequence_logprobs
    from harts.megatron import tree_forward, tree_shared_step

    def loss_of(lp, ent):  # the same per-microbatch objective for every provider
        return -lp.sum() / lp.numel() - 0.01 * ent.mean()

    def step():
        model.zero_grad(set_to_none=True)
        for f, params in prepared:
            if not isinstance(f, Forest):  # a shared-prefix group: prefix once, parts below it
                tree_shared_step(model, f, lambda part, lp, ent: loss_of(lp, ent), params=params)
                continue
            out = tree_forward(model, f, params=params)
            loss_of(sequence_logprobs(out.logp, f), sequence_entropy(out.entropy, f)).backward()

    return step


def _plan_signature(plan):
    return [(mb.mode, tuple(mb.seq_ids), mb.rows) for mb in plan.microbatches]


def _flop_model(cfg):
    """(FLOPs per row, FLOPs per attended pair) of one fwd+bwd step of the benchmark GPT: dense
    layers 6·params per row, the chunked head 8·V·H (forward, recomputation, two backward GEMMs),
    attention 4·Hq·D per pair forward and ×3.5 with the backward."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.kv_channels or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * f
    per_row = cfg.num_layers * 6 * layer + 8 * cfg.vocab_size * h
    per_pair = cfg.num_layers * 4 * q * 3.5
    return per_row, per_pair


def _profile(runs, case, dev):
    """One profiled step per provider: GPU kernel time grouped by kind (ms), and the chrome traces
    (``harts_trace_<case>_<provider>.json.gz``) — where a tree step spends more than its C-scaled share."""
    out, idle = {}, {}
    for provider, r in runs.items():
        if dev != "cuda":
            r["step"]()
            continue
        kp = kernel_profile(r["step"], out_dir() / f"harts_trace_{case.replace('=', '')}_{provider}.json.gz")
        hp = host_profile(r["step"], iters=5, top=10)
        out[provider] = kp["by_kind"]
        idle[provider] = {**kp["idle"], "profiled_wall_ms": kp["wall_ms"], "issue_ms": hp["issue_ms"],
                          "unprofiled_wall_ms": hp["wall_ms"], "cpu_self": kp["cpu_self"], "host_top": hp["top_tottime"]}
    if out:
        print(f"\nGPU kernel ms by kind, one step of {case}:")
        kinds = list(dict.fromkeys(k for v in out.values() for k in v))
        print_table([{"kind": k, **{p: v.get(k, 0.0) for p, v in out.items()}} for k in kinds] +
                    [{"kind": "total", **{p: sum(v.values()) for p, v in out.items()}}], ["kind", *out])
        print("\nGPU idle in the profiled step (starved: the host launched the next op after the GPU went idle; "
              "queued: launch latency between queued ops):")
        print_table([{"provider": p, **{k: v[k] for k in ("issue_ms", "unprofiled_wall_ms", "profiled_wall_ms",
                                                          "span_ms", "busy_ms", "gpu_ops", "starved_ms", "starved_gaps",
                                                          "queued_ms")},
                      "top_starved": ", ".join(f"{n} {t:.2f}" for n, t in list(v["starved_by_op"].items())[:4])}
                     for p, v in idle.items()],
                    ["provider", "issue_ms", "unprofiled_wall_ms", "profiled_wall_ms", "span_ms", "busy_ms", "gpu_ops",
                     "starved_ms", "starved_gaps", "queued_ms", "top_starved"])
    return {"by_kind": out, "idle": idle}


def _plan_flops(plan, fm):
    return sum(fm[0] * mb.rows + fm[1] * mb.attn_pairs for mb in plan.microbatches)


XC_CASES = ("rho=0.5", "rho=0.75", "P4000-R500-n8", "caterpillar", "P4800-R1000-n16")
"""Cases whose x/C is measured in every run (the ≥ 0.90·C targets); ``harts_xc_min5.json`` holds their minima."""


def _measure(model, seqs, providers, args, dev):
    """Plan, prepare and time ``providers`` on one workload, interleaved (round robin in a rotating
    order, ``args.iters`` steps each after one warmup step):
    ``{provider: {step, plan, backend, planner_ms, prep_ms, samples}}``."""
    from harts.config import PlannerConfig
    from harts.planner import plan_step

    runs = {}
    for provider in providers:
        thr, backend = PROVIDERS[provider]
        thr = args.fallback if thr is None else thr
        backend = backend or args.backend
        if dev == "cpu" and backend == "flex":
            backend = "dense"  # no FlexAttention backward on CPU
        # FlexAttention works on 128-row blocks; varlen needs no alignment beyond GEMM-friendly 16 rows
        align = 128 if backend == "flex" and not args.quick else 16
        # the planner keeps a tree larger than the cap whole (shared-prefix group) on the varlen backend
        pc = PlannerConfig(token_cap=args.cap, align=align, fallback_compression=thr,
                           prefix_reuse=provider == "harts" and backend == "varlen" and not args.no_prefix_reuse)
        plan_ms = time_cpu(lambda pc=pc, seqs=seqs: plan_step(seqs, pc), warmup=1, iters=3)["p50"]
        plan = plan_step(seqs, pc)
        t0 = time.perf_counter()
        prepared = _prepare(seqs, plan, backend, dev, TREE_OPTS.get(provider, {}))
        sync()
        prep_ms = (time.perf_counter() - t0) * 1e3
        step = _step_fn(model, prepared)
        step()  # warmup (and FlexAttention compilation for new shapes)
        runs[provider] = {"step": step, "plan": plan, "backend": backend, "planner_ms": plan_ms,
                          "prep_ms": prep_ms, "samples": []}
    order = list(runs.values())
    for it in range(args.iters):  # interleaved: drift hits every provider alike; the order rotates, so no
        for r in order[it % len(order):] + order[:it % len(order)]:  # provider always follows the long THD step
            r["samples"].append(wall_ms(r["step"]))
    return runs


def _x_over_c(runs, compression):
    thd = [statistics.median(runs[p]["samples"]) for p in ("thd", "thdv") if p in runs]
    if not thd or "harts" not in runs:
        return float("nan")
    return min(thd) / statistics.median(runs["harts"]["samples"]) / compression


def bench_model(args, dev, rows, plots):
    from harts.planner import sharing_stats

    model, cfg = _model(args.quick, dev)
    fm = _flop_model(cfg)
    table = []
    work = [(c, w) for c, w in _workloads(args.quick, cfg.vocab_size) if not args.cases or c in args.cases.split(",")]
    xc_runs = []  # run 1 is the full sweep below; runs 2..N repeat the x/C cases (best THD and harts only)
    first = {}
    for case, seqs in work:
        st = sharing_stats(seqs)
        runs = _measure(model, seqs, [p for p in PROVIDERS if p in args.providers], args, dev)
        if case in XC_CASES:
            first[case] = {"C": st.compression, "x_over_C": _x_over_c(runs, st.compression),
                           **{f"{p}_ms": statistics.median(r["samples"]) for p, r in runs.items()}}
        if case in (args.profile or "").split(","):
            prof = _profile(runs, case, dev)
            args.profile_result = (args.profile_result or []) + [{"case": case, "kernel_ms": prof["by_kind"],
                                                                  "idle": prof["idle"]}]
        res = {}
        for provider, r in runs.items():
            r["peak"] = peak_memory(r["step"])
            s = r["plan"].summary()
            med = statistics.median(r["samples"])
            res[provider] = med
            rows.append({"bench": "harts", "section": "model", "case": case, "provider": provider,
                         "backend": r["backend"], "ms_p50": med, "ms_min": min(r["samples"]),
                         "ms_max": max(r["samples"]), "iters": len(r["samples"]),
                         "tokens_per_s": st.total_tokens / (med / 1e3), "peak_bytes": r["peak"],
                         "planner_ms": r["planner_ms"], "prep_ms": r["prep_ms"], "compression": st.compression,
                         "packed_compression": s["packed_compression"], "attention_ratio": st.attention_ratio,
                         "num_microbatches": s["num_microbatches"], "pad_fraction": s["pad_fraction"],
                         "fallback_rate": s["fallback_rate"], "total_tokens": st.total_tokens,
                         "modes": sorted({mb.mode for mb in r["plan"].microbatches})})
        for r in runs.values():
            del r["step"]  # frees the prepared microbatches before the next case
        nan = float("nan")
        for p in PROVIDERS:
            res.setdefault(p, nan)
        thds = [res[p] for p in ("thd", "thdv") if not math.isnan(res[p])]
        base = min(thds) if thds else nan
        trees = [res[p] for p in ("tree", "treev") if not math.isnan(res[p])]
        for r in rows:
            if r["case"] == case and r["section"] == "model":
                r["speedup_vs_best_thd"] = base / res[r["provider"]]
        same = ""
        if "harts" in runs:
            sig = _plan_signature(runs["harts"]["plan"])
            for other in ("treev", "thdv"):
                if other in runs and runs[other]["backend"] == runs["harts"]["backend"] \
                        and _plan_signature(runs[other]["plan"]) == sig:
                    same = other
        hp = runs.get("harts", {})
        plots.append((st.compression, base / min(trees) if trees else nan, base / res["harts"], case))
        table.append({"case": case, "C": st.compression,
                      "C_packed": hp["plan"].summary()["packed_compression"] if hp else nan,
                      "S_attn": st.attention_ratio, "thd": res["thd"], "thdv": res["thdv"], "tree": res["tree"],
                      "treev": res["treev"], "treevs": res["treevs"], "treevl": res["treevl"], "harts": res["harts"],
                      "x_best_thd": base / res["harts"],
                      "x/C": base / res["harts"] / st.compression,
                      "x/C_packed": base / res["harts"] / hp["plan"].summary()["packed_compression"] if hp else nan,
                      "peak_GiB": hp.get("peak", 0) / 2**30 if hp else nan,
                      "peak_thdv_GiB": runs["thdv"]["peak"] / 2**30 if "thdv" in runs else nan,
                      "peak_treevs_GiB": runs["treevs"]["peak"] / 2**30 if "treevs" in runs else nan,
                      "plan_ms": hp.get("planner_ms", nan), "prep_ms": hp.get("prep_ms", nan),
                      "harts_plan": same or ("shared" if hp and any(mb.mode == "shared" for mb in hp["plan"].microbatches)
                                             else "own")})
        thd_plan = runs["thdv"]["plan"] if "thdv" in runs else runs["thd"]["plan"] if "thd" in runs else None
        if thd_plan is not None and hp:
            attn = fm[1] * sum(mb.attn_pairs for mb in thd_plan.microbatches)
            table[-1]["attn_share"] = attn / _plan_flops(thd_plan, fm)  # of the THD step's FLOPs
            table[-1]["S_flops"] = _plan_flops(thd_plan, fm) / _plan_flops(hp["plan"], fm)  # ideal harts speedup
            table[-1]["x/S_flops"] = table[-1]["x_best_thd"] / table[-1]["S_flops"]
    xc_runs.append(first)
    xc_work = [(c, w) for c, w in work if c in XC_CASES]
    xc_providers = [p for p in ("thd", "thdv", "harts") if p in args.providers]
    for r in range(1, args.runs if xc_work and "harts" in xc_providers else 1):
        this = {}
        for case, seqs in xc_work:  # interleaved: every run visits every case once, in turn
            st = sharing_stats(seqs)
            runs = _measure(model, seqs, xc_providers, args, dev)
            this[case] = {"C": st.compression, "x_over_C": _x_over_c(runs, st.compression),
                          **{f"{p}_ms": statistics.median(x["samples"]) for p, x in runs.items()}}
            del runs
        xc_runs.append(this)
        print(f"[harts] x/C run {r + 1}/{args.runs}: " + ", ".join(f"{c} {v['x_over_C']:.3f}" for c, v in this.items()),
              flush=True)
    mins = {c: min(run[c]["x_over_C"] for run in xc_runs if c in run) for c, _ in xc_work}
    for row in table:
        if row["case"] in mins:
            row["x/C_min"] = mins[row["case"]]
            row["runs"] = len(xc_runs)
    args.xc = {"runs": xc_runs, "min_x_over_C": mins}
    return table


def crossover(points):
    """Smallest C at which the forced tree is at least as fast as the best THD, linearly
    interpolated between neighbouring measured cases (``points``: (C, thd_time / tree_time))."""
    pts = sorted((c, r) for c, r in points if not (math.isnan(c) or math.isnan(r)))
    if not pts:
        return None
    if pts[0][1] >= 1.0:
        return pts[0][0]
    for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
        if r0 < 1.0 <= r1:
            return c0 + (1.0 - r0) * (c1 - c0) / (r1 - r0)
    return None


def bench_head(args, dev, rows):
    """The head section: :func:`bench.harts_head.run` (its rows, table and target lines)."""
    from bench import harts_head

    res = harts_head.run(argparse.Namespace(quick=args.quick, rows=16384, vocab=151936, iters=args.iters, sweep=False,
                                            profile=False, fused_head=args.fused_head))
    harts_head.write_record(res)
    harts_head.plot(res["rows"], out_dir() / "harts_head.png")
    rows.extend({"bench": "harts", "section": "head", **r} for r in res["rows"])
    return res["table"], harts_head.target_lines(res)


def _plot(plots, path):
    plot_speedup_vs_c([("forced tree (best backend) vs best THD", "o", [(c, t, n) for c, t, _, n in plots]),
                       ("harts (planner) vs best THD", "x", [(c, h, n) for c, _, h, n in plots])],
                      path, ylabel="fwd+bwd step speedup")


def plot_xc_runs(xc: dict, path) -> None:
    """x/C of every run per case (dots), the minimum over the runs (bar) and the 0.90 target line,
    from ``harts_xc_min5.json``'s ``runs`` and ``min_x_over_C``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(xc["min_x_over_C"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, case in enumerate(cases):
        vals = [run[case]["x_over_C"] for run in xc["runs"] if case in run]
        ax.bar(i, xc["min_x_over_C"][case], color="tab:green" if xc["min_x_over_C"][case] >= 0.9 else "tab:red",
               alpha=0.35, width=0.6)
        ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
        ax.annotate(f"min {xc['min_x_over_C'][case]:.3f}", (i + 0.31, xc["min_x_over_C"][case]), ha="left",
                    va="center", fontsize=7)
    ax.axhline(0.9, color="black", linestyle=":", linewidth=1, label="target 0.90")
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    lo = min(min(run[c]["x_over_C"] for run in xc["runs"] if c in run) for c in cases)
    ax.set_ylim(min(0.7, lo - 0.02), 1.0)
    ax.set_ylabel("x / C")
    ax.set_title(f"harts x/C: {len(xc['runs'])} interleaved runs (dots), minimum (bar)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    from harts.config import PlannerConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--cap", type=int, default=None, help="token cap per microbatch (default 16384; quick 512)")
    ap.add_argument("--fallback", type=float, default=PlannerConfig().fallback_compression,
                    help="planner THD fallback threshold on C (default: PlannerConfig's)")
    ap.add_argument("--backend", default="varlen", choices=["varlen", "flex"], help="attention backend of 'harts'")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--sections", default="model,head")
    ap.add_argument("--providers", default="thdv,treev,treevs,treevl,harts",
                    help=f"subset of {','.join(PROVIDERS)}, or 'all' (the FlexAttention providers thd/tree add "
                         "about a minute of compilation)")
    ap.add_argument("--fused-head", action="store_true", help="also time tree_lm_head(fused=True) (compiles)")
    ap.add_argument("--profile", default=None, metavar="CASES",
                    help="also profile one step of every provider on these comma-separated cases (e.g. "
                         "rho=0.75,caterpillar): kernel ms by kind and GPU idle in the table and JSON, chrome traces "
                         "harts_trace_<case>_<provider>.json.gz")
    ap.add_argument("--cases", default="", help="comma-separated subset of the model workloads (default: all)")
    ap.add_argument("--runs", type=int, default=None,
                    help=f"runs of the x/C cases ({', '.join(XC_CASES)}): run 1 is the full sweep, runs 2..N repeat "
                         "those cases for the best THD and harts, interleaved; the minimum x/C over all runs is "
                         "reported and written to harts_xc_min5.json (default 5; quick 1)")
    ap.add_argument("--no-prefix-reuse", action="store_true",
                    help="plan harts without shared-prefix groups (trees larger than the cap are cut, as before)")
    args = ap.parse_args()
    args.cap = args.cap or (512 if args.quick else 16384)
    args.providers = list(PROVIDERS) if args.providers == "all" else args.providers.split(",")
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        ap.error(f"unknown providers {sorted(unknown)}; choose from {list(PROVIDERS)}")
    args.iters = args.iters or (1 if args.quick else 5)
    args.runs = args.runs or (1 if args.quick else 5)
    args.profile_result = None
    args.xc = None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    _setup()
    t_start = time.perf_counter()
    rows, plots = [], []
    model_table = bench_model(args, dev, rows, plots) if "model" in args.sections else []
    head_table, head_targets = bench_head(args, dev, rows) if "head" in args.sections else ([], [])
    cross = crossover([(c, r) for c, r, _, _ in plots])
    extra = {"cap": args.cap, "fallback": args.fallback, "quick": args.quick, "crossover_compression": cross,
             "wall_s": time.perf_counter() - t_start, "model_table": model_table, "head_table": head_table,
             "xc": args.xc,
             "profile": args.profile_result}
    path = write_results("harts", rows, extra)
    if args.xc and args.xc["min_x_over_C"]:
        extra["xc_min_path"] = str(write_xc_min(args.xc, args))
        plot_xc_runs(args.xc, out_dir() / "harts_xc_min5.png")
    if plots:
        _plot(plots, out_dir() / "harts.png")
    print(f"wrote {path} in {extra['wall_s']:.0f} s; fallback_compression used {args.fallback}; crossover "
          f"(smallest C with forced tree >= best THD, interpolated): {cross}")
    if model_table:
        print_table(model_table, ["case", "C", "C_packed", "S_attn", "thd", "thdv", "tree", "treev", "treevs", "treevl",
                                  "harts", "x_best_thd", "x/C", "x/C_min", "runs", "x/C_packed", "attn_share",
                                  "S_flops", "x/S_flops",
                                  "peak_GiB", "peak_thdv_GiB", "peak_treevs_GiB", "plan_ms", "prep_ms", "harts_plan"])
    if head_table:
        print_table(head_table, ["rows", "provider", "ms", "ms_median", "peak_GiB", "grad_rel_err_dW",
                                 "grad_rel_err_dhidden", "roofline_3gemm_fraction", "first_call_s"])
    for line in _target_lines(model_table) + head_targets:
        print(line)


def write_xc_min(xc: dict, args) -> object:
    """``harts_xc_min5.json``: ``header``, ``runs`` (per run, per case: C, x/C and the step ms of
    the best THD provider and harts) and ``min_x_over_C`` per case."""
    import json

    from bench._common import machine_header

    path = out_dir() / "harts_xc_min5.json"
    path.write_text(json.dumps({"header": {**machine_header(), "cap": args.cap, "iters_per_run": args.iters,
                                           "prefix_reuse": not args.no_prefix_reuse, "backend": args.backend},
                                "runs": xc["runs"], "min_x_over_C": xc["min_x_over_C"]}, indent=1))
    return path


def _target_lines(model_table):
    """The issue's x/C targets, checked against this run's numbers (x/C: the minimum over the runs;
    the head's targets: bench.harts_head)."""
    out = []
    for r in model_table:
        c, x = r["C"], r["x_best_thd"]
        if 2.0 <= c <= 6.0:
            xc = r.get("x/C_min", x / c)
            out.append(f"target x >= 0.90 C  {r['case']}: min x/C over {r.get('runs', 1)} runs = {xc:.3f} (run 1: "
                       f"{x / c:.3f}, x/C_packed {r['x/C_packed']:.3f}) {'met' if xc >= 0.9 else 'NOT met'}")
        elif c < 1.05:
            out.append(f"target C~1 within 3 %  {r['case']}: harts/best THD time = {1 / x:.3f} "
                       f"{'met' if 1 / x <= 1.03 else 'NOT met'}")
    return out


if __name__ == "__main__":
    main()
