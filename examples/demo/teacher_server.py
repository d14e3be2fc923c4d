"""The HTTP-served teacher: a child server started through :mod:`colocate.workers` (per-role
environment, killed with its owner) and the :class:`mopd.backends.HTTPTeacher` that scores on it.

``teacher_server.kind=hf`` runs :mod:`mopd.hf_server` (a transformers model behind SGLang's
``/generate`` contract, CPU); ``sglang`` runs ``sglang.launch_server`` on the same folder (GPU),
Megatron hidden from it (:func:`colocate.sglang_engine.hide_megatron_dir`).
"""

from __future__ import annotations

import http.client
import socket
import sys
import time
from dataclasses import dataclass

from colocate.errors import WorkerStartTimeout
from examples.demo.config import DemoConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def server_command(cfg: DemoConfig, hf_dir: str, port: int) -> tuple[list[str], dict[str, str]]:
    """argv and per-role environment overrides of the server of ``cfg.teacher_server.kind``."""
    env = dict(cfg.teacher_server.env)
    if cfg.teacher_server.kind == "hf":
        return [sys.executable, "-m", "mopd.hf_server", "--model-dir", hf_dir, "--port", str(port)], env
    import os

    from colocate.sglang_clients import server_args_to_cli
    from colocate.sglang_engine import hide_megatron_dir, sglang_engine_args

    args = sglang_engine_args(hf_dir, cuda_graph=False, memory_saver=False,
                              mem_fraction_static=cfg.teacher_server.mem_fraction_static, dtype="bfloat16",
                              max_total_tokens=8192, random_seed=cfg.seed)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (hide_megatron_dir(), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
            *server_args_to_cli(args)], env


@dataclass
class TeacherServer:
    """A running teacher server: its URL and the worker (``pid``, ``kill``) of its scheduler."""

    url: str
    worker: object
    scheduler: object

    def stop(self) -> None:
        """Kill the server's whole process group (idempotent)."""
        self.scheduler.shutdown()


def start_teacher_server(cfg: DemoConfig, hf_dir: str, *, log_path: str | None = None) -> TeacherServer:
    """Start the server on ``hf_dir`` and wait for ``/health``. A server that exits first raises
    :class:`colocate.errors.WorkerError`, one not healthy in time :class:`WorkerStartTimeout`
    (both after killing it)."""
    from colocate.config import WorkerSpec
    from colocate.errors import WorkerError
    from colocate.workers import LocalScheduler

    port = _free_port()
    cmd, env = server_command(cfg, hf_dir, port)
    scheduler = LocalScheduler()
    timeout = cfg.teacher_server.start_timeout_s
    worker = scheduler.fork(WorkerSpec(role="teacher", command=cmd, env=env, health_timeout_s=timeout,
                                       kill_grace_s=1.0, log_path=log_path), wait=False)  # no state to flush
    deadline = time.monotonic() + timeout
    try:
        while not _healthy(port):
            if not worker.alive():
                raise WorkerError(f"teacher server ({cfg.teacher_server.kind}) exited with "
                                  f"{worker.proc.returncode} before /health answered; log: {log_path}")
            if time.monotonic() > deadline:
                raise WorkerStartTimeout(f"teacher server ({cfg.teacher_server.kind}) not healthy within "
                                         f"teacher_server.start_timeout_s={timeout}s; log: {log_path}")
            time.sleep(0.1)
    except BaseException:
        scheduler.shutdown()
        raise
    return TeacherServer(url=f"http://127.0.0.1:{port}", worker=worker, scheduler=scheduler)


def http_teacher(cfg: DemoConfig, teacher_id: str, url: str, vocab_size: int):
    """The :class:`mopd.backends.HTTPTeacher` of ``teacher_id`` on ``url`` (the reference server
    scales log-probs by the request temperature; SGLang does not, so it needs τ = 1)."""
    from mopd.backends import HTTPTeacher

    return HTTPTeacher(teacher_id, url, temperature=cfg.mopd.temperature, timeout_s=cfg.teacher_server.timeout_s,
                       max_retries=cfg.teacher_server.max_retries, retry_backoff_s=0.2, max_batch=64,
                       server_scales_temperature=cfg.teacher_server.kind == "hf", vocab_size=vocab_size)
