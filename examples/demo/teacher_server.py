"""The HTTP-served teacher: a child server started through :mod:`colocate.workers` (per-role
environment, killed with its owner) and the :class:`mopd.backends.HTTPTeacher` that scores on it.

Both kinds start on one path, :class:`colocate.config.SGLangServerConfig` →
:func:`colocate.sglang_engine.sglang_server_launch_args` → :meth:`colocate.sglang_clients.HTTPClient.launch`
(the role's environment: the owner's less its torchrun rank variables, offline hub, Megatron hidden,
``teacher_server.env`` last). ``teacher_server.kind=sglang`` runs ``sglang.launch_server`` on the
teacher's Hugging Face folder (GPU); ``hf`` runs :mod:`mopd.hf_server` in its place (a transformers
model behind SGLang's ``/generate`` contract, CPU; SGLang's flags are ignored there).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from examples.demo.config import DemoConfig

log = logging.getLogger(__name__)

_MODULES = {"hf": "mopd.hf_server", "sglang": "sglang.launch_server"}


def server_config(cfg: DemoConfig, hf_dir: str, log_path: str | None = None):
    """The :class:`colocate.config.SGLangServerConfig` of the teacher server (no CUDA graphs, no
    memory saver: it is never released)."""
    from colocate.config import SGLangServerConfig

    ts = cfg.teacher_server
    return SGLangServerConfig(model_path=hf_dir, role="teacher", mem_fraction_static=ts.mem_fraction_static,
                              max_total_tokens=8192, cuda_graph=False, memory_saver=False, env=dict(ts.env),
                              start_timeout_s=ts.start_timeout_s, request_timeout_s=ts.timeout_s, log_path=log_path)


def launch_args(cfg: DemoConfig, hf_dir: str, log_path: str | None = None) -> dict:
    """:meth:`colocate.sglang_clients.HTTPClient.launch` arguments of ``cfg.teacher_server.kind``."""
    from colocate.sglang_engine import sglang_server_launch_args

    args = sglang_server_launch_args(server_config(cfg, hf_dir, log_path))
    args.update(dtype="bfloat16", random_seed=cfg.seed, server_module=_MODULES[cfg.teacher_server.kind],
                ipc="cpu" if cfg.teacher_server.kind == "hf" else "cuda")
    return args


@dataclass
class TeacherServer:
    """A running teacher server: its URL, the worker (``pid``: its guard, ``kill``) and the client."""

    url: str
    worker: object
    client: object

    def stop(self) -> None:
        """Kill the server's whole process group (idempotent)."""
        self.client.shutdown()


def start_teacher_server(cfg: DemoConfig, hf_dir: str, *, log_path: str | None = None) -> TeacherServer:
    """Start the server on ``hf_dir`` and wait for ``/health`` (a WARNING line at the start, every
    30 s while waiting, and when it serves). A server that exits first raises
    :class:`colocate.errors.WorkerError`, one not healthy within ``teacher_server.start_timeout_s``
    :class:`colocate.errors.WorkerStartTimeout`, both after killing it and with the last lines of
    its log."""
    from colocate.errors import ReceiverDied, ReceiverTimeout, WorkerError, WorkerStartTimeout
    from colocate.sglang_clients import HTTPClient

    kind, timeout = cfg.teacher_server.kind, cfg.teacher_server.start_timeout_s
    log.warning("teacher server (%s) on %s: starting (teacher_server.start_timeout_s=%s, log: %s)", kind, hf_dir,
                timeout, log_path)
    t0 = time.monotonic()
    try:
        client = HTTPClient.launch(**launch_args(cfg, hf_dir, log_path))
    except ReceiverTimeout as e:
        raise WorkerStartTimeout(f"teacher server ({kind}): teacher_server.start_timeout_s={timeout}s passed: {e}") from e
    except ReceiverDied as e:  # EngineStartError: it exited during the start
        raise WorkerError(f"teacher server ({kind}) failed to start: {e}") from e
    log.warning("teacher server (%s) at %s: healthy in %.1fs", kind, client.base_url, time.monotonic() - t0)
    return TeacherServer(url=client.base_url, worker=client.worker, client=client)


def http_teacher(cfg: DemoConfig, teacher_id: str, url: str, vocab_size: int):
    """The :class:`mopd.backends.HTTPTeacher` of ``teacher_id`` on ``url`` (the reference server
    scales log-probs by the request temperature; SGLang does not, so it needs τ = 1)."""
    from mopd.backends import HTTPTeacher

    return HTTPTeacher(teacher_id, url, temperature=cfg.mopd.temperature, timeout_s=cfg.teacher_server.timeout_s,
                       max_retries=cfg.teacher_server.max_retries, retry_backoff_s=0.2, max_batch=64,
                       server_scales_temperature=cfg.teacher_server.kind == "hf", vocab_size=vocab_size)
