"""The varlen tree attention's key gathers and their backward sum, alone (``harts.varlen``).

The gather plan copies every segment's ancestor keys/values next to its own (``gather_kv``:
grouped heads in the forward, expanded to the query heads in the backward) and sums the
gradients of the copies back (``sum_kv_copies``). These are memory-bound copies; this times them
at the benchmark model's widths (16 query / 8 key heads of 128, bf16, ``k, v`` strided views of a
fused QKV projection as Megatron hands them over) on the plans of ``bench/harts.py``'s GRPO
ρ = 0.75 and caterpillar workloads, against plain torch (``index_select`` + ``repeat_interleave``;
``index_add_`` in fp32 for the sum) and over launch shapes of the Triton gather (rows per program,
warps). Each variant's time is the minimum over ``--rounds`` interleaved rounds of ``--reps``
back-to-back calls; ``GB/s`` counts the bytes written plus the bytes read once.

Run on the GPU: ``python -m bench.harts_kv_gather``; writes ``harts_kv_gather.json`` and
``harts_kv_gather.png`` into ``bench._common.out_dir()``.
"""

from __future__ import annotations

import argparse

import torch

from bench._common import out_dir, print_table, time_interleaved, write_results

HQ, HKV, D = 16, 8, 128


def _plan(case: str):
    from harts.forest import build_forest
    from harts.varlen import build_varlen_plan
    from harts.workload import caterpillar, grpo_for_sharing

    seqs = caterpillar(2, turns=8, turn_len=512, branches=2, branch_len=256) if case == "caterpillar" else \
        grpo_for_sharing(0.75, num_groups=3, n=16, seq_len=1024, seed=1)
    f = build_forest(seqs)
    return f.num_nodes, build_varlen_plan(f.seg_offsets, f.seg_parent, mode="gather", device="cuda")


def _variants(t: int, plan, reps: int):
    from harts.varlen import gather_kv_torch, gather_kv_triton, sum_kv_copies, sum_row_copies_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    rep = HQ // HKV
    mixed = torch.randn(t, HKV, (rep + 2) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = mixed[:, :, rep * D:(rep + 1) * D], mixed[:, :, (rep + 1) * D:]
    idx, n = plan.kv_index, plan.kv_index.numel()
    gk, gv = (torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    el = 2  # bytes per element
    out = {}

    def loop(fn):
        def run():
            for _ in range(reps):
                fn()
        return run

    for heads, op in ((HKV, "gather grouped (forward)"), (HQ, "gather expanded (backward)")):
        moved = 2 * n * heads * D * el + 2 * t * HKV * D * el  # write the copies, read the rows once
        out[(op, "torch")] = (loop(lambda heads=heads: gather_kv_torch(k, v, idx, heads)), moved)
        for rows in (1, 2, 4, 8):
            for warps in (4, 8):
                out[(op, f"triton rows={rows} warps={warps}")] = (
                    loop(lambda heads=heads, rows=rows, warps=warps: gather_kv_triton(
                        k, v, idx, heads, rows_per_program=rows, num_warps=warps)), moved)
    moved = 2 * n * HQ * D * el + 2 * t * HKV * D * el
    out[("sum copies (backward)", "torch fp32 index_add")] = (loop(lambda: (
        sum_row_copies_reference(gk, idx, t, HKV), sum_row_copies_reference(gv, idx, t, HKV))), moved)
    out[("sum copies (backward)", "triton")] = (loop(lambda: sum_kv_copies(gk, gv, plan.copy_ptr, plan.copy_pos, HKV)),
                                                moved)
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(7 * len(cases), 5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rs = [r for r in rows if r["case"] == case]
        labels = [f"{r['op'].split(' (')[0]}: {r['variant']}" for r in rs]
        ax.barh(range(len(rs)), [r["GB_per_s"] for r in rs], color=["tab:grey" if "torch" in r["variant"] else
                                                                     "tab:blue" for r in rs])
        ax.set_yticks(range(len(rs)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (bytes written + read once; min over rounds)")
        ax.set_title(f"{case}: K = {rs[0]['K']:,} gathered rows, T = {rs[0]['T']:,}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20, help="back-to-back calls per timed sample")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.harts_kv_gather needs a CUDA device")
    rows = []
    for case in ("rho=0.75", "caterpillar"):
        t, plan = _plan(case)
        variants = _variants(t, plan, args.reps)
        res = time_interleaved({f"{op} | {name}": fn for (op, name), (fn, _) in variants.items()}, rounds=args.rounds)
        for (op, name), (_, moved) in variants.items():
            s = res[f"{op} | {name}"]
            ms = s["min"] / args.reps
            rows.append({"case": case, "op": op, "variant": name, "T": t, "K": plan.kv_index.numel(), "ms": ms,
                         "ms_p50": s["p50"] / args.reps, "GB_per_s": moved / ms / 1e6})
    path = write_results("harts_kv_gather", rows, {"rounds": args.rounds, "reps": args.reps,
                                                   "widths": {"Hq": HQ, "Hkv": HKV, "D": D}})
    plot(rows, out_dir() / "harts_kv_gather.png")
    print_table(rows, ["case", "op", "variant", "K", "ms", "ms_p50", "GB_per_s"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
