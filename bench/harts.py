"""HARTS tree execution vs THD sequence packing on the same Megatron GPT and token cap, plus the
tree-aware chunked LM head vs full logits.

Sections:

* ``model``: GRPO groups swept over sharing ratio ρ ∈ {0, .25, .5, .75, .9}, GRPO shapes (P, R, n)
  and a multi-turn caterpillar tree. Providers (attention backend in brackets):
  ``thd`` [flex] and ``thd_varlen`` [varlen]: every microbatch plain packing (a chain forest:
  block-diagonal causal FlexAttention, or FlashAttention-2 varlen with one sequence per packed
  sequence, i.e. standard THD); ``tree`` [flex] and ``tree_varlen`` [varlen]: every microbatch a
  prefix forest, no fallback; ``harts`` [``--backend``]: planner with THD fallback below
  ``--fallback``. Per step (all microbatches, fwd+bwd, BlockMask / gather plan included): wall
  time, original tokens/s, peak memory, planner time; speedups against compression C.
* ``head``: fwd+bwd of per-row log-probs + entropy at vocabulary V: full fp32 logits vs
  :func:`harts.tree_lm_head` with chunks of 1024 and 4096 rows; time and peak extra memory.

Run: ``python bench/harts.py`` on a GPU (≈2 min on an H200), ``python bench/harts.py --quick`` for
a CPU smoke run (dense attention backend, tiny sizes). Writes ``harts.json`` and ``harts.png``
into ``bench._common.out_dir()`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import out_dir, peak_memory, print_table, time_cpu, write_results  # noqa: E402


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
        cfg = TinyGPTConfig(vocab_size=512, max_sequence_length=4096)
        dtype = torch.float32
    else:
        cfg = TinyGPTConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_attention_heads=16,
                            num_query_groups=4, ffn_hidden_size=3072, max_sequence_length=65536,
                            params_dtype=torch.bfloat16)
        dtype = torch.bfloat16
    model = build_tiny_gpt(cfg).to(device=dev, dtype=dtype)
    apply_harts(model)
    return model, cfg


def _workloads(quick: bool, vocab: int):
    from harts.workload import caterpillar, grpo_for_sharing, grpo_groups

    w = []
    if quick:
        for rho in (0.0, 0.75):
            w.append((f"rho={rho}", grpo_for_sharing(rho, num_groups=1, n=8, seq_len=32, vocab_size=vocab)))
        return w
    for rho in (0.0, 0.25, 0.5, 0.75, 0.9):
        w.append((f"rho={rho}", grpo_for_sharing(rho, num_groups=3, n=16, seq_len=1024, vocab_size=vocab, seed=1)))
    for p, r, n, groups in ((200, 300, 8, 12), (4000, 500, 8, 2), (4800, 1000, 16, 1), (300, 4000, 16, 1)):
        w.append((f"P{p}-R{r}-n{n}", grpo_groups(groups, prompt_len=p, response_len=r, n=n, vocab_size=vocab, seed=2)))
    w.append(("caterpillar", caterpillar(2, turns=8, turn_len=512, branches=2, branch_len=256, vocab_size=vocab)))
    return w


PROVIDERS = {  # name: (fallback threshold, backend or None for --backend)
    "thd": (math.inf, "flex"), "thd_varlen": (math.inf, "varlen"), "tree": (0.0, "flex"),
    "tree_varlen": (0.0, "varlen"), "harts": (None, None),
}


def _step_fn(model, seqs, plan, backend, dev):
    from harts.loss import sequence_entropy, sequence_logprobs
    from harts.megatron import make_tree_params, tree_forward

    forests = [mb.build(seqs, device=dev) for mb in plan.microbatches]

    def step():
        model.zero_grad(set_to_none=True)
        for f in forests:
            params = make_tree_params(f, backend=backend)  # BlockMask once per microbatch
            out = tree_forward(model, f, params=params)
            lp = sequence_logprobs(out.logp, f)
            loss = -lp.sum() / lp.numel() - 0.01 * sequence_entropy(out.entropy, f).mean()
            loss.backward()

    return step


def bench_model(args, dev, rows, plots):
    from harts.config import PlannerConfig
    from harts.planner import plan_step, sharing_stats

    model, cfg = _model(args.quick, dev)
    align = 16 if args.quick else 128
    cap = args.cap
    table = []
    for case, seqs in _workloads(args.quick, cfg.vocab_size):
        st = sharing_stats(seqs)
        res = {}
        for provider, (thr, backend) in PROVIDERS.items():
            if provider not in args.providers:
                continue
            thr = args.fallback if thr is None else thr
            backend = backend or args.backend
            if dev == "cpu" and backend == "flex":
                backend = "dense"  # no FlexAttention backward on CPU
            pc = PlannerConfig(token_cap=cap, align=align, fallback_compression=thr)
            plan_t = time_cpu(lambda pc=pc, seqs=seqs: plan_step(seqs, pc), warmup=0, iters=1)["p50"]
            plan = plan_step(seqs, pc)
            step = _step_fn(model, seqs, plan, backend, dev)
            t = time_cpu(step, warmup=1, iters=args.iters)
            mem = peak_memory(step)
            s = plan.summary()
            res[provider] = t["p50"]
            rows.append({"bench": "harts", "section": "model", "case": case, "provider": provider, "backend": backend,
                         "ms_p20": t["p20"],
                         "ms_p50": t["p50"], "ms_p80": t["p80"], "tokens_per_s": st.total_tokens / (t["p50"] / 1e3),
                         "peak_bytes": mem, "planner_ms": plan_t, "compression": st.compression,
                         "packed_compression": s["packed_compression"], "attention_ratio": st.attention_ratio,
                         "num_microbatches": s["num_microbatches"], "pad_fraction": s["pad_fraction"],
                         "fallback_rate": s["fallback_rate"], "total_tokens": st.total_tokens})
        nan = float("nan")
        for p in PROVIDERS:
            res.setdefault(p, nan)
        base = min(res["thd"], res["thd_varlen"])  # the faster THD baseline (nan-aware below)
        if math.isnan(base):
            base = res["thd"] if not math.isnan(res["thd"]) else res["thd_varlen"]
        for r in rows:
            if r["case"] == case and r["section"] == "model":
                r["speedup_vs_best_thd"] = base / res[r["provider"]]
        plots.append((st.compression, res["thd"] / res["tree"], res["thd_varlen"] / res["tree_varlen"],
                      base / res["harts"], case))
        table.append({"case": case, "C": st.compression, "S_attn": st.attention_ratio, "thd_ms": res["thd"],
                      "thdv_ms": res["thd_varlen"], "tree_ms": res["tree"], "treev_ms": res["tree_varlen"],
                      "harts_ms": res["harts"], "tree_x": res["thd"] / res["tree"],
                      "treev_x": res["thd_varlen"] / res["tree_varlen"], "harts_x": base / res["harts"],
                      "harts_x/C": base / res["harts"] / st.compression})
    return table


def bench_head(args, dev, rows):
    from harts.lm_head import tree_lm_head

    t, h, v = (128, 32, 1000) if args.quick else (8192, 1024, 151936)
    dtype = torch.float32 if args.quick else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(t, h, device=dev, generator=g).to(dtype).requires_grad_(True)
    w = (0.02 * torch.randn(v, h, device=dev, generator=g)).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, v, (t,), device=dev, generator=g)
    parent = torch.arange(-1, t - 1, device=dev)  # one packed sequence

    def full():
        z = hid.float() @ w.float().T
        lp = torch.log_softmax(z, -1)
        logp = lp[1:].gather(-1, tokens[1:, None]).squeeze(-1)  # row v-1 predicts token v
        ent = -(lp.exp() * lp).sum(-1)
        (logp.sum() + ent.sum()).backward()

    def chunked(c):
        def fn():
            logp, ent = tree_lm_head(hid, w, tokens, parent, chunk_size=c, entropy_requires_grad=True)
            (logp.sum() + ent.sum()).backward()
        return fn

    table = []
    base = None
    for name, fn, chunk in (("full", full, None), ("chunk1024", chunked(1024), 1024), ("chunk4096", chunked(4096), 4096)):
        tm = time_cpu(fn, warmup=1, iters=args.iters)
        hid.grad = w.grad = None
        mem = peak_memory(fn)
        hid.grad = w.grad = None
        base = base or (tm["p50"], max(mem, 1))
        chunk_bytes = (chunk or t) * v * 4
        rows.append({"bench": "harts", "section": "head", "case": f"T{t}-H{h}-V{v}", "provider": name,
                     "ms_p20": tm["p20"], "ms_p50": tm["p50"], "ms_p80": tm["p80"], "peak_bytes": mem,
                     "chunk_logits_bytes": chunk_bytes})
        table.append({"provider": name, "ms": tm["p50"], "speed_vs_full": base[0] / tm["p50"],
                      "peak_MiB": mem / 2**20, "peak/chunk_logits": mem / chunk_bytes})
    return table


def _plot(plots, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    cs = [p[0] for p in plots]
    ax.scatter(cs, [p[1] for p in plots], label="tree vs thd (flex)", marker="o")
    ax.scatter(cs, [p[2] for p in plots], label="tree vs thd (varlen)", marker="s")
    ax.scatter(cs, [p[3] for p in plots], label="harts vs best thd", marker="x")
    for c, _, _, s, name in plots:
        ax.annotate(name, (c, s), fontsize=7)
    lim = max(cs + [2.0]) * 1.05
    ax.plot([1, lim], [1, lim], "k--", lw=0.8, label="speedup = C")
    ax.plot([1, lim], [0.9, 0.9 * lim], "k:", lw=0.8, label="0.9 C")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("compression C = ΣL / T")
    ax.set_ylabel("fwd+bwd step speedup")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--cap", type=int, default=None, help="token cap per microbatch (default 16384; quick 512)")
    ap.add_argument("--fallback", type=float, default=1.15, help="planner THD fallback threshold on C")
    ap.add_argument("--backend", default="varlen", choices=["varlen", "flex"], help="attention backend of 'harts'")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--sections", default="model,head")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}")
    args = ap.parse_args()
    args.cap = args.cap or (512 if args.quick else 16384)
    args.providers = args.providers.split(",")
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        ap.error(f"unknown providers {sorted(unknown)}; choose from {list(PROVIDERS)}")
    args.iters = args.iters or (1 if args.quick else 2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    _setup()
    rows, plots = [], []
    model_table = bench_model(args, dev, rows, plots) if "model" in args.sections else []
    head_table = bench_head(args, dev, rows) if "head" in args.sections else []
    # calibrated fallback: smallest measured C at which the forced tree beats THD
    wins = sorted(c for c, s_flex, s_varlen, _, _ in plots if max(s_flex, s_varlen) >= 1.0)  # nan compares False
    extra = {"cap": args.cap, "fallback": args.fallback, "quick": args.quick,
             "suggested_fallback_compression": wins[0] if wins else None}
    path = write_results("harts", rows, extra)
    if plots:
        _plot(plots, out_dir() / "harts.png")
    print(f"wrote {path}; suggested fallback_compression (smallest C with tree >= THD): "
          f"{extra['suggested_fallback_compression']}")
    if model_table:
        print_table(model_table, ["case", "C", "S_attn", "thd_ms", "thdv_ms", "tree_ms", "treev_ms", "harts_ms",
                                  "tree_x", "treev_x", "harts_x", "harts_x/C"])
    if head_table:
        print_table(head_table, ["provider", "ms", "speed_vs_full", "peak_MiB", "peak/chunk_logits"])


if __name__ == "__main__":
    main()
