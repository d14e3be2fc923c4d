"""Forked colocated workers: a role started as a child of its owner, on the owner's node and
physical GPUs, with per-role environment overrides merged over the owner's environment.

Schedulers:

* :class:`LocalScheduler` — a subprocess in its own session under a small guard process; the
  group (worker and its children) is killed on :meth:`ForkedWorker.kill`, on owner exit
  (``atexit``), and, through the guard's ``PR_SET_PDEATHSIG``, when the owner dies hard, so no
  orphan survives the owner (a descendant that calls ``setsid`` itself escapes, as with any
  process-group scheme).
* :class:`SlurmScheduler` — an ``srun --overlap --jobid=<owner job> -n1 -N1 -w <owner node>``
  step inside the owner's allocation (``--overlap`` lets it share the owner's CPUs/GPUs); the
  role env is set in srun's own environment (``--export=ALL`` does not override variables that
  already exist); kill also ``scancel``s the step.
* :class:`RayScheduler` — a Ray actor pinned to the owner's node (``NodeAffinitySchedulingStrategy``,
  ``soft=False``) that runs the command under the same guard; the actor sees the role's
  overrides through ``runtime_env`` env vars, the command gets the exact merged env; the actor
  fate-shares with its owner (Ray kills it when the owner dies) and the guard then kills the
  command's group. ``ray`` is imported lazily.

A worker signals readiness by calling :func:`mark_ready` (it writes a small JSON file named by
``COLOCATE_READY_FILE`` with its pid, host, Slurm step and ``CUDA_VISIBLE_DEVICES``), or the
owner probes it itself (``fork(spec, wait=False)``, then its own health check, as
:meth:`colocate.sglang_engine.SGLangEngine.launch_server` does for an SGLang server).
A spec that names a scheduler (``WorkerSpec.scheduler``) is refused by the others;
:func:`scheduler_for` builds the one it names.
GPU ids: :func:`physical_gpu_ids` maps the owner's logical devices through
``CUDA_VISIBLE_DEVICES``; the worker gets the same physical list, so its logical device i is
the owner's, and IPC keys use :func:`ipc_key` built from physical ids.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from colocate.config import WorkerSpec
from colocate.errors import WorkerError, WorkerStartTimeout
from mcore_distill.atomic import atomic_write_json

__all__ = ["WorkerError", "WorkerStartTimeout", "ForkedWorker", "LocalScheduler", "SlurmScheduler", "RayScheduler",
           "RayWorker", "merge_env", "physical_gpu_ids", "ipc_key", "mark_ready", "scheduler_for", "kill_process_group",
           "READY_ENV"]

READY_ENV = "COLOCATE_READY_FILE"


def merge_env(base: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``overrides`` applied; an override of ``""`` removes the variable."""
    env = dict(base)
    for k, v in overrides.items():
        if v == "":
            env.pop(k, None)
        else:
            env[k] = v
    return env


def physical_gpu_ids(env: Mapping[str, str] | None = None) -> list[str] | None:
    """Physical device ids (indices or UUIDs) behind logical devices 0..n-1, read from
    ``CUDA_VISIBLE_DEVICES``; None when unset (logical == physical)."""
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def ipc_key(logical_device: int, *, env: Mapping[str, str] | None = None, host: str | None = None) -> str:
    """A node-unique key for a device: ``host:physical-id`` (the same for every colocated role
    however each one numbers its devices)."""
    ids = physical_gpu_ids(env)
    if ids is not None and not 0 <= logical_device < len(ids):
        raise ValueError(f"logical device {logical_device} outside CUDA_VISIBLE_DEVICES={','.join(ids)!r}")
    phys = ids[logical_device] if ids is not None else str(logical_device)
    return f"{host or socket.gethostname()}:{phys}"


def mark_ready(**extra: object) -> None:
    """Call in a worker once it serves: writes the ready file its owner waits for (atomic)."""
    path = os.environ.get(READY_ENV)
    if not path:
        raise WorkerError(f"mark_ready: {READY_ENV} is not set (not started by a colocate scheduler)")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), **extra}
    atomic_write_json(path, info, indent=None)


