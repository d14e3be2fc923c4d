"""Gated DeltaNet over trees vs THD packing: one GDN layer and a hybrid GPT (GDN + attention).

Sections:

* ``layer``: one ``TreeGatedDeltaNet`` (fwd+bwd of the mixer alone). Providers:
  ``thd_megatron`` (GPU only): Megatron-Core's own ``GatedDeltaNet`` forward on the unpacked
  sequences as one THD batch (FLA ``causal_conv1d`` + varlen ``chunk_gated_delta_rule``);
  ``chain``: our path on a chain forest (every sequence alone, one round; the same code as the
  tree, so the ratio isolates sharing); ``tree``: prefix forest with the default
  ``GdnTreeConfig()`` (aligned, ``schedule="auto"``: the chain schedule when it has fewer rounds);
  ``tree_level`` / ``tree_unaligned``: level schedule with / without chunk alignment (replay);
  ``tree_chainsched``: aligned, chain schedule (one child continues each chain; state-only pieces
  recompute mid-chain fork states). A forced schedule that is the one ``tree`` chose is not run
  again: its row repeats ``tree``'s numbers (``same_as``).
* ``model``: the hybrid GPT (pattern ``GGGA`` twice: Qwen3-Next's 3:1 interleave) fwd+bwd through
  :func:`harts.megatron.tree_forward` with the tree-aware chunked LM head; ``chain`` (THD packing as
  a forest) vs ``tree`` / ``tree_level`` / ``tree_unaligned`` / ``tree_chainsched``, and
  ``tree_eager``: ``tree`` with ``GdnTreeConfig(cuda_graphs=False)`` (every layer's recurrence eager).

Every timed step gets new :class:`harts.gdn_graphs.RoundGraphs`, as a new microbatch would: the
eager first call and the capture of the recurrence in each direction are part of every step (the plan
itself is built once and timed apart).

Workloads: GRPO groups swept over sharing ratio ρ ∈ {0, .25, .5, .75, .9} and a multi-turn
caterpillar. Per row: time (every provider of a case in the same ``--iters`` interleaved rounds,
default 5: minimum, p20/p50/p80 and the samples; the tables report the minimum; until 2026-12-02
each provider was timed alone, one after the other, and p50 was reported), GPU kernel time of one
profiled step (``kernel_ms``: the GPU's busy time; a wall time far above it means the step is bound
by the host), peak memory,
rounds (sequential kernel calls per GDN layer), replayed tokens (alignment), exported tokens
(chain schedule's state-only pieces), C. The tables add ``tree_kern_x``, the tree's speedup in
GPU kernel time, next to the wall-clock ``tree_x``, and (model) ``wall/kern``, their ratio (issue #22
item 5 asks ≥ 0.9).
If FLA refuses the backward (Hopper + Triton 3.6 without tilelang) the run times forward only and
says so in the JSON (``mode``). ``--microbatches M``: each timed step of the model section issues M
microbatches back to back (gradients accumulated, one synchronization at the end, as a training
step's ``forward_backward_func`` runs them) and every time is reported per microbatch; the default 1
times an isolated microbatch.

Run: ``python -m bench.harts_gdn`` on a GPU; ``python -m bench.harts_gdn --quick`` for a CPU smoke
run (tiny sizes, torch recurrence). On a fresh H200 box two attempts of the full run did not
finish within 5.5 min (FLA/TileLang kernel autotuning and compilation come first): split it with
``--sections layer`` / ``--sections model`` and ``--cases``, and bound it with ``--budget-s``; every
row is printed as it is measured and the JSON is rewritten after each case. Writes ``harts_gdn.json`` and
``harts_gdn.png`` into ``bench._common.out_dir()`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench._common import (
    host_profile,
    kernel_profile,
    out_dir,
    peak_memory,
    plot_speedup_vs_c,
    print_table,
    time_cpu,
    time_interleaved,
    write_results,
)

GDN_QUICK = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                 linear_num_value_heads=4)
GDN_FULL = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
                linear_num_value_heads=16)
WIDTHS = {
    # the model of every run until 2026-12-02: hidden 1024, GDN 8 key / 16 value heads, vocab 32,000
    "small": dict(vocab_size=32000, hidden_size=1024, num_attention_heads=16, num_query_groups=4, kv_channels=None,
                  ffn_hidden_size=3072, gdn=GDN_FULL),
    # Qwen3-Next-80B-A3B's widths: hidden 2048, attention 16 heads of 256 with 2 KV groups, GDN 16 key /
    # 32 value heads of 128, vocab 151,936; a dense FFN of 5632, the active width of its MoE layer
    # (10 routed experts of 512 + a shared one of 512)
    "qwen3-next": dict(vocab_size=151936, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
                       kv_channels=256, ffn_hidden_size=5632,
                       gdn=dict(GDN_FULL, linear_num_key_heads=16, linear_num_value_heads=32)),
}


def _setup():
    from mcore_distill import cpu_compat
    from mcore_distill.testing import free_port, init_megatron

    if not torch.cuda.is_available():
        cpu_compat.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1, seed=0)


def _model(quick: bool, dev: str, pattern: str, widths: str = "small"):
    from megatron.core.models.gpt import GPTModel

    from harts.gdn_megatron import hybrid_block_spec
    from harts.megatron import apply_harts
    from mcore_distill.testing import TinyGPTConfig, seed_all, transformer_config

    seed_all(0)
    if quick:
        cfg = TinyGPTConfig(vocab_size=512, num_layers=len(pattern), max_sequence_length=4096, extra=dict(GDN_QUICK))
        dtype = torch.float32
    else:
        w = dict(WIDTHS[widths])
        cfg = TinyGPTConfig(num_layers=len(pattern), max_sequence_length=65536, params_dtype=torch.bfloat16,
                            extra=dict(w.pop("gdn")), **w)
        dtype = torch.bfloat16
    model = GPTModel(config=transformer_config(cfg), transformer_layer_spec=hybrid_block_spec(pattern),
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_sequence_length,
                     position_embedding_type="rope").to(device=dev, dtype=dtype)
    apply_harts(model)
    return model, cfg


def _cases(args, vocab: int):
    """The workloads selected by ``--cases``, stopping (with a note) once ``--budget-s`` is spent."""
    for case, seqs in _workloads(args.quick, vocab):
        if args.cases and case not in args.cases:
            continue
        if time.monotonic() - args.t0 > args.budget_s:
            print(f"[harts_gdn] time budget {args.budget_s:.0f} s spent: skipping {case}", flush=True)
            args.skipped.append(case)
            continue
        yield case, seqs


def _checkpoint(args, rows, bwd):
    """Rows so far to ``harts_gdn.json`` (rewritten after every case, so a killed run keeps its data)."""
    return write_results("harts_gdn", rows, {"quick": args.quick, "widths": args.widths,
                                             "mode": "fwd+bwd" if bwd else "fwd",
                                             "chunk_size": 64, "skipped_cases": args.skipped,
                                             "microbatches": args.microbatches,
                                             "model_attention_backend": args.backend})


def _workloads(quick: bool, vocab: int):
    from harts.workload import caterpillar, grpo_for_sharing

    if quick:
        return [(f"rho={r}", grpo_for_sharing(r, num_groups=1, n=8, seq_len=40, vocab_size=vocab)) for r in (0.0, 0.75)]
    w = [(f"rho={r}", grpo_for_sharing(r, num_groups=1, n=16, seq_len=1024, vocab_size=vocab, seed=1))
         for r in (0.0, 0.25, 0.5, 0.75, 0.9)]
    w.append(("caterpillar", caterpillar(2, turns=8, turn_len=512, branches=2, branch_len=256, vocab_size=vocab)))
    return w


def _probe_backward(dev: str) -> bool:
    """False when FLA refuses the GDN backward (fla #640: Hopper + Triton 3.6 without tilelang)."""
    if dev != "cuda":
        return True
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    x = torch.randn(1, 64, 1, 64, device=dev, requires_grad=True)
    g = torch.full((1, 64, 1), -0.1, device=dev)
    try:
        o, _ = chunk_gated_delta_rule(x, torch.nn.functional.normalize(x, dim=-1), x, g, torch.rand(1, 64, 1, device=dev))
        o.sum().backward()
    except RuntimeError as e:
        print(f"[harts_gdn] backward unavailable, timing forward only: {e}")
        return False
    return True


def _providers(dev):
    p = list(LAYER_PROVIDERS)
    return (["thd_megatron"] + p) if dev == "cuda" else p


def _forest_for(provider, seqs, dev):
    from harts.forest import build_chain_forest, build_forest

    return (build_chain_forest if provider in ("chain", "thd_megatron") else build_forest)(seqs, device=dev)


def _measure(args, section: str, case: str, providers, build, rows: list) -> dict[str, dict]:
    """Build every provider's step (``build(provider) -> (step, info)``; a forced schedule equal to
    the one ``tree`` chose is not built again), time all of them in ``args.iters`` interleaved rounds
    (:func:`bench._common.time_interleaved`), then measure each alone: peak memory, one profiled
    step (GPU kernel time) and the host side. Appends a row per provider; returns them by name."""
    built, tree_schedule = {}, None
    for provider in providers:
        if _same_as_tree(provider, tree_schedule):
            continue
        built[provider] = build(provider)
        plan = built[provider][1]["plan"]
        if provider == "tree":
            tree_schedule = plan.schedule
    # the warm-up call of each (compile / autotune / first allocations) runs before the timed rounds
    times = time_interleaved({p: step for p, (step, _) in built.items()}, rounds=args.iters, warmup=1)
    out = {}
    for provider in providers:
        if provider not in built:
            out[provider] = {**out["tree"], "provider": provider, "same_as": "tree"}
            rows.append(out[provider])
            print(f"[{section}] {case} {provider}: the plan of tree ({tree_schedule} schedule)", flush=True)
            continue
        step, info = built[provider]
        mb = info.get("microbatches", 1)  # times below are per microbatch
        plan, f, tm = info["plan"], info["forest"], _per_microbatch(times[provider], mb)
        mem = peak_memory(step)
        prof = kernel_profile(step)
        kern = prof.get("kernel_ms", float("nan")) / mb
        host = host_profile(step, top=8 if section == "layer" else 12)
        host["issue_ms"] /= mb
        row = {"bench": "harts_gdn", "section": section, "case": case, "provider": provider,
               "mode": info["mode"], "ms_min": tm["min"], "ms_p20": tm["p20"], "ms_p50": tm["p50"],
               "ms_p80": tm["p80"], "ms_samples": tm["samples"], "issue_ms_samples": tm["issue_samples"],
               "kernel_ms": kern, "peak_bytes": mem,
               "rows": f.num_nodes, "total_tokens": f.total_tokens, "plan_ms": info["plan_ms"],
               "compression": f.compression, "rounds": plan.num_rounds if plan else 1,
               "schedule": plan.schedule if plan else None, "replay_tokens": plan.replay_tokens if plan else 0,
               "export_tokens": plan.export_tokens if plan else 0,
               "pieces": plan.num_pieces if plan else f.num_seqs,
               "tokens_per_s": f.total_tokens / (tm["min"] / 1e3), "microbatches": mb, **_host_fields(prof, host),
               "graph_counts": info.get("graph_counts", dict)()}
        out[provider] = row
        rows.append(row)
        print(f"[{section}] {case} {provider}: {tm['min']:.2f} ms min of {tm['n']} interleaved (p50 {tm['p50']:.2f}; "
              f"GPU kernels {kern:.2f} ms, host issue {host['issue_ms']:.2f} ms profiled, "
              f"{min(tm['issue_samples']):.2f} ms min timed, plan {info['plan_ms']:.1f} ms)",
              flush=True)
        if provider == "tree" and section == "model":
            for r in host["top_tottime"][:8]:
                print(f"    host {r[2]:8.2f} ms own {r[3]:8.2f} ms cum  x{r[1]:<5} {r[0]}", flush=True)
            for r in prof.get("cpu_self", [])[:10]:
                print(f"    op   {r[2]:8.2f} ms self {r[3]:8.2f} ms total x{r[1]:<5} {r[0]}", flush=True)
    return out


def bench_layer(args, dev, rows, bwd):
    from megatron.core.packed_seq_params import PackedSeqParams

    from harts.gdn_megatron import make_gdn_tree_params

    model, cfg = _model(args.quick, dev, "G", args.widths)
    mixer = model.decoder.layers[0].self_attention
    table = []
    for case, seqs in _cases(args, cfg.vocab_size):

        def build(provider, seqs=seqs):
            f = _forest_for(provider, seqs, dev)
            gen = torch.Generator(device=dev).manual_seed(0)
            hidden = torch.randn(f.num_nodes, 1, cfg.hidden_size, device=dev, generator=gen).to(cfg.params_dtype)
            hidden.requires_grad_(bwd)
            gdn = _gdn_config(provider)
            plan_ms = 0.0
            if provider == "thd_megatron":
                cu = f.seq_offsets.to(torch.int32)
                mx = int(f.lengths.max())
                psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx,
                                      max_seqlen_kv=mx)
            else:  # built once per microbatch and shared by every GDN layer: timed apart
                # (the attention part is unused here: the cheap varlen plan, not a dense T×T mask)
                plan_ms = time_cpu(lambda: make_gdn_tree_params(f, config=gdn, backend="varlen"),
                                   warmup=0, iters=1)["p50"]
                psp = make_gdn_tree_params(f, config=gdn, backend="varlen")

            def step():
                _fresh_graphs(psp)
                out = mixer(hidden, None, packed_seq_params=psp)[0]
                if bwd:
                    out.float().square().mean().backward()

            return step, {"forest": f, "plan": getattr(psp, "gdn_plan", None), "plan_ms": plan_ms,
                          "mode": "fwd+bwd" if bwd else "fwd"}

        got = _measure(args, "layer", case, _providers(dev), build, rows)
        _checkpoint(args, rows, bwd)
        st = build_forest_stats(seqs, dev)
        ms = {p: r["ms_min"] for p, r in got.items()}
        kms = {p: r["kernel_ms"] for p, r in got.items()}
        table.append({"case": case, "C": st[0], "rounds": st[1], "replay": st[2], "chsched_rounds": st[3],
                      "chsched_export": st[4], "thd_mcore_ms": ms.get("thd_megatron", float("nan")),
                      "schedule": got["tree"]["schedule"], "chain_ms": ms["chain"], "tree_ms": ms["tree"],
                      "level_ms": ms["tree_level"], "unal_ms": ms["tree_unaligned"],
                      "chsched_ms": ms["tree_chainsched"], "tree_x": ms["chain"] / ms["tree"],
                      "tree_vs_mcore": ms.get("thd_megatron", float("nan")) / ms["tree"],
                      "mcore_kern_ms": kms.get("thd_megatron", float("nan")), "chain_kern_ms": kms["chain"],
                      "tree_kern_ms": kms["tree"], "tree_kern_x": kms["chain"] / kms["tree"]})
    return table


