"""MOPD loss kernels: speed and peak memory against plain-torch baselines in the same run.

Cases (forward + backward unless noted):
* ``full_vocab/<kind>``: chunked :func:`mopd.full_vocab_divergence` (with and without the
  finiteness checks) vs the same math on the whole ``[N, V]`` tensor with ordinary autograd
  (baseline ``plain``).
* ``topk/<kind>``: chunked :func:`mopd.topk_divergence` (bucket tail) vs plain autograd.
* ``pg/K=<k>``: routed target aggregation (:class:`mopd.TargetAccumulator`, each sample scored by
  one of K teachers) + :func:`mopd.mopd_pg_loss`, vs a dense baseline holding ``[K, B, L]``
  teacher log-probs (``TokenTargets.from_teachers``). Routed work is proportional to the routed
  tokens (here B·L in total) plus a fixed per-teacher overhead; the dense baseline's is K·B·L.

Run: ``python bench/mopd.py`` (H200: ~1 min) or ``python bench/mopd.py --quick`` (CPU smoke).
Writes ``mopd.json`` and ``mopd.png`` into ``$OUT`` (or ``outputs/bench``); prints a table last.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import out_dir, peak_memory, print_table, time_cpu, time_cuda, write_results  # noqa: E402
from mopd.config import DivergenceConfig, MOPDLossConfig  # noqa: E402
from mopd.divergences import full_vocab_divergence, row_divergence, topk_divergence  # noqa: E402
from mopd.objectives import TokenTargets, mopd_pg_loss  # noqa: E402
from mopd.routing import TargetAccumulator  # noqa: E402


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


def _measure(fn, timer):
    t = timer(fn)
    return t, peak_memory(fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small CPU smoke sizes")
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

    for r in rows:
        base = next(x for x in rows if x["case"] == r["case"] and x["provider"] == r["baseline"])
        r["speedup_vs_baseline"] = base["value"] / r["value"]
        r["mem_ratio_vs_baseline"] = (r["peak_mib"] / base["peak_mib"]) if base["peak_mib"] else None
    extra = {"N": N, "V": V, "top_k": K_TOP, "B": B, "L": L, "dtype": str(dtype), "device": dev}
    path = write_results("mopd", rows, extra)
    _plot(rows)
    print(f"wrote {path}")
    print_table(rows, ["case", "provider", "value", "p20", "p80", "peak_mib", "speedup_vs_baseline",
                       "mem_ratio_vs_baseline"])


def _plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, label in ((axes[0], "value", "ms (p50, fwd+bwd)"), (axes[1], "peak_mib", "peak MiB")):
        provs = list(dict.fromkeys(r["provider"] for r in rows))
        width = 0.8 / len(provs)
        for i, p in enumerate(provs):
            xs = [c for c in range(len(cases)) if any(r["case"] == cases[c] and r["provider"] == p for r in rows)]
            ys = [next(r[key] for r in rows if r["case"] == cases[c] and r["provider"] == p) for c in xs]
            ax.bar([x + i * width for x in xs], ys, width, label=p)
        ax.set_xticks(range(len(cases)), cases, rotation=45, ha="right")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir() / "mopd.png", dpi=120)


if __name__ == "__main__":
    main()
