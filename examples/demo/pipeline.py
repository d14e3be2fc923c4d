"""The whole job as one function over an initialized default process group (gloo on CPU, NCCL on GPU):
teachers → HTTP teacher server → student + engine → warm start (or resume) → colocated MOPD."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig
from examples.demo.tasks import DOMAINS, TaskData


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


def _start_server(cfg: DemoConfig, folders: dict):
    """Rank 0 starts the HTTP teacher server (when ``teacher.http_routes``); every rank gets
    ``{route: url}``. A start failure raises on every rank (rank 0's error, the others' WorkerError)."""
    from colocate.errors import WorkerError
    from examples.demo.teacher_server import start_teacher_server

    if not cfg.teacher.http_routes:
        return None, {}
    route = cfg.teacher.http_routes[0]
    server, err, msg = None, None, [None]
    if dist.get_rank() == 0:
        try:
            server = start_teacher_server(cfg, folders[route], log_path=str(Path(cfg.out_dir) / "teacher_server.log"))
            msg = [server.url]
        except Exception as e:  # noqa: BLE001 - re-raised below after the others heard of it
            err, msg = e, [f"error: {type(e).__name__}: {e}"]
    dist.broadcast_object_list(msg, src=0)
    if err is not None:
        raise err
    if msg[0].startswith("error: "):
        raise WorkerError(f"teacher server failed to start on rank 0: {msg[0][7:]}")
    return server, {route: msg[0]}


def _fresh_start(job, cfg: DemoConfig, data: TaskData, teachers: dict, show: bool) -> None:
    """Before MOPD: accuracy at init, warm start (publishes), step-0 checkpoint."""
    from examples.demo import checkpoint
    from examples.demo.student import engine_accuracy, warm_start

    job.accuracy["before"] = engine_accuracy(job.st, cfg, data)
    with _bar(cfg.warm_start.steps, "student warm start", show) as bar:
        warm_start(job.st, cfg, data, teachers["distill"], bar=bar)
    job.accuracy["warm_start"] = engine_accuracy(job.st, cfg, data)
    job.evals.append({"step": 0, **job.accuracy["warm_start"]})
    job.last_good_version = job.st.version
    if checkpoint.due(cfg, 0):
        checkpoint.save_weights(job.st, cfg, 0)
        checkpoint.finalize(cfg, 0, _state(job))
        job.last_checkpoint = 0


def _state(job) -> dict:
    from examples.demo.runner import runner_state

    return runner_state(job)


def _resume(job, cfg: DemoConfig, info: dict) -> None:
    """Load the checkpoint ``info`` names and publish its weights as its version."""
    from examples.demo import checkpoint
    from examples.demo.student import publish

    state = checkpoint.load(job.st, cfg, info)
    publish(job.st, version=state["version"])
    checkpoint.set_rng_state(job.g, state["rng"])
    job.step, job.history, job.evals = state["step"], state["history"], state["evals"]
    job.accuracy, job.greedy_checks = state["accuracy"], state["greedy_checks"]
    job.last_good_version, job.last_checkpoint = state["version"], state["step"]


def _record_failure(job, cfg: DemoConfig, err: BaseException) -> None:
    """Name the failure, the last complete checkpoint and the last verified version on the error
    (``err.last_checkpoint``, ``err.last_good_version``) and in ``<out_dir>/failure.json``."""
    from examples.demo import checkpoint
    from mcore_distill.atomic import atomic_write_json

    info = checkpoint.latest(cfg)
    err.last_checkpoint = None if info is None else info["step"]
    err.last_good_version = None if job is None else job.last_good_version
    if dist.get_rank() == 0:
        atomic_write_json(Path(cfg.out_dir) / "failure.json", {
            "error": type(err).__name__, "message": str(err)[:2000], "step": None if job is None else job.step + 1,
            "last_checkpoint": err.last_checkpoint, "last_good_version": err.last_good_version})


def _shutdown(st, pool, server) -> None:
    """Stop everything this rank started; every part is tried."""
    from examples.demo.engine import shutdown

    for stop in (lambda: pool is not None and pool.close(), lambda: st is not None and shutdown(st.engine),
                 lambda: server is not None and server.stop()):
        try:
            stop()
        except Exception as e:  # noqa: BLE001 - keep stopping the others
            print(f"runner: shutdown step failed: {type(e).__name__}: {e}")


def run_demo(cfg: DemoConfig, *, engine_factory=None, hooks=None) -> dict:
    """Teachers → student warm start (or ``resume``) → colocated MOPD. Collective; every rank
    returns the results dict (``accuracy[stage][domain]``, ``teacher_accuracy``, ``history``,
    ``evals``, timings, the colocated record). ``engine_factory`` / ``hooks``: test seams
    (:func:`examples.demo.engine.build_engine`, :class:`examples.demo.runner.RunnerHooks`)."""
    from examples.demo import checkpoint
    from examples.demo.report import StepLog
    from examples.demo.runner import Job, RunnerHooks, run_mopd, trainer_state_bytes
    from examples.demo.student import build_pool, build_student
    from examples.demo.teachers import prepare_teachers
    from examples.demo.timeline import PhaseTimeline
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

    server = st = pool = job = None
    log = StepLog(cfg.out_dir) if rank == 0 else None
    try:
        server, urls = _start_server(cfg, teachers["folders"])
        st = build_student(cfg, data, engine_factory=engine_factory)
        pool = build_pool(cfg, data, teachers["folders"], urls=urls, device=st.device)
        job = Job(cfg=cfg, data=data, st=st, pool=pool, server=server, hooks=hooks or RunnerHooks(),
                  g=torch.Generator().manual_seed(977 * cfg.seed + 13 * rank + 11), timeline=PhaseTimeline(st.device))
        info = checkpoint.latest(cfg) if cfg.resume else None
        if info is not None:
            _resume(job, cfg, info)
        else:
            _fresh_start(job, cfg, data, teachers, show)
        if log is not None:
            log.restart(job.history)
        t_warm = time.perf_counter()
        job.trainer_state_bytes = trainer_state_bytes(st)
        st.residency.release()  # rollout state: the trainer's weights, grads and optimizer off the device
        with _bar(cfg.mopd.steps, "student MOPD (colocated)", show) as bar:
            bar.update(job.step)
            run_mopd(job, bar=bar, log=None if log is None else log.write)
    except BaseException as err:
        _record_failure(job, cfg, err)
        raise
    finally:
        _shutdown(st, pool, server)
        if log is not None:
            log.close()
    job.accuracy["mopd"] = {d: job.evals[-1][d] for d in DOMAINS}
    record = colocated_record(cfg, job)
    for d in DOMAINS:
        record["routes"][d]["teacher_acc"] = teachers["accuracy"][d]
    t_end = time.perf_counter()
    return {"accuracy": job.accuracy, "teacher_accuracy": teachers["accuracy"], "teachers_cached": teachers["cached"],
            "history": job.history, "evals": job.evals, "world_size": world, "forward": cfg.mopd.forward,
            "resumed_from": None if info is None else info["step"],
            "wall_s": {"teachers": t_teachers - t_start, "warm_start": t_warm - t_teachers,
                       "mopd": t_end - t_warm, "total": t_end - t_start},
            "publish_s_mean": sum(st.publish_s) / max(len(st.publish_s), 1), "engine_version": st.version,
            "colocated": record, "tb_dir": None if log is None else log.tb_dir}


def colocated_record(cfg: DemoConfig, job) -> dict:
    """The ``docs/results/colocated_gpu.json`` fields this run measured (rank 0's view)."""
    from examples.demo.report import run_header

    hist = job.history
    worst = lambda key: max((h[key] for h in hist if h.get(key) is not None), default=None)  # noqa: E731
    pub = sorted(h["publish_ms"] for h in hist if h.get("publish_ms") is not None)
    return {"header": run_header(cfg), "engine": {"hf": "hf_engine", "sglang": "sglang"}[cfg.engine.kind],
            "steps": job.step,
            "routes": {d: {"teacher": "http" if d in cfg.teacher.http_routes else "megatron",
                           "warm_start_acc": job.accuracy.get("warm_start", {}).get(d),
                           "student_acc": job.evals[-1][d]} for d in DOMAINS},
            "trainer_resident_fraction_during_generate": worst("trainer_resident_fraction"),
            "engine_resident_fraction_during_train": worst("engine_resident_fraction"),
            "engine_process_resident_fraction_during_train": worst("engine_process_resident_fraction"),
            "engine_held_bytes": getattr(job.st.engine, "held_bytes", None),  # SGLang's accounting per tag
            "publish_ms": pub[len(pub) // 2] if pub else None,
            "greedy_match": bool(job.greedy_checks) and all(c["mismatch"] == 0 for c in job.greedy_checks),
            "greedy_unexplained": max((c.get("unexplained", c["mismatch"]) for c in job.greedy_checks), default=None),
            "greedy_flip_margins": [m for c in job.greedy_checks for m in c.get("flip_margins", [])],
            "greedy_checks": len(job.greedy_checks)}


def acceptance(results: dict, *, ratio: float = 0.8) -> dict[str, bool]:
    """The issue's bar per domain: student ≥ ratio × teacher, and MOPD > warm start."""
    acc, teach = results["accuracy"], results["teacher_accuracy"]
    out = {}
    for d in DOMAINS:
        out[f"{d}: student >= {ratio:.0%} of teacher"] = acc["mopd"][d] >= ratio * teach[d]
        out[f"{d}: MOPD improves on warm start"] = acc["mopd"][d] > acc["warm_start"][d]
    return out