def build_forest_stats(seqs, dev):
    from harts.forest import build_forest
    from harts.gdn import build_gdn_plan

    f = build_forest(seqs, device=dev)
    p = build_gdn_plan(f, chunk_size=64, align=True)
    pc = build_gdn_plan(f, chunk_size=64, align=True, schedule="chain")
    return f.compression, p.num_rounds, p.replay_tokens, pc.num_rounds, pc.export_tokens


LAYER_PROVIDERS = ("chain", "tree", "tree_level", "tree_unaligned", "tree_chainsched")
MODEL_PROVIDERS = LAYER_PROVIDERS + ("tree_eager",)
_FORCED = {"tree_level": "level", "tree_unaligned": "level", "tree_chainsched": "chain"}


def _gdn_config(provider):
    from harts.gdn import GdnTreeConfig

    if provider in _FORCED:
        return GdnTreeConfig(align=provider != "tree_unaligned", schedule=_FORCED[provider])
    return GdnTreeConfig(cuda_graphs=provider != "tree_eager")


def _fresh_graphs(params):
    """New CUDA graphs for the step, as every microbatch builds (``params.gdn_graphs`` None: eager)."""
    from harts.gdn_graphs import RoundGraphs

    if getattr(params, "gdn_graphs", None) is not None:
        params.gdn_graphs = RoundGraphs(params.gdn_plan)