# The guard sits between owner and worker, leads the worker's process group, and dies with the
# owner (PR_SET_PDEATHSIG → SIGTERM); on SIGTERM it forwards SIGTERM to the worker, waits until
# the worker exits or the grace period ends, then SIGKILLs the whole group, grandchildren included. A forked watcher in the
# group covers the case where the guard itself is SIGKILLed (Ray's raylet SIGKILLs the direct
# children of a dead actor): it gets PR_SET_PDEATHSIG from the guard and then stops the group the
# same way (SIGTERM, the grace or until no other member is left, SIGKILL).
# Stdlib only: it starts in milliseconds.
_GUARD = r"""
import ctypes, os, signal, subprocess, sys, time
owner, grace = int(sys.argv[1]), float(sys.argv[2])
prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
prctl(1, signal.SIGTERM)
if os.getppid() != owner:
    os.killpg(0, signal.SIGKILL)
guard = os.getpid()
if os.fork() == 0:
    def others():  # live members of this process group besides the watcher
        me, pg, n = os.getpid(), os.getpgid(0), 0
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != me:
                try:
                    f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                n += f[0] != "Z" and int(f[2]) == pg
        return n
    def reap(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while others() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(0, signal.SIGKILL)
    signal.signal(signal.SIGTERM, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prctl(1, signal.SIGTERM)
    if os.getppid() != guard:
        reap(0, None)
    while True:
        signal.pause()
child = subprocess.Popen(sys.argv[3:])
def stop(signum, frame):
    # Runs while the main loop sits in child.wait(), which holds Popen's wait lock: a nested
    # child.wait/poll could not reap and would always sleep the whole grace. waitpid directly.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline = time.monotonic() + grace
    try:
        if child.returncode is None:
            os.kill(child.pid, signal.SIGTERM)
            while os.waitpid(child.pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
code = child.wait()
sys.exit(code if code >= 0 else 128 - code)
"""


class ForkedWorker:
    """A started worker: ``pid``, readiness info, health, kill (idempotent, no orphans)."""

    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, ready_file: Path, env: dict[str, str],
                 on_kill=None):
        self.spec, self.proc, self.ready_file, self.env = spec, proc, ready_file, env
        self.info: dict | None = None
        self._on_kill = on_kill

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until the worker called :func:`mark_ready`; returns its info. Raises
        :class:`WorkerError` if it exits first, :class:`WorkerStartTimeout` after the timeout."""
        deadline = time.monotonic() + (self.spec.health_timeout_s if timeout is None else timeout)
        while not self.ready_file.exists():
            code = self.proc.poll()
            if code is not None:
                raise WorkerError(f"worker {self.spec.role!r} (pid {self.pid}) exited with {code} before ready")
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerStartTimeout(f"worker {self.spec.role!r} (pid {self.pid}) not ready within "
                                         f"{self.spec.health_timeout_s if timeout is None else timeout:.1f}s")
            time.sleep(0.02)
        self.info = json.loads(self.ready_file.read_text())
        return self.info

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        """Alive and ready."""
        return self.alive() and self.ready_file.exists()

    def kill(self) -> int | None:
        """SIGTERM the guard (which forwards it to the worker), SIGKILL the whole process group
        once the worker exited or after ``kill_grace_s``; returns the guard's exit code."""
        if self._on_kill is not None:
            with contextlib.suppress(Exception):
                self._on_kill(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.spec.kill_grace_s + 2)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        if self.proc.poll() is None:
            self.proc.wait(10)
        shutil.rmtree(self.ready_file.parent, ignore_errors=True)
        return self.proc.returncode


