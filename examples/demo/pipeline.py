"""The whole demo as one function over an initialized gloo default process group (CPU)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig
from examples.demo.tasks import DOMAINS, TaskData


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


def run_demo(cfg: DemoConfig) -> dict:
    """Teachers → student warm start → MOPD. Collective; every rank returns the results dict
    (``accuracy[stage][domain]``, ``teacher_accuracy``, ``history``, ``evals``, timings)."""
    from examples.demo.student import build_pool, build_student, engine_accuracy, mopd_step, warm_start
    from examples.demo.teachers import prepare_teachers
    from mcore_distill.testing import init_megatron

    cfg.validate()
    rank, world = dist.get_rank(), dist.get_world_size()
    show = cfg.progress and rank == 0
    t_start = time.perf_counter()
    init_megatron(seed=cfg.seed)
    data = TaskData(length=cfg.length, letters=cfg.letters, shift=cfg.shift, held_out=cfg.held_out, seed=cfg.seed)

    with _bar(cfg.teacher.steps * len(DOMAINS), "teachers", show) as bar:
        teachers = prepare_teachers(cfg, data, bar=bar)
    t_teachers = time.perf_counter()

    st = build_student(cfg, data)
    accuracy = {"before": engine_accuracy(st, cfg, data)}
    with _bar(cfg.warm_start.steps, "student warm start", show) as bar:
        warm_start(st, cfg, data, teachers["distill"], bar=bar)
    accuracy["warm_start"] = engine_accuracy(st, cfg, data)
    t_warm = time.perf_counter()

    pool = build_pool(cfg, data, teachers["folders"])
    g = torch.Generator().manual_seed(977 * cfg.seed + 13 * rank + 11)
    history, evals = [], [{"step": 0, **accuracy["warm_start"]}]
    try:
        with _bar(cfg.mopd.steps, "student MOPD", show) as bar:
            for step in range(cfg.mopd.steps):
                t0 = time.perf_counter()
                m = mopd_step(st, cfg, data, pool, step, g)
                keys = sorted(k for k in m if k != "engine_trainer_max_abs")
                v = torch.tensor([m[k] for k in keys], dtype=torch.float64)
                dist.all_reduce(v)
                mx = torch.tensor([m["engine_trainer_max_abs"], time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                s = dict(zip(keys, v.tolist(), strict=True))
                row = {"step": step + 1, "tokens_per_s": s["tokens"] / float(mx[1]),
                       "sharing_ratio": s["tokens"] / s["compact_tokens"], "engine_trainer_max_abs": float(mx[0]),
                       "gnorm": m["gnorm"], **{f"time/{k[5:]}": s[k] / world for k in keys if k.startswith("time_")}}
                for d in DOMAINS:
                    row[f"reward/{d}"] = -s[f"{d}/kl_sum"] / max(s[f"{d}/tokens"], 1.0)
                    row[f"sample_accuracy/{d}"] = s[f"{d}/correct"] / max(s[f"{d}/samples"], 1.0)
                history.append(row)
                if (step + 1) % cfg.mopd.eval_every == 0 or step + 1 == cfg.mopd.steps:
                    evals.append({"step": step + 1, **engine_accuracy(st, cfg, data)})
                bar.update(1)
                bar.set_postfix({**{f"acc/{d[:3]}": f"{evals[-1][d]:.2f}" for d in DOMAINS},
                                 **{f"r/{d[:3]}": f"{row[f'reward/{d}']:+.2f}" for d in DOMAINS},
                                 "C": f"{row['sharing_ratio']:.2f}"})
    finally:
        pool.close()
    accuracy["mopd"] = {d: evals[-1][d] for d in DOMAINS}
    t_end = time.perf_counter()
    return {"accuracy": accuracy, "teacher_accuracy": teachers["accuracy"], "teachers_cached": teachers["cached"],
            "history": history, "evals": evals, "world_size": world, "forward": cfg.mopd.forward,
            "wall_s": {"teachers": t_teachers - t_start, "warm_start": t_warm - t_teachers,
                       "mopd": t_end - t_warm, "total": t_end - t_start},
            "publish_s_mean": sum(st.publish_s) / max(len(st.publish_s), 1), "engine_version": st.engine.weight_version()}


def acceptance(results: dict, *, ratio: float = 0.8) -> dict[str, bool]:
    """The issue's bar per domain: student ≥ ratio × teacher, and MOPD > warm start."""
    acc, teach = results["accuracy"], results["teacher_accuracy"]
    out = {}
    for d in DOMAINS:
        out[f"{d}: student >= {ratio:.0%} of teacher"] = acc["mopd"][d] >= ratio * teach[d]
        out[f"{d}: MOPD improves on warm start"] = acc["mopd"][d] > acc["warm_start"][d]
    return out