def step_loss(out, f):
    """The timed step's loss: mean negative sequence log-prob minus 0.01 × mean sequence entropy."""
    from harts.loss import sequence_entropy, sequence_logprobs

    return -sequence_logprobs(out.logp, f).mean() - 0.01 * sequence_entropy(out.entropy, f).mean()


def _per_microbatch(tm: dict, mb: int) -> dict:
    """:func:`bench._common.time_interleaved`'s entry of a step of ``mb`` microbatches, per microbatch."""
    return {k: (v / mb if isinstance(v, float) else [x / mb for x in v] if isinstance(v, list) else v)
            for k, v in tm.items()}


def _same_as_tree(provider: str, tree_schedule: str | None) -> bool:
    """A forced, aligned schedule equal to the one the default ``tree`` provider chose."""
    return provider in ("tree_level", "tree_chainsched") and _FORCED[provider] == tree_schedule


def bench_model(args, dev, rows, bwd):
    from harts.gdn_megatron import make_gdn_tree_params
    from harts.megatron import tree_forward

    model, cfg = _model(args.quick, dev, "GGGA" * (1 if args.quick else 2), args.widths)
    backend = args.backend or ("varlen" if dev == "cuda" else "dense")
    args.backend = backend
    table = []
    for case, seqs in _cases(args, cfg.vocab_size):

        def build(provider, seqs=seqs):
            f = _forest_for(provider, seqs, dev)
            gdn = _gdn_config(provider)
            # metadata is built once per microbatch on the host: timed apart, as in bench/harts.py
            plan_ms = time_cpu(lambda: make_gdn_tree_params(f, config=gdn, backend=backend),
                               warmup=1, iters=args.iters)["p50"]
            params = make_gdn_tree_params(f, config=gdn, backend=backend)

            def step():  # args.microbatches issued back to back, gradients accumulated, as in training
                model.zero_grad(set_to_none=True)
                for _ in range(args.microbatches):
                    _fresh_graphs(params)
                    with torch.set_grad_enabled(bwd):
                        out = tree_forward(model, f, params=params)
                        loss = step_loss(out, f)
                    if bwd:
                        loss.backward()

            def graph_counts():  # of the last step: eager / captured / replayed recurrence calls
                return params.gdn_graphs.counts if params.gdn_graphs is not None else {}

            return step, {"forest": f, "plan": params.gdn_plan, "plan_ms": plan_ms, "mode": "fwd+bwd" if bwd else "fwd",
                          "graph_counts": graph_counts, "microbatches": args.microbatches}

        got = _measure(args, "model", case, args.providers, build, rows)
        _checkpoint(args, rows, bwd)
        c = build_forest_stats(seqs, dev)[0]
        ms = {p: got[p]["ms_min"] if p in got else float("nan") for p in MODEL_PROVIDERS}
        wall_x, kern_x = ms["chain"] / ms["tree"], got["chain"]["kernel_ms"] / got["tree"]["kernel_ms"]
        table.append({"case": case, "C": c, "schedule": got["tree"]["schedule"], "chain_ms": ms["chain"],
                      "tree_ms": ms["tree"], "level_ms": ms["tree_level"], "unal_ms": ms["tree_unaligned"],
                      "chsched_ms": ms["tree_chainsched"], "eager_ms": ms["tree_eager"],
                      "tree_x": wall_x, "tree_x/C": wall_x / c, "chain_MiB": got["chain"]["peak_bytes"] / 2**20,
                      "tree_MiB": got["tree"]["peak_bytes"] / 2**20, "tree_plan_ms": got["tree"]["plan_ms"],
                      "chain_kern_ms": got["chain"]["kernel_ms"], "tree_kern_ms": got["tree"]["kernel_ms"],
                      "tree_kern_x": kern_x, "wall/kern": wall_x / kern_x,
                      "chain_issue_ms": got["chain"]["issue_ms"], "tree_issue_ms": got["tree"]["issue_ms"]})
    return table


