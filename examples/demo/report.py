"""Final table, PNG plot and TensorBoard scalars (rank 0 only)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from examples.demo.tasks import DOMAINS


def table(results: dict) -> str:
    """Per-domain held-out exact match: teachers, student at each stage, student/teacher ratio."""
    acc, teach = results["accuracy"], results["teacher_accuracy"]
    head = f"{'held-out exact match':<28}" + "".join(f"{d:>12}" for d in DOMAINS)
    lines = [head, "-" * len(head)]
    for d_teacher in DOMAINS:
        lines.append(f"{'teacher ' + d_teacher:<28}" + "".join(
            f"{teach[d]:>12.1%}" if d == d_teacher else f"{'-':>12}" for d in DOMAINS))
    for stage in ("before", "warm_start", "mopd"):
        label = {"before": "student before (init)", "warm_start": "student after warm start",
                 "mopd": "student after MOPD"}[stage]
        lines.append(f"{label:<28}" + "".join(f"{acc[stage][d]:>12.1%}" for d in DOMAINS))
    lines.append(f"{'student / teacher':<28}" + "".join(
        f"{acc['mopd'][d] / max(teach[d], 1e-9):>12.1%}" for d in DOMAINS))
    return "\n".join(lines)


def write_outputs(results: dict, history: list[dict], evals: list[dict], out_dir: str) -> dict[str, str]:
    """JSON of everything, ``demo.png`` (accuracy, reward = −KL, tokens/s, sharing ratio) and
    TensorBoard scalars under ``<out_dir>/tb/run-<time>``. Returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "results.json"), "png": str(out / "demo.png"), "tensorboard": str(out / "tb" / time.strftime("run-%Y%m%d-%H%M%S"))}
    tmp = out / f".results.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"results": results, "history": history, "evals": evals}, indent=1))
    os.replace(tmp, paths["json"])

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(paths["tensorboard"]) as tb:
        for h in history:
            for k, v in h.items():
                if k != "step":
                    tb.add_scalar(f"mopd/{k}", v, h["step"])
        for e in evals:
            for d in DOMAINS:
                tb.add_scalar(f"eval/accuracy/{d}", e[d], e["step"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    steps = [h["step"] for h in history]
    for d in DOMAINS:
        ax[0, 0].plot([e["step"] for e in evals], [e[d] for e in evals], marker="o", label=f"held-out {d}")
        ax[0, 0].axhline(results["teacher_accuracy"][d], ls=":", lw=1)
        ax[0, 1].plot(steps, [h[f"reward/{d}"] for h in history], label=d)
    ax[0, 0].set(title="student greedy exact match (dotted: teachers)", xlabel="MOPD step", ylim=(0, 1.05))
    ax[0, 1].set(title="reward = −(sampled reverse KL to routed teacher) per token", xlabel="MOPD step")
    ax[1, 0].plot(steps, [h["tokens_per_s"] for h in history])
    ax[1, 0].set(title="tokens/s (ΣL over step wall time, all ranks)", xlabel="MOPD step")
    ax[1, 1].plot(steps, [h["sharing_ratio"] for h in history])
    ax[1, 1].set(title="harts sharing ratio C = ΣL / T", xlabel="MOPD step")
    for a in ax.flat:
        a.grid(alpha=0.3)
    ax[0, 0].legend()
    ax[0, 1].legend()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    return paths
