"""Fused vs foreach AdamW on one staged unit, by slice count: where ``impl='auto'`` switches.

A unit is ``numel`` elements of the four fp32 state/gradient buffers (master, grad, exp_avg,
exp_avg_sq), split into ``k`` equal slices (the parameter pieces of one unit, views into the slot
buffers as in :class:`optim_staged.StagedAdamW`). For each k the one-unit update
(:func:`optim_staged.update.adamw_update_`) is timed with ``impl='fused'`` (``torch._fused_adamw_``)
and ``impl='foreach'`` (the ``torch.optim.AdamW(foreach=True)`` op sequence). Rounds are
interleaved (every k and kernel once per round) and the minimum over rounds is reported.

``crossover`` = the smallest k from which foreach is faster than fused (in the minimum) at every
larger k too, and
``fused_max_slices`` = crossover - 1 (None when fused wins at every k): the value for
``optim_staged.update.FUSED_MAX_SLICES[device]``.

Run: ``python -m bench.optim_staged_kernels`` (CUDA when present: 4 Mi elements; CPU: 1 Mi,
``--threads``). Writes ``optim_staged_kernels.json`` / ``.png`` into ``$OUT`` (or ``outputs/bench``)
and prints the table last.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results
from optim_staged.update import adamw_update_


def unit(numel: int, k: int, device: str) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Master, grad, exp_avg, exp_avg_sq of one unit as k slice views each, and the step tensor."""
    g = torch.Generator(device=device).manual_seed(k)
    flat = [torch.randn(numel, generator=g, device=device) for _ in range(4)]
    flat[3].abs_()
    sizes = [numel // k] * k
    sizes[-1] += numel - sum(sizes)
    return [list(t.split(sizes)) for t in flat], torch.tensor(3.0, device=device)


def run(device: str, numel: int, slices: list[int], rounds: int, iters: int) -> list[dict]:
    timer = time_cuda if device == "cuda" else time_cpu
    units = {k: unit(numel, k, device) for k in slices}
    best: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for k in slices:
            (p, gr, m, v), step = units[k]
            for impl in ("fused", "foreach"):
                def call(p=p, gr=gr, m=m, v=v, step=step, impl=impl):
                    adamw_update_(p, gr, m, v, step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.01, impl=impl, step_value=3.0)

                ms = timer(call, warmup=1, iters=iters)["p50"]
                best[(k, impl)] = min(best.get((k, impl), float("inf")), ms)
    rows = []
    for k in slices:
        fused, foreach = best[(k, "fused")], best[(k, "foreach")]
        rows.append({"bench": "optim_staged_kernels", "case": f"k={k}", "device": device, "numel": numel,
                     "slices": k, "fused_ms": fused, "foreach_ms": foreach, "foreach_over_fused": foreach / fused,
                     "winner": "fused" if fused <= foreach else "foreach", "rounds": rounds})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [r["slices"] for r in rows]
    for key, label in (("fused_ms", "fused (torch._fused_adamw_)"), ("foreach_ms", "foreach")):
        ax.plot(ks, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("slices per unit")
    ax.set_ylabel("ms per unit update (min over rounds)")
    ax.set_title(f"AdamW, one unit of {rows[0]['numel']} elements, {rows[0]['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--numel", type=int, default=None, help="elements per unit (default 4 Mi cuda, 1 Mi cpu)")
    ap.add_argument("--slices", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the minimum is reported")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per measurement (p50)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = args.numel or ((4 << 20) if args.device == "cuda" else (1 << 20))
    slices = [int(x) for x in args.slices.split(",")]
    rows = run(args.device, numel, slices, args.rounds, args.iters)
    # the smallest k from which foreach wins at every larger k too (one noisy point does not flip it)
    cross = next((r["slices"] for i, r in enumerate(rows) if all(x["winner"] == "foreach" for x in rows[i:])), None)
    extra = {"crossover": cross, "fused_max_slices": None if cross is None else cross - 1,
             "threads": torch.get_num_threads() if args.device == "cpu" else None}
    path = write_results("optim_staged_kernels", rows, extra)
    plot(rows, out_dir() / "optim_staged_kernels.png")
    print(f"wrote {path}")
    print_table(rows, ["case", "device", "numel", "fused_ms", "foreach_ms", "foreach_over_fused", "winner"])
    print(f"crossover (foreach wins from k on): {cross}; FUSED_MAX_SLICES[{args.device!r}] = {extra['fused_max_slices']}")


if __name__ == "__main__":
    main()