class _Scheduler:
    """What every scheduler shares: the owner's env, the role env it builds, the workers it
    started, and their shutdown (explicit or at owner exit)."""

    kind = ""
    """The ``WorkerSpec.scheduler`` name of this scheduler."""

    def __init__(self, owner_env: Mapping[str, str] | None):
        self.owner_env = dict(os.environ if owner_env is None else owner_env)
        self.workers: list = []
        self._lock = threading.Lock()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._shutdown_at_exit())

    def _prepare(self, spec: WorkerSpec) -> tuple[Path, dict[str, str]]:
        """Refuse a spec for another scheduler; a fresh ready folder and the role's env: owner env
        + role overrides, ``CUDA_VISIBLE_DEVICES`` of ``spec.devices``, ready file, role, owner pid."""
        if spec.scheduler not in (None, self.kind):
            raise WorkerError(f"WorkerSpec.scheduler={spec.scheduler!r} for role {spec.role!r}, but "
                              f"{type(self).__name__} (scheduler {self.kind!r}) was asked to start it")
        env = merge_env(self.owner_env, spec.env)
        if spec.devices is not None:
            phys = physical_gpu_ids(self.owner_env)
            if phys is not None and max(spec.devices) >= len(phys):
                raise WorkerError(f"WorkerSpec.devices={spec.devices} outside the owner's "
                                  f"CUDA_VISIBLE_DEVICES={','.join(phys)!r}")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(phys[d] if phys is not None else str(d) for d in spec.devices)
        tmp = Path(tempfile.mkdtemp(prefix=f"colocate-{spec.role}-"))
        env.update({READY_ENV: str(tmp / "ready.json"), "COLOCATE_ROLE": spec.role,
                    "COLOCATE_OWNER_PID": str(os.getpid())})
        return tmp, env

    def _shutdown_at_exit(self) -> None:
        try:
            self.shutdown()
        except WorkerError as e:  # at interpreter exit: report, do not raise
            print(f"colocate: {e}", file=sys.stderr)

    def _register(self, worker, wait: bool):
        with self._lock:
            self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def shutdown(self) -> None:
        """Kill every worker started here (idempotent). Every worker is tried; the first failure
        is raised afterwards as :class:`WorkerError`."""
        with self._lock:
            workers, self.workers = self.workers, []
        errors = []
        for w in workers:
            try:
                w.kill()
            except Exception as e:  # noqa: BLE001 - keep killing the others
                errors.append((w.spec.role, e))
        if errors:
            role, e = errors[0]
            raise WorkerError(f"shutdown: killing worker {role!r} failed ({len(errors)} of {len(workers)} "
                              f"failed): {e}") from e


def _log_file(spec: WorkerSpec):
    """The open (append) log file of ``spec``, or None: stdout/stderr stay the owner's."""
    if spec.log_path is None:
        return None
    Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
    return open(spec.log_path, "ab")  # noqa: SIM115 - handed to the child, closed right after


class LocalScheduler(_Scheduler):
    """Starts workers as local subprocesses of this (owner) process; kills them all on exit."""

    kind = "local"

    def __init__(self, *, owner_env: Mapping[str, str] | None = None):
        super().__init__(owner_env)

    def _argv(self, spec: WorkerSpec, env: dict[str, str]) -> list[str]:
        return list(spec.command)

    def _on_kill(self, worker: ForkedWorker) -> None:
        return None

    def fork(self, spec: WorkerSpec, *, wait: bool = True) -> ForkedWorker:
        """Start ``spec`` with the owner env + role overrides; wait for ready unless ``wait=False``."""
        tmp, env = self._prepare(spec)
        argv = self._argv(spec, env)
        if shutil.which(argv[0], path=env.get("PATH")) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WorkerError(f"cannot start worker {spec.role!r}: {argv[0]!r} not found or not executable")
        log = _log_file(spec)
        try:
            proc = subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid()), str(spec.kill_grace_s), *argv],
                                    env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=None if log is None else subprocess.STDOUT)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WorkerError(f"cannot start worker {spec.role!r}: {argv[0]!r}: {e}") from e
        finally:
            if log is not None:
                log.close()
        return self._register(ForkedWorker(spec, proc, tmp / "ready.json", env, on_kill=self._on_kill), wait)


class SlurmScheduler(LocalScheduler):
    """Starts workers as job steps inside the owner's Slurm allocation (same node)."""

    kind = "slurm"

    def __init__(self, *, owner_env: Mapping[str, str] | None = None, srun: str = "srun",
                 scancel: str = "scancel", extra_args: tuple[str, ...] = ()):
        super().__init__(owner_env=owner_env)
        self.job_id = self.owner_env.get("SLURM_JOB_ID") or self.owner_env.get("SLURM_JOBID")
        if not self.job_id:
            raise WorkerError("SlurmScheduler: SLURM_JOB_ID is not set in the owner environment "
                              "(the owner must run inside a Slurm allocation)")
        self.node = self.owner_env.get("SLURMD_NODENAME") or socket.gethostname()
        self.srun, self.scancel, self.extra_args = srun, scancel, tuple(extra_args)

    def _argv(self, spec: WorkerSpec, env: dict[str, str]) -> list[str]:
        # Step variables of the owner must not leak into the new step's srun.
        for k in [k for k in env if k.startswith("SLURM_STEP") or k in ("SLURM_STEPID",)]:
            env.pop(k)
        return [self.srun, "--overlap", f"--jobid={self.job_id}", "-n1", "-N1", f"--nodelist={self.node}",
                "--export=ALL", f"--job-name=colocate-{spec.role}", *self.extra_args, *spec.command]

    def _on_kill(self, worker: ForkedWorker) -> None:
        info = worker.info
        if info is None and worker.ready_file.exists():
            info = json.loads(worker.ready_file.read_text())
        step = (info or {}).get("slurm_step_id")
        if step is not None:
            subprocess.run([self.scancel, "--signal=KILL", f"{self.job_id}.{step}"], env=worker.env,
                           capture_output=True, timeout=30)


