"""The colocated runner's fault paths and resume, with the real parts on CPU.

Each fault is injected into the real part (the HTTP teacher server process is SIGKILLed; the real
``HFEngine`` is destroyed while a ``generate`` is in flight, or started on a device it cannot use;
the real engine's weights are overwritten after a commit), except that a thin wrapper around the
engine arms the crash. Each test asserts the typed error, that no child process outlives its owner,
that the last complete checkpoint and verified weight version remain, and that resuming from that
checkpoint reproduces the uninterrupted run: per-step metrics and final weights bit for bit (the CPU
run is deterministic: fixed seeds, fixed reduction order on gloo, the prompt generator's state and
the LR schedule restored from the checkpoint, and the optimizer state restored exactly, so any
difference is a defect, not noise).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from examples.demo.config import (
    DemoConfig,
    MOPDStageConfig,
    TeacherTrainConfig,
    VerifySection,
    WarmStartConfig,
)
from tests._procs import argv, child_running, gone_within, pids, stat

STEPS, EVERY = 4, 2
DETERMINISTIC = ("reward/reverse", "reward/shift", "kl/reverse", "kl/shift", "sample_accuracy/reverse",
                 "sample_accuracy/shift", "sharing_ratio", "engine_trainer_max_abs", "gnorm")


def _cfg(out_dir: str, **over) -> DemoConfig:
    cfg = DemoConfig(length=4, held_out=16, out_dir=out_dir, progress=False, checkpoint_every=EVERY,
                     teacher=TeacherTrainConfig(steps=30, batch=16, min_accuracy=0.0, distill_prompts=32),
                     warm_start=WarmStartConfig(steps=3, batch=8),
                     mopd=MOPDStageConfig(steps=STEPS, prompts_per_step=2, group_size=4, eval_every=2),
                     verify=VerifySection(every=1, prompts=4))
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _server_processes(out_dir: str) -> list[int]:
    """Live (not zombie) processes whose command line names ``out_dir`` and the teacher server."""
    out = []
    for p in pids():
        s, a = stat(p), argv(p)
        if s is None or a is None:
            continue
        cmd = b" ".join(a).decode(errors="replace")
        if "mopd.hf_server" in cmd and out_dir in cmd and s.state != "Z":
            out.append(p)
    return out


def _no_orphans(out_dir: str) -> bool:
    deadline = time.monotonic() + 10
    while _server_processes(out_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _server_processes(out_dir)


def _summary(res: dict, out_dir: str) -> dict:
    from safetensors.torch import load_file

    from examples.demo import checkpoint

    cfg = _cfg(out_dir)
    hf = checkpoint.step_dir(cfg, STEPS) / "hf"
    weights = {}
    for f in sorted(hf.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return {"history": [{k: h[k] for k in ("step", *DETERMINISTIC)} for h in res["history"]],
            "evals": res["evals"], "accuracy": res["accuracy"], "version": res["engine_version"],
            "weights": weights, "resumed_from": res["resumed_from"]}


def _failure(fn, out_dir: str) -> dict:
    """Run ``fn`` expecting a failure; what the test checks about it."""
    from mcore_distill.testing import destroy_megatron

    try:
        fn()
        out = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test inspects the type
        cause = getattr(e, "cause", None)
        out = {"error": {"types": [c.__name__ for c in type(e).__mro__], "message": str(e),
                         "cause": None if cause is None else type(cause).__name__,
                         **{a: getattr(e, a, None) for a in ("step", "teacher", "version")}},
               "last_checkpoint": getattr(e, "last_checkpoint", "unset"),
               "last_good_version": getattr(e, "last_good_version", "unset")}
    destroy_megatron()
    out["no_orphans"] = _no_orphans(out_dir)
    latest = Path(out_dir, "checkpoints", "latest.json")
    out["latest"] = json.loads(latest.read_text()) if latest.exists() else None
    failure = Path(out_dir, "failure.json")
    out["failure_json"] = json.loads(failure.read_text()) if failure.exists() else None
    return out


class CrashingEngine:
    """Thin fault injector around the real ``HFEngine``: once ``armed``, the next ``generate`` is
    started with the engine paused (it parks at its first decode step, lock released) and the real
    engine is then destroyed under it, so the real ``generate`` raises. Everything else passes through."""

    def __init__(self, engine):
        self._engine = engine
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        if not self.armed:
            return self._engine.generate(*args, **kwargs)
        eng, box = self._engine, {}
        eng.pause()

        def run():
            try:
                box["out"] = eng.generate(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["err"] = e

        t = threading.Thread(target=run)
        t.start()
        while t.is_alive() and not (eng.residency._busy and eng._lock.acquire(blocking=False)):
            time.sleep(0.001)  # until the generation is parked (busy, lock released in its wait)
        if t.is_alive():
            eng._lock.release()
        eng.destroy()  # the crash: aborts the parked generation and frees the weights
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]


def _crash_rank(rank: int, world: int, root: str) -> dict:
    from examples.demo.engine import build_engine
    from examples.demo.pipeline import run_demo
    from examples.demo.runner import RunnerHooks
    from mcore_distill.testing import destroy_megatron

    torch.set_num_threads(1)
    ref_dir, dir_ = f"{root}/ref", f"{root}/crash"
    out = {"ref": _summary(run_demo(_cfg(ref_dir)), ref_dir)}
    destroy_megatron()

    engines = []

    def factory(*args):
        engines.append(CrashingEngine(build_engine(*args)))
        return engines[-1]

    def arm(k, job):
        if k == 3:
            job.st.engine.armed = True

    out["fault"] = _failure(lambda: run_demo(_cfg(dir_), engine_factory=factory, hooks=RunnerHooks(before_step=arm)),
                            dir_)
    out["engine_destroyed"] = engines[0]._destroyed
    out["resumed"] = _summary(run_demo(_cfg(dir_, resume=True)), dir_)
    destroy_megatron()
    return out


def _assert_same_run(ref: dict, got: dict, resumed_from: int) -> None:
    assert got["resumed_from"] == resumed_from
    assert got["history"] == ref["history"]  # bitwise: every float equal
    assert got["evals"] == ref["evals"] and got["accuracy"] == ref["accuracy"] and got["version"] == ref["version"]
    assert ref["weights"].keys() == got["weights"].keys()
    for name, t in ref["weights"].items():
        assert torch.equal(t, got["weights"][name]), name


def _is(f: dict, *types: type) -> bool:
    """The error of ``f`` is an instance of every one of ``types`` (errors cross the rank
    boundary as their class hierarchy's names: some take several constructor arguments)."""
    return f["error"] is not None and all(t.__name__ in f["error"]["types"] for t in types)


def _assert_fault(f: dict, error: type, *, step: int = 3) -> None:
    assert _is(f, error), f["error"]
    assert f["no_orphans"], "a teacher server process outlived its owner"
    assert f["latest"]["step"] == EVERY and f["last_checkpoint"] == EVERY
    assert f["latest"]["version"] == 2 + EVERY == f["last_good_version"]  # init, warm start, one per step
    assert f["failure_json"]["error"] == error.__name__ and f["failure_json"]["step"] == step
    assert f["failure_json"]["last_checkpoint"] == EVERY


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_engine_crash_mid_generate_then_resume_equals_uninterrupted(tmp_path):
    from colocate.errors import ColocateError, GenerationAbortedError
    from examples.demo.errors import EngineCrashedError
    from mcore_distill.testing import run_ranks

    out = run_ranks(_crash_rank, 2, str(tmp_path), timeout=230)
    for r in out:
        f = r["fault"]
        _assert_fault(f, EngineCrashedError)
        assert _is(f, ColocateError) and f["error"]["cause"] == GenerationAbortedError.__name__
        assert f["error"]["step"] == 3 and r["engine_destroyed"]
        _assert_same_run(r["ref"], r["resumed"], resumed_from=EVERY)
        assert len(r["ref"]["history"]) == STEPS


def _kill_server_process(job) -> int:
    """SIGKILL the real server process (the child of the scheduler's guard), as a crash would."""
    pid = child_running(job.server.worker.pid, "mopd.hf_server")  # not the guard's watcher fork
    if pid is None:
        raise AssertionError("no server process under the guard")
    os.kill(pid, signal.SIGKILL)
    return pid


def _faults_rank(rank: int, world: int, root: str) -> dict:
    from examples.demo.engine import build_engine
    from examples.demo.pipeline import run_demo
    from examples.demo.runner import RunnerHooks
    from mcore_distill.testing import destroy_megatron

    torch.set_num_threads(1)
    out = {}
    ref_dir = f"{root}/ref"
    out["ref"] = _summary(run_demo(_cfg(ref_dir)), ref_dir)
    destroy_megatron()

    # 1. teacher server down: its process is SIGKILLed before step 3's scoring
    d = f"{root}/server"
    killed = []
    kill = RunnerHooks(before_step=lambda k, job: k == 3 and killed.append(_kill_server_process(job)))
    out["server"] = _failure(lambda: run_demo(_cfg(d), hooks=kill), d)
    # 2. engine start failure while resuming (the real start pointed at a model folder that is not there)
    def missing_folder(cfg, spec, hf_dir, device):
        return build_engine(cfg, spec, hf_dir + ".missing", device)

    out["start"] = _failure(lambda: run_demo(_cfg(d, resume=True), engine_factory=missing_folder), d)
    out["server_resumed"] = _summary(run_demo(_cfg(d, resume=True)), d)
    destroy_megatron()

    # 3. publish verification: the real engine's weights are overwritten after step 3's commit
    d = f"{root}/verify"

    def corrupt(k, job):
        if k == 3:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in job.st.engine.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    out["verify"] = _failure(lambda: run_demo(_cfg(d), hooks=RunnerHooks(after_publish=corrupt)), d)
    out["verify_resumed"] = _summary(run_demo(_cfg(d, resume=True)), d)
    destroy_megatron()

    # 4. a checkpoint written by another number of ranks is refused before anything is loaded
    from examples.demo import checkpoint
    from examples.demo.config import DemoConfigError

    try:
        checkpoint.load(None, _cfg(d), {**checkpoint.latest(_cfg(d)), "world_size": 2})
        out["other_world"] = None
    except DemoConfigError as e:
        out["other_world"] = str(e)
    return out


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_server_down_start_failure_and_bad_publish_then_resume(tmp_path):
    from colocate.errors import PublishError, WorkerError
    from examples.demo.errors import EngineStartError, PublishVerificationError, TeacherServerDownError
    from mcore_distill.testing import run_ranks
    from mopd.errors import TeacherServerError

    r = run_ranks(_faults_rank, 1, str(tmp_path), timeout=290)[0]
    _assert_fault(r["server"], TeacherServerDownError)
    assert _is(r["server"], TeacherServerError) and r["server"]["error"]["teacher"] == "shift_teacher"

    start = r["start"]
    assert _is(start, EngineStartError, WorkerError)
    assert "engine.kind='hf'" in start["error"]["message"] and start["no_orphans"]
    assert start["latest"]["step"] == EVERY and start["last_checkpoint"] == EVERY  # nothing overwritten
    _assert_same_run(r["ref"], r["server_resumed"], resumed_from=EVERY)

    _assert_fault(r["verify"], PublishVerificationError)
    assert _is(r["verify"], PublishError) and r["verify"]["error"]["version"] == 2 + 3
    assert "greedy outputs differ" in r["verify"]["error"]["message"]
    assert r["other_world"] == ("resume=True: the checkpoint of step 4 was written by 2 ranks, this job has 1")
    _assert_same_run(r["ref"], r["verify_resumed"], resumed_from=EVERY)


# ----- a real kill: SIGKILL of torchrun (its ranks must follow), then resume=true ---------------------
KILL_ARGS = ["length=4", "held_out=16", "progress=false", "teacher.steps=30", "teacher.batch=16",
             "teacher.min_accuracy=0", "teacher.distill_prompts=32", "warm_start.steps=3", "warm_start.batch=8",
             "mopd.steps=12", "mopd.prompts_per_step=2", "mopd.group_size=4", "mopd.eval_every=1",
             "verify.every=1", "verify.prompts=4", "checkpoint_every=2"]


def _torchrun(out_dir: str, *extra: str):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "examples.demo.run", f"out_dir={out_dir}", *KILL_ARGS, *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _job_processes(root: int) -> list[int]:
    """Descendants of ``root`` running ``examples.demo.run`` (the ranks; torchrun may start them in
    sessions of their own, so a process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for p in pids():
        if (st := stat(p)) is not None:
            children.setdefault(st.ppid, []).append(p)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            todo.append(c)
            if b"examples.demo.run" in b" ".join(argv(c) or []):
                out.append(c)
    return out


def _steps(out_dir: str) -> list[dict]:
    p = Path(out_dir, "steps.jsonl")
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _final_weights(out_dir: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(out_dir, "checkpoints", "step_000012", "hf").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path):
    """torchrun is SIGKILLed once step 3 is logged (its ranks run in sessions of their own, so the
    kill does not reach them): the ranks end by themselves (``end_with_launcher``), the teacher
    server dies with its owner (its guard), the last complete checkpoint stays loadable, and
    ``resume=true`` ends with the per-step metrics and final weights of an uninterrupted run."""
    ref, dir_ = str(tmp_path / "ref"), str(tmp_path / "killed")
    assert _torchrun(ref).wait(timeout=200) == 0
    proc = _torchrun(dir_)
    deadline = time.monotonic() + 200
    while len(_steps(dir_)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    ranks = _job_processes(proc.pid)
    assert len(ranks) == 2
    os.kill(proc.pid, signal.SIGKILL)  # torchrun only
    proc.wait(timeout=30)
    left = gone_within(ranks, 15)
    for pid in left:  # clean up before failing
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their SIGKILLed torchrun"
    killed_at = len(_steps(dir_))
    assert killed_at < 12
    assert _no_orphans(dir_), "the teacher server outlived its SIGKILLed owner"
    latest = json.loads(Path(dir_, "checkpoints", "latest.json").read_text())
    assert latest["step"] % 2 == 0 and 2 <= latest["step"] <= killed_at

    assert _torchrun(dir_, "resume=true").wait(timeout=200) == 0
    got, want = _steps(dir_), _steps(ref)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [{k: r[k] for k in DETERMINISTIC} for r in got] == [{k: r[k] for k in DETERMINISTIC} for r in want]
    assert [r.get("accuracy/reverse") for r in got] == [r.get("accuracy/reverse") for r in want]
    a, b = _final_weights(ref), _final_weights(dir_)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    res = json.loads(Path(dir_, "results.json").read_text())
    assert res["results"]["resumed_from"] == latest["step"]


def test_engine_resident_fraction_of_sglang_divides_by_its_tagged_bytes():
    """SGLang: (H − freed) / H with H = weights + KV + graphs by SGLang's accounting; the
    whole-process variant divides by the start's device memory (its CUDA context included)."""
    from types import SimpleNamespace

    from examples.demo.runner import engine_resident_fraction

    engine = SimpleNamespace(held_bytes={"weights": 4 << 20, "kv_cache": 48 << 20, "cuda_graph": 2 << 20},
                             footprint_bytes=1000 << 20)
    job = SimpleNamespace(st=SimpleNamespace(engine=engine), engine_full_bytes=None)
    freed = {"kv_cache": 48 << 20, "weights": 4 << 20, "cuda_graph": 2 << 20}
    assert engine_resident_fraction(job, freed) == 0.0
    assert engine_resident_fraction(job, {"kv_cache": 48 << 20}) == 6 / 54
    assert engine_resident_fraction(job, freed, whole_process=True) == (1000 - 54) / 1000
    assert engine_resident_fraction(job, {**freed, "weights": 8 << 20}) == 0.0  # page rounding: never below 0
    # per tag: 6 MiB more KV freed does not hide 2 MiB of graphs still held
    assert engine_resident_fraction(job, {"kv_cache": 54 << 20, "weights": 4 << 20}) == 2 / 54
