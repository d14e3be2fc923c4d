"""Multi-process helpers for tests: spawn N ranks with a hard timeout, seed, init Megatron.

``run_ranks(fn, world_size)`` starts ``world_size`` spawned processes, each of which joins a
process group (gloo on CPU, NCCL when ``backend="nccl"``), enables the CPU compatibility layer
when there is no CUDA, calls ``fn(rank, world_size, *args)`` and sends back its (picklable)
result. A rank that raises makes the call raise with that rank's traceback; a run that exceeds
``timeout`` kills every rank and raises :class:`RankTimeout` — a hang fails a test, never CI.
"""

from __future__ import annotations

import faulthandler
import io
import os
import random
import socket
import time
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
import torch.multiprocessing as mp

from mcore_distill.errors import McoreDistillError

__all__ = ["RankTimeout", "RankFailed", "run_ranks", "seed_all", "init_megatron", "destroy_megatron", "free_port"]


class RankTimeout(McoreDistillError, TimeoutError):
    """Raised when spawned ranks did not finish within the timeout (they are killed)."""


class RankFailed(McoreDistillError, RuntimeError):
    """Raised when a spawned rank raised; carries that rank's traceback text."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and, when present, CUDA) and Megatron's RNG tracker
    if model parallelism is initialized."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def init_megatron(*, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """Initialize Megatron model parallel groups over the current process group and seed."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    seed_all(seed)


def destroy_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _rank_main(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple,
               queue: Any, env: dict[str, str], timeout: float) -> None:
    # A rank still running shortly before the parent's deadline prints every thread's stack.
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            from mcore_distill import cpu_compat

            cpu_compat.enable()
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialize here: torch.multiprocessing would share tensors through file descriptors that
        # die with this process, so a rank exiting before the parent reads would lose its result.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the text
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 180.0,
              backend: str = "gloo", env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level). Raises :class:`RankFailed` with the first failing
    rank's traceback, :class:`RankTimeout` after ``timeout`` seconds (all ranks killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"backend='nccl' needs {world_size} CUDA devices, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, backend, fn, args, queue, dict(env or {}), timeout),
                    daemon=False)  # ranks may start children (async checkpoint writers)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankTimeout(
                    f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in {timeout:.0f}s; "
                    f"finished ranks: {sorted(results)}"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Empty:
                # a rank killed before reporting (e.g. by a signal) would otherwise wait out the timeout
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # let a report already in flight arrive
                    if queue.empty():
                        raise RankFailed(
                            f"{getattr(fn, '__name__', fn)}: rank process exited with code "
                            f"{dead[0].exitcode} before reporting"
                        ) from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