def _host_fields(prof: dict, host: dict) -> dict:
    """The row's host-side columns: issue time, the profiled step's starved gaps and blocking
    CUDA calls (``bench._common.gpu_idle``), and cProfile's top functions by own time."""
    idle = prof.get("idle", {})
    return {"issue_ms": host["issue_ms"], "starved_ms": idle.get("starved_ms", float("nan")),
            "gpu_ops": idle.get("gpu_ops", 0), "starved_by_op": idle.get("starved_by_op", {}),
            "blocking_calls": idle.get("blocking_calls", {}), "cpu_self": prof.get("cpu_self", []),
            "host_top": host["top_tottime"]}


def _plot(layer, model, path):
    """Wall-clock speedup (min of the interleaved rounds) and GPU-kernel speedup of the tree over the
    chain forest against C: the gap between the two is the host's share (issue #22 item 5)."""
    series = []
    for tab, name, m, mk in ((layer, "GDN layer", "o", "^"), (model, "hybrid model", "s", "D")):
        series.append((f"{name}: wall clock", m, [(r["C"], r["tree_x"], r["case"]) for r in tab]))
        series.append((f"{name}: GPU kernel time", mk, [(r["C"], r["tree_kern_x"], "") for r in tab
                                                        if r["tree_kern_x"] == r["tree_kern_x"]]))
    plot_speedup_vs_c(series, path, ylabel="tree speedup vs chain (THD) packing", show_09=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--iters", type=int, default=None,
                    help="interleaved timing rounds per case (default 5; quick 1); tables report the minimum")
    ap.add_argument("--sections", default="layer,model")
    ap.add_argument("--cases", default="", help="comma-separated subset of the workloads (default: all)")
    ap.add_argument("--providers", default=",".join(MODEL_PROVIDERS),
                    help="model section: comma-separated subset of the providers (chain and tree always run)")
    ap.add_argument("--backend", default=None, choices=["varlen", "flex", "dense"],
                    help="attention layers of the hybrid model (default: varlen on CUDA, no compilation; dense on CPU)")
    ap.add_argument("--widths", choices=sorted(WIDTHS), default="small",
                    help="model widths: 'small' (hidden 1024, vocab 32,000: every run until 2026-12-02) or "
                         "'qwen3-next' (Qwen3-Next-80B-A3B's hidden, attention, GDN and vocabulary widths, dense FFN)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="model section: microbatches per timed step, issued back to back with gradients "
                         "accumulated and one device synchronization at the end (as Megatron's "
                         "forward_backward_func runs them); times are reported per microbatch. 1 (default): an "
                         "isolated microbatch, synchronized after it")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="skip the remaining cases once this many seconds have passed (the JSON names them)")
    args = ap.parse_args()
    args.iters = args.iters or (1 if args.quick else 5)
    if args.microbatches < 1:
        ap.error(f"--microbatches must be >= 1, got {args.microbatches}")
    args.cases = [c for c in args.cases.split(",") if c]
    extra = [p for p in args.providers.split(",") if p and p not in ("chain", "tree")]
    bad = sorted(set(extra) - set(MODEL_PROVIDERS))
    if bad:
        ap.error(f"--providers: unknown {bad}; choose from {list(MODEL_PROVIDERS)}")
    args.providers = ["chain", "tree"] + [p for p in MODEL_PROVIDERS if p in extra]
    args.t0, args.skipped = time.monotonic(), []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _setup()
    bwd = _probe_backward(dev)
    rows = []
    layer = bench_layer(args, dev, rows, bwd) if "layer" in args.sections else []
    model = bench_model(args, dev, rows, bwd) if "model" in args.sections else []
    path = _checkpoint(args, rows, bwd)
    _plot(layer, model, out_dir() / "harts_gdn.png")
    print(f"wrote {path}")
    if layer:
        print("\nGDN layer (ms: minimum over the interleaved rounds; chain = our path without sharing; thd_mcore = Megatron GatedDeltaNet THD):")
        print_table(layer, list(layer[0]))
    if model:
        print(f"\nhybrid model GGGA (ms: minimum over the interleaved rounds, fwd+bwd per microbatch, "
              f"{args.microbatches} per synchronized step):")
        print_table(model, list(model[0]))


if __name__ == "__main__":
    main()