# ----- Ray --------------------------------------------------------------------------------------
def _role_actor_class() -> type:
    """The Ray actor class, defined in a function so that cloudpickle ships it *by value*: the
    actor process then needs only the standard library and ``ray`` (importing ``colocate``
    would pull in torch and add seconds to every actor start)."""

    class _RoleActor:
        """Body of the Ray actor (``ray`` imported lazily, so this module loads without it).

        It runs the role's command under :data:`_GUARD` bound to *this* actor process, so when Ray
        kills the actor (``ray.kill``, owner death, ``ray.shutdown``) the guard's parent-death signal
        takes the whole command group down with it.
        """

        def __init__(self, argv: list[str], env: dict[str, str], ready_file: str, kill_grace_s: float,
                     log_path: str | None = None):
            self.ready_file = Path(ready_file)
            self.grace = kill_grace_s
            log = None if log_path is None else open(log_path, "ab")  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid()), str(kill_grace_s),
                                              *argv], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=None if log is None else subprocess.STDOUT)
            finally:
                if log is not None:
                    log.close()

        def status(self) -> dict:
            """``{"code": exit code or None, "info": ready info or None}``."""
            code = self.proc.poll()
            info = json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None
            return {"code": code, "info": info}

        def probe(self, keys: list[str]) -> dict:
            """Where the actor itself runs and what it sees: node id, pid, ``keys`` of its env."""
            import ray

            return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "guard_pid": self.proc.pid,
                    "env": {k: os.environ.get(k) for k in keys}}

        def stop(self) -> int | None:
            """SIGTERM the guard (forwarded to the command), then SIGKILL the group."""
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(self.grace + 2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.wait(10)
            return self.proc.returncode

    return _RoleActor


class RayWorker:
    """A role running as a Ray actor pinned to its owner's node (same surface as :class:`ForkedWorker`).

    ``actor`` is the Ray actor handle; ``pid`` the role command's pid once ready (the guard's
    before); ``node_id`` the Ray node the actor was placed on.
    """

    def __init__(self, spec: WorkerSpec, actor, ready_dir: Path, env: dict[str, str], node_id: str):
        self.spec, self.actor, self.ready_dir, self.env, self.node_id = spec, actor, ready_dir, env, node_id
        self.info: dict | None = None
        self._returncode: int | None = None
        self._dead = False

    @property
    def pid(self) -> int | None:
        return None if self.info is None else self.info["pid"]

    def _status(self, timeout: float) -> dict:
        import ray

        try:
            return ray.get(self.actor.status.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerStartTimeout(f"ray worker {self.spec.role!r}: actor gave no status within {timeout:.1f}s") from e
        except ray.exceptions.RayActorError as e:
            self._dead = True
            raise WorkerError(f"ray worker {self.spec.role!r}: actor died: {e}") from e

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until the command called :func:`mark_ready`; raises :class:`WorkerError` if it
        (or the actor) dies first, :class:`WorkerStartTimeout` after ``timeout`` (then kills)."""
        limit = self.spec.health_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                st = self._status(max(left, 1.0))
            except WorkerStartTimeout:
                self.kill()
                raise WorkerStartTimeout(f"worker {self.spec.role!r} (ray actor) not ready within {limit:.1f}s") from None
            except WorkerError:
                self.kill()  # the actor died: drop its ready folder too
                raise
            if st["info"] is not None:
                self.info = st["info"]
                return self.info
            if st["code"] is not None:
                self.kill()
                raise WorkerError(f"worker {self.spec.role!r} (ray actor) exited with {st['code']} before ready")
            if left <= 0:
                self.kill()
                raise WorkerStartTimeout(f"worker {self.spec.role!r} (ray actor) not ready within {limit:.1f}s")
            time.sleep(0.05)

    def probe(self, keys: list[str] = ()) -> dict:
        """The actor's node id, pid and the values of ``keys`` in the actor's own environment."""
        import ray

        return ray.get(self.actor.probe.remote(list(keys)), timeout=60)

    def alive(self) -> bool:
        """The actor answers and its command runs."""
        if self._dead:
            return False
        try:
            return self._status(30.0)["code"] is None
        except WorkerError:
            return False

    def healthy(self) -> bool:
        """Alive and ready."""
        if self._dead:
            return False
        try:
            st = self._status(30.0)
        except WorkerError:
            return False
        return st["code"] is None and st["info"] is not None

    def kill(self) -> int | None:
        """Stop the command (SIGTERM, then SIGKILL of its group), then ``ray.kill`` the actor;
        idempotent. Returns the command's exit code (None if the actor was already gone)."""
        import ray

        if not self._dead:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._returncode = ray.get(self.actor.stop.remote(), timeout=self.spec.kill_grace_s + 20)
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            self._dead = True
        shutil.rmtree(self.ready_dir, ignore_errors=True)
        return self._returncode


class RayScheduler(_Scheduler):
    """Starts workers as Ray actors on the owner's node (``NodeAffinitySchedulingStrategy``,
    ``soft=False``), fate-sharing with the owner.

    * Environment: the command gets ``merge_env(owner_env, spec.env)`` exactly (removals
      included); the actor process itself gets the non-empty overrides through
      ``runtime_env={"env_vars": ...}``, so Python code in the actor sees them too.
    * GPUs: the actor requests none (it shares the owner's devices, like ``srun --overlap``);
      ``CUDA_VISIBLE_DEVICES`` is set to the owner's physical ids (or the subset
      ``spec.devices``) and ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` keeps Ray from
      rewriting it.
    * Lifecycle: :meth:`RayWorker.kill`, :meth:`shutdown` (also at owner exit) and, when the
      owner dies hard, Ray's owner fate-sharing kill the actor; the guard then kills the
      command's whole process group.

    Needs ``ray`` (imported lazily) and a connected Ray runtime (``ray.init`` called by the
    owner). ``num_cpus``: CPUs each actor reserves (default 0: it runs on the owner's share).
    """

    def __init__(self, *, owner_env: Mapping[str, str] | None = None, num_cpus: float = 0.0,
                 namespace_prefix: str = "colocate"):
        try:
            import ray
        except ImportError as e:
            raise WorkerError("RayScheduler needs the 'ray' package (pip install ray)") from e
        if not ray.is_initialized():
            raise WorkerError("RayScheduler: ray is not initialized in the owner (call ray.init first)")
        if num_cpus < 0:
            raise WorkerError(f"RayScheduler: num_cpus must be >= 0, got {num_cpus!r}")
        super().__init__(owner_env)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.num_cpus = num_cpus
        self.prefix = namespace_prefix

    def fork(self, spec: WorkerSpec, *, wait: bool = True) -> RayWorker:
        """Start ``spec`` in an actor on the owner's node; wait for ready unless ``wait=False``."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        tmp, env = self._prepare(spec)
        actor_env = {k: v for k, v in spec.env.items() if v != ""}
        if "CUDA_VISIBLE_DEVICES" in env:
            actor_env["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        actor_env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if shutil.which(spec.command[0], path=env.get("PATH")) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WorkerError(f"cannot start worker {spec.role!r}: {spec.command[0]!r} not found or not executable")
        if spec.log_path is not None:
            Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        cls = ray.remote(_role_actor_class()).options(
            num_cpus=self.num_cpus, num_gpus=0, max_restarts=0, name=f"{self.prefix}-{spec.role}-{tmp.name}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False),
            runtime_env={"env_vars": actor_env})
        actor = cls.remote(list(spec.command), env, str(tmp / "ready.json"), spec.kill_grace_s, spec.log_path)
        return self._register(RayWorker(spec, actor, tmp, env, self.node_id), wait)


SCHEDULERS = {"local": LocalScheduler, "slurm": SlurmScheduler, "ray": RayScheduler}


def scheduler_for(kind: str | None, **kwargs) -> LocalScheduler | SlurmScheduler | RayScheduler:
    """The scheduler a ``WorkerSpec.scheduler`` names (None: ``local``), built with ``kwargs``."""
    try:
        return SCHEDULERS[kind or "local"](**kwargs)
    except KeyError:
        raise WorkerError(f"unknown scheduler {kind!r}; known: {sorted(SCHEDULERS)}") from None


def kill_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process started with ``start_new_session=True`` outside a scheduler: SIGTERM its
    process group, wait ``grace_s`` for the leader, then SIGKILL the whole group (members that
    outlived the leader included) and reap the leader."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
