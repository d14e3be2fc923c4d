"""MOPD loss kernels: speed and peak memory against plain-torch baselines in the same run.

Cases (forward + backward unless noted):
* ``full_vocab/<kind>``: chunked :func:`mopd.full_vocab_divergence` (with and without the
  finiteness checks) vs the same math on the whole ``[N, V]`` tensor with ordinary autograd
  (baseline ``plain``).
* ``topk/<kind>``: chunked :func:`mopd.topk_divergence` (bucket tail) vs plain autograd.
* ``pg/K=<k>``: routed target aggregation (:class:`mopd.routing.TargetAccumulator`, each sample scored by
  one of K teachers) + :func:`mopd.mopd_pg_loss`, vs a dense baseline holding ``[K, B, L]``
  teacher log-probs (``TokenTargets.from_teachers``). Routed work is proportional to the routed
  tokens (here B·L in total) plus a fixed per-teacher overhead; the dense baseline's is K·B·L.
* ``teacher/grpo_<P>+<R>x<n>`` (forward only): a frozen Megatron teacher (:class:`mopd.megatron.MegatronTeacher`)
  scoring GRPO groups (prompt P, responses up to R, n per prompt) as harts tree batches
  (``teacher_tree.enabled``; flex attention, chunked head) vs plain padded ``[B, L]``
  micro-batches (baseline ``plain``). ``--no-teacher`` skips it.

Run: ``python -m bench.mopd`` (H200: ~1 min) or ``python -m bench.mopd --quick`` (CPU smoke).
Writes ``mopd.json`` and ``mopd.png`` into ``$OUT`` (or ``outputs/bench``); prints a table last.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench._common import out_dir, peak_memory, print_table, time_cpu, time_cuda, write_results
from mopd.config import DivergenceConfig, MOPDLossConfig
from mopd.divergences import full_vocab_divergence, row_divergence, topk_divergence
from mopd.objectives import TokenTargets, mopd_pg_loss
from mopd.routing import TargetAccumulator


def _plain_full(z, t, cfg):
    s = torch.log_softmax(z.float() / cfg.temperature, -1)
    return row_divergence(s, torch.log_softmax(t.float(), -1), kind=cfg.kind, beta=cfg.beta).sum()


def _plain_topk(z, ids, t, cfg):
    s_full = torch.log_softmax(z.float() / cfg.temperature, -1)
    s = s_full.gather(-1, ids)
    in_k = torch.zeros_like(s_full, dtype=torch.bool).scatter_(-1, ids, True)
    s_tail = s_full.masked_fill(in_k, -math.inf).logsumexp(-1, keepdim=True)
    t_tail = torch.log((1 - t.float().exp().sum(-1, keepdim=True)).clamp(min=0))
    return row_divergence(torch.cat([s, s_tail], -1), torch.cat([t.float(), t_tail], -1), kind=cfg.kind,
                          beta=cfg.beta).sum()


def _divergence_cases(add, dev, timer, g, N, V, K_TOP, dtype, *, chunk_rows):
    z = (torch.randn(N, V, device=dev, generator=g) * 2).to(dtype).requires_grad_(True)
    t_full = torch.log_softmax(torch.randn(N, V, device=dev, generator=g) * 2, -1).to(dtype)
    t_vals, ids = t_full.float().topk(K_TOP, -1)

    def run(fn, *a):
        z.grad = None
        fn(*a).backward()

    for kind in ("reverse_kl", "jsd"):
        cfg = DivergenceConfig(kind=kind, beta=0.5, chunk_rows=chunk_rows)
        nocheck = DivergenceConfig(kind=kind, beta=0.5, chunk_rows=chunk_rows, check_finite=False)
        full = {
            "chunked": lambda c=cfg: run(lambda: full_vocab_divergence(z, t_full, config=c)[0]),
            "chunked_nocheck": lambda c=nocheck: run(lambda: full_vocab_divergence(z, t_full, config=c)[0]),
            "plain": lambda c=cfg: run(lambda: _plain_full(z, t_full, c)),
        }
        for prov, fn in full.items():
            add(f"full_vocab/{kind}", prov, *_measure(fn, timer), "plain")
        topk = {
            "chunked": lambda c=cfg: run(lambda: topk_divergence(z, ids, t_vals, config=c)[0]),
            "plain": lambda c=cfg: run(lambda: _plain_topk(z, ids, t_vals, c)),
        }
        for prov, fn in topk.items():
            add(f"topk{K_TOP}/{kind}", prov, *_measure(fn, timer), "plain")


def _pg_cases(add, dev, timer, g, B, L):
    lp = (-3 * torch.rand(B, L, device=dev, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(B, L, device=dev, generator=g)
    valid = torch.ones(B, L, dtype=torch.bool, device=dev)
    cfg = MOPDLossConfig()

    def routed(K, idx, teacher_lp):
        lp.grad = None
        acc = TargetAccumulator(valid, old_logp=None)
        for j in range(K):
            acc.add(f"t{j}", idx[j], torch.ones(len(idx[j]), device=dev), teacher_lp[j, idx[j]])
        mopd_pg_loss(lp, old, acc.targets(), valid, config=cfg).loss.backward()

    def dense(teacher_lp, w_dense):
        lp.grad = None
        mopd_pg_loss(lp, old, TokenTargets.from_teachers(teacher_lp, w_dense), valid, config=cfg).loss.backward()

    for K in (1, 2, 4, 8):
        teacher_lp = -3 * torch.rand(K, B, L, device=dev, generator=g)
        owner = torch.arange(B, device=dev) % K
        idx = [(owner == j).nonzero()[:, 0] for j in range(K)]
        w_dense = torch.stack([(owner == j).float()[:, None].expand(B, L) for j in range(K)])
        add(f"pg/K={K}", "routed", *_measure(lambda a=(K, idx, teacher_lp): routed(*a), timer), "dense")
        add(f"pg/K={K}", "dense", *_measure(lambda a=(teacher_lp, w_dense): dense(*a), timer), "dense")


def _teacher_cases(add, cuda, timer):
    """Plain vs harts tree scoring of one Megatron teacher (bf16 on CUDA, fp32 on CPU)."""
    import os
    import tempfile

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron, seed_all
    from mopd.backends import TokenBatch
    from mopd.config import TeacherTreeConfig
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    if not cuda:
        from mcore_distill import cpu_compat

        cpu_compat.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    if cuda:
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1)
    if cuda:
        cfg = TinyGPTConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_attention_heads=16,
                            num_query_groups=4, ffn_hidden_size=3072, max_sequence_length=4096,
                            params_dtype=torch.bfloat16)
        P, R, G, n, mbs = 1024, 512, 4, 8, 4
    else:
        cfg = TinyGPTConfig(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, max_sequence_length=256)
        P, R, G, n, mbs = 48, 16, 2, 4, 4
    backend = "flex" if cuda else "dense"

    def build(seed):
        from megatron.core.transformer.module import Float16Module

        seed_all(seed)
        m = build_tiny_gpt(cfg)
        if cuda:
            m = Float16Module(m.config, m.cuda())
        return m

    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(G * n, P + R, dtype=torch.long)
    lengths = torch.zeros(G * n, dtype=torch.long)
    for i in range(G):
        prompt = torch.randint(0, cfg.vocab_size, (P,), generator=g)
        for j in range(n):
            r = int(torch.randint(R // 2, R + 1, (1,), generator=g))
            ids[i * n + j, :P], lengths[i * n + j] = prompt, P + r
            ids[i * n + j, P:P + r] = torch.randint(0, cfg.vocab_size, (r,), generator=g)
    dev = "cuda" if cuda else "cpu"
    batch = TokenBatch(ids.to(dev), lengths.to(dev), torch.full((G * n,), P - 1, device=dev))
    tree = TeacherTreeConfig(enabled=True, backend=backend, chunk_size=1024, token_cap=16384, align=128,
                             fallback_compression=1.0)
    with tempfile.TemporaryDirectory() as d:
        save_teacher_checkpoint(build(1), d)
        host = MegatronTeacherHost(build(2), micro_batch_size=mbs)
        teachers = {"plain": MegatronTeacher("plain", host, d), "tree": MegatronTeacher("tree", host, d, tree=tree)}
        case = f"teacher/grpo_{P}+{R}x{n}"
        results = {}
        for name, t in teachers.items():
            t.load()
            results[name] = t.score(batch).float()
            add(case, name, *_measure(lambda t=t: t.score(batch), timer), "plain")
        mask = batch.label_mask()
        err = float((results["plain"] - results["tree"]).abs()[mask].max())
        stats = dict(teachers["tree"].last_tree_stats)
    torch.distributed.destroy_process_group()
    return {"teacher_case": case, "teacher_tree_stats": stats, "teacher_max_abs_diff_tree_vs_plain": err,
            "teacher_dtype": str(cfg.params_dtype), "teacher_backend": backend}


def _measure(fn, timer):
    t = timer(fn)
    return t, peak_memory(fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small CPU smoke sizes")
    ap.add_argument("--no-teacher", action="store_true", help="skip the Megatron teacher scoring case")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = "cuda" if cuda else "cpu"
    timer = time_cuda if cuda else time_cpu
    N, V, K_TOP = (4096, 151936, 64) if cuda else (256, 4096, 16)
    B, L = (256, 4096) if cuda else (16, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []

    def add(case, provider, t, mem, baseline):
        rows.append({"bench": "mopd", "case": case, "provider": provider, "metric": "ms_p50", "value": t["p50"],
                     "p20": t["p20"], "p80": t["p80"], "peak_mib": mem / 2**20, "baseline": baseline})

    _divergence_cases(add, dev, timer, g, N, V, K_TOP, dtype, chunk_rows=1024 if cuda else 64)
    _pg_cases(add, dev, timer, g, B, L)
    teacher_extra = {} if args.no_teacher else _teacher_cases(add, cuda, timer)

    for r in rows:
        base = next(x for x in rows if x["case"] == r["case"] and x["provider"] == r["baseline"])
        r["speedup_vs_baseline"] = base["value"] / r["value"]
        r["mem_ratio_vs_baseline"] = (r["peak_mib"] / base["peak_mib"]) if base["peak_mib"] else None
    extra = {"N": N, "V": V, "top_k": K_TOP, "B": B, "L": L, "dtype": str(dtype), "device": dev, **teacher_extra}
    path = write_results("mopd", rows, extra)
    _plot(rows)
    print(f"wrote {path}")
    if teacher_extra:
        st = teacher_extra["teacher_tree_stats"]
        print(f"teacher tree scoring: C={st['compression']:.2f}, max |Δlogp| tree vs plain "
              f"{teacher_extra['teacher_max_abs_diff_tree_vs_plain']:.2e} ({teacher_extra['teacher_dtype']})")
    print_table(rows, ["case", "provider", "value", "p20", "p80", "peak_mib", "speedup_vs_baseline",
                       "mem_ratio_vs_baseline"])


def _plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(provs)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, label in ((axes[0], "value", "ms, p50 (teacher row: forward only)"), (axes[1], "peak_mib", "peak MiB")):
        seen = set()
        for c, case in enumerate(cases):  # the providers of each case, centred on its tick
            here = [r for r in rows if r["case"] == case]
            width = 0.8 / len(here)
            for i, r in enumerate(here):
                p = r["provider"]
                ax.bar(c - 0.4 + (i + 0.5) * width, r[key], width, color=colors[p], label=None if p in seen else p)
                seen.add(p)
        ax.set_xticks(range(len(cases)), cases, rotation=45, ha="right")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(provs), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out_dir() / "mopd.png", dpi=120)


if __name__ == "__main__":
    main()
