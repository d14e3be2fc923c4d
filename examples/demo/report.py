"""Final table, PNG plot and TensorBoard scalars (rank 0 only)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from examples.demo.tasks import DOMAINS
from examples.demo.timeline import PHASES


def run_header(cfg) -> dict:
    """``{date, gpu, commit, versions}`` of this run (commit: ``$MCD_COMMIT`` or ``git rev-parse``)."""
    import subprocess

    import torch

    commit = os.environ.get("MCD_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=10, cwd=Path(__file__).parent).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    versions = {"torch": torch.__version__}
    for mod in ("megatron.core", "transformers", "sglang"):
        try:
            versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception:  # noqa: BLE001 - absent or broken: not part of this run
            pass
    gpu = torch.cuda.get_device_name() if cfg.device == "cuda" and torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "commit": commit,
            "versions": versions}


class StepLog:
    """Rank 0's per-step log: one JSON line per step (``steps.jsonl``, rewritten from the restored
    history on resume) and TensorBoard scalars (``tb/run-<time>``), written as the run goes."""

    def __init__(self, out_dir: str):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tb_dir = str(self.out / "tb" / time.strftime("run-%Y%m%d-%H%M%S"))
        self._tb = None
        self._f = None

    def restart(self, history: list[dict]) -> None:
        """Start ``steps.jsonl`` over with ``history`` (the steps a resumed run already has)."""
        self._f = open(self.out / "steps.jsonl", "w")  # noqa: SIM115 - closed in close()
        for row in history:
            self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def write(self, row: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self._tb is None:
            self._tb = SummaryWriter(self.tb_dir)
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                self._tb.add_scalar(f"mopd/{k}", v, row["step"])
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._f is not None:
            self._f.close()


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


def timeline_summary(results: dict, history: list[dict]) -> str:
    """Mean wall ms per phase over the MOPD steps (rank 0), and the colocated record."""
    n = max(len(history), 1)
    parts = [f"{p} {1e3 * sum(float(h.get(f'time/{p}') or 0.0) for h in history) / n:.1f}"
             for p in PHASES + ("checkpoint",)]
    rec = results.get("colocated", {})
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    agent = ""
    turns = sorted({k.split("/")[0] for h in history for k in h if k.startswith("turn") and "/sample_accuracy/" in k})
    if turns:  # agent episodes: sample accuracy per model turn over the last 10 steps
        last = history[-10:]
        parts_t = [f"{t} " + " ".join(f"{d} {sum(h[f'{t}/sample_accuracy/{d}'] for h in last) / len(last):.1%}"
                                      for d in DOMAINS) for t in turns]
        c = sum(h["sharing_ratio_turns"] for h in last) / len(last)
        agent = ("\nagent episodes, sample accuracy over the last 10 steps: " + "; ".join(parts_t)
                 + f"; sharing ratio against one row per turn {c:.2f}")
    return ("mean ms per step: " + ", ".join(parts) + "\n"
            f"engine {rec.get('engine')}; trainer resident while generating {fmt(rec.get('trainer_resident_fraction_during_generate'))}, "
            f"engine resident while training {fmt(rec.get('engine_resident_fraction_during_train'))}, "
            f"publish {fmt(rec.get('publish_ms'))} ms (median), greedy engine == trainer: {rec.get('greedy_match')} "
            f"({rec.get('greedy_checks')} checks)" + agent)


def write_outputs(results: dict, history: list[dict], evals: list[dict], out_dir: str, *,
                  tb_dir: str | None = None) -> dict[str, str]:
    """``results.json`` (the colocated record's fields at top level, as ``docs/results/colocated_gpu.json``
    has them, plus everything), ``demo.png`` (timeline, accuracy, reward = −KL, tokens/s, sharing
    ratio) and TensorBoard scalars (the held-out evals into ``tb_dir``, the live log's folder; a
    new ``<out_dir>/tb/run-<time>`` with every step's scalars when None). Returns the written paths."""
    from mcore_distill.atomic import atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    live = tb_dir is not None
    tb_dir = tb_dir or str(out / "tb" / time.strftime("run-%Y%m%d-%H%M%S"))
    paths = {"json": str(out / "results.json"), "png": str(out / "demo.png"), "tensorboard": tb_dir}
    atomic_write_json(paths["json"], {**results.get("colocated", {}), "results": results, "history": history,
                                      "evals": evals})

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(paths["tensorboard"]) as tb:
        for h in [] if live else history:
            for k, v in h.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    tb.add_scalar(f"mopd/{k}", v, h["step"])
        for e in evals:
            for d in DOMAINS:
                tb.add_scalar(f"eval/accuracy/{d}", e[d], e["step"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 2, figsize=(12, 10.5))
    steps = [h["step"] for h in history]
    bottom = [0.0] * len(history)
    for p in PHASES + ("checkpoint",):
        ys = [1e3 * float(h.get(f"time/{p}") or 0.0) for h in history]
        if any(ys):
            ax[2, 0].bar(steps, ys, bottom=bottom, width=1.0, label=p)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    tops = sorted(bottom)
    if tops:  # checkpoint steps would flatten the rest: clip at 1.5x the 95th percentile
        ax[2, 0].set_ylim(0, 1.5 * tops[int(0.95 * (len(tops) - 1))] or 1.0)
    ax[2, 0].set(title="step timeline by phase, rank 0 (checkpoint steps clipped)", xlabel="MOPD step", ylabel="ms")
    ax[2, 0].legend(fontsize=7, ncol=3)
    for key, label in (("trainer_resident_fraction", "trainer resident while generating"),
                       ("engine_resident_fraction", "engine resident while training")):
        ys = [h.get(key) for h in history]
        if any(y is not None for y in ys):
            ax[2, 1].plot(steps, [float("nan") if y is None else y for y in ys], label=label)
    ax[2, 1].set(title="resident fraction of own (params+grads+optimizer | weights) bytes", xlabel="MOPD step",
                 ylim=(-0.05, 1.05))
    ax[2, 1].legend(fontsize=8)
    for d in DOMAINS:
        ax[0, 0].plot([e["step"] for e in evals], [e[d] for e in evals], marker="o", label=f"held-out {d}")
        last = max((k for k in evals[-1] if k.startswith("turn") and k.endswith(f"/{d}")), default=None) if evals else None
        if last is not None:  # agent episodes: the last turn, after the environment's feedback
            ax[0, 0].plot([e["step"] for e in evals], [e[last] for e in evals], ls="--", marker=".",
                          label=f"held-out {d}, {last.split('/')[0]} after feedback")
        ax[0, 0].axhline(results["teacher_accuracy"][d], ls=":", lw=1)
        ax[0, 1].plot(steps, [h[f"reward/{d}"] for h in history], label=d)
    ax[0, 0].set(title="student greedy exact match (dotted: teachers)", xlabel="MOPD step", ylim=(0, 1.05))
    ax[0, 1].set(title="reward = −(sampled reverse KL to routed teacher) per token", xlabel="MOPD step")
    ax[1, 0].plot(steps, [h["tokens_per_s"] for h in history])
    ax[1, 0].set(title="tokens/s (ΣL over step wall time, all ranks)", xlabel="MOPD step")
    ax[1, 1].plot(steps, [h["sharing_ratio"] for h in history], label="rows = sequences")
    if history and "sharing_ratio_turns" in history[0]:  # agent episodes: against one row per turn
        ax[1, 1].plot(steps, [h["sharing_ratio_turns"] for h in history], label="against one row per turn")
        ax[1, 1].legend(fontsize=8)
    ax[1, 1].set(title="harts sharing ratio C = ΣL / T", xlabel="MOPD step")
    for a in ax.flat:
        a.grid(alpha=0.3)
    ax[0, 0].legend()
    ax[0, 1].legend()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    return paths
