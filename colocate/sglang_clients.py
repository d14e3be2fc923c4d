"""Two thin clients of one SGLang engine, for :class:`colocate.sglang_engine.SGLangEngine`.

Both offer the same calls, named after SGLang's ``Engine`` methods, and raise
:class:`~colocate.errors.UpdateError` when SGLang reports a failure:

* :class:`EngineClient` — an in-process ``sglang.Engine`` (its calls have no timeouts of their own;
  ``call_timeout_s`` bounds each one, see the class).
* :class:`HTTPClient` — a running ``sglang.launch_server``; every request has one deadline over
  the whole exchange (connect, send, headers, body), so a server that trickles its answer fails
  with :class:`~colocate.errors.ReceiverTimeout` in time. A refused or broken connection raises
  :class:`~colocate.errors.ReceiverDied`, an HTTP error or ``success: false`` ``UpdateError``.
  :meth:`HTTPClient.launch` starts the server as a guarded colocated worker
  (:mod:`colocate.workers`), so it dies with its owner, even a SIGKILLed one.

The HTTP contract used (SGLang 0.5.17, ``sglang/srt/entrypoints/http_server.py``):

=====================================  ================================================================
``GET /health``                        200 once the server serves
``GET /server_info``                   ``tp_size`` (one tensor payload per TP rank); ``internal_states[0]
                                       .memory_usage`` (GiB of ``weight``, ``kvcache``, ``graph`` per
                                       phase, SGLang's own accounting; :func:`tag_bytes_of`)
``GET /model_info``                    ``weight_version`` (a string; ours are decimal integers)
``POST /update_weights_from_tensor``   ``{serialized_named_tensors: [base64 per TP rank], load_format,
                                       flush_cache}`` → ``{success, message}``; each payload is a
                                       ``ForkingPickler`` dump of ``[(hf_name, tensor), ...]``, or
                                       with ``load_format="flattened_bucket"`` of
                                       :func:`flattened_bucket`'s dict, so a CUDA tensor crosses
                                       as an IPC handle (server on the same node)
``POST /update_weights_from_disk``     ``{model_path, weight_version}``; SGLang rolls back a failed load
``POST /update_weight_version``        ``{new_version, abort_all_requests}``
``POST /weights_checker``              ``{action: "checksum"}`` → ``per_engine_checksum``
``POST /release_memory_occupation``    ``{tags: [...]}``; ``/resume_memory_occupation`` likewise
``POST /flush_cache``                  empties the radix cache
``POST /generate``                     ``{input_ids, sampling_params, return_logprob,
                                       logprob_start_len}`` → one output dict per prompt
=====================================  ================================================================

The ``begin/end_weight_update`` bracket (SGLang ≥ 0.5.21) is feature-detected: on the engine by
its methods, on the server from ``/openapi.json`` (route names assumed to follow the ``Engine``
method names; 0.5.17 has neither).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import types
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions (shared memory, CUDA IPC)

from colocate.config import WorkerSpec
from colocate.errors import ConfigError, EngineStartError, ReceiverDied, ReceiverTimeout, UpdateError
from colocate.residency import allocator_config
from colocate.workers import LocalScheduler, merge_env

__all__ = ["EngineClient", "HTTPClient", "LAUNCHER_ENV", "log_tail", "serialize_named_tensors", "server_args_to_cli",
           "sglang_checksum", "sglang_env_overrides", "engine_devices", "flattened_bucket"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
"""Period of the progress line while a server start waits for ``/health``."""

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The per-rank variables torchrun sets for its workers (with every ``TORCHELASTIC_*``); they
describe the trainer's rank, not an SGLang process, and :func:`sglang_env_overrides` removes them."""


def sglang_env_overrides(owner_env: Mapping[str, str], env: Mapping[str, str | None] | None = None, *,
                         hide_megatron: bool = True) -> dict[str, str | None]:
    """The environment overrides (``None`` removes a variable) over ``owner_env`` that every SGLang
    process started here gets, the server (:meth:`HTTPClient.launch`) and the in-process engine's
    spawned schedulers (:meth:`EngineClient.launch`) alike:

    1. the launcher's per-rank variables of the owner removed (:data:`LAUNCHER_ENV` and every
       ``TORCHELASTIC_*``). torchrun gives its workers ``TORCHELASTIC_USE_AGENT_STORE=True``, and
       with it torch's ``tcp://`` rendezvous makes *every* rank a client of a store it expects the
       agent to host: SGLang 0.5.17's schedulers join their own ``tcp://127.0.0.1:<port>`` group
       that way (``srt/distributed/bootstrap.py``), so under a torchrun owner nobody serves that
       store and the start blocks until torch's rendezvous timeout;
    2. ``env``, the role's overrides (they may put a removed variable back);
    3. with ``hide_megatron``, :func:`~colocate.sglang_engine.hide_megatron_dir` first on ``PYTHONPATH``."""
    out: dict[str, str | None] = {k: None for k in owner_env if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    out.update(env or {})
    if hide_megatron:
        from colocate.sglang_engine import hide_megatron_dir

        path = out["PYTHONPATH"] if "PYTHONPATH" in out else owner_env.get("PYTHONPATH")
        out["PYTHONPATH"] = os.pathsep.join(p for p in (hide_megatron_dir(), path) if p)
    return out


@contextlib.contextmanager
def _scoped_environ(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Apply ``overrides`` (``None`` removes) to ``os.environ`` for the block, then put back the
    previous values of exactly those variables."""
    saved = {k: os.environ.get(k) for k in overrides}
    try:
        _set_environ(overrides)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: Mapping[str, str | None]) -> None:
    """Set each variable of ``values`` in ``os.environ``; ``None`` removes it."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _ok(result: Any) -> tuple[bool, str]:
    """SGLang's ``(success, message)`` in any of the shapes its methods return."""
    if isinstance(result, tuple | list):
        return bool(result[0]), str(result[1] if len(result) > 1 else "")
    if isinstance(result, dict):
        return bool(result.get("success", True)), str(result.get("message", ""))
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))


def tag_bytes_of(server_info: Mapping[str, Any]) -> dict[str, int]:
    """Bytes per residency tag (``weights``, ``kv_cache``, ``cuda_graph``) by SGLang's own
    accounting in a server-info dict (``Engine.get_server_info()`` / ``GET /server_info``):
    ``internal_states[0]["memory_usage"]`` holds GiB of ``weight`` (free memory taken by the
    load), ``kvcache`` (K and V buffers) and ``graph`` (per capture phase), rounded to 1 MiB by
    SGLang. Per GPU of the first scheduler. Raises :class:`ConfigError` when it is missing (SGLang
    before the accounting existed)."""
    try:
        usage = server_info["internal_states"][0]["memory_usage"]
        gib = {"weights": usage["weight"], "kv_cache": usage["kvcache"],
               "cuda_graph": sum((usage.get("graph") or {}).values())}
    except (KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"SGLang server info has no internal_states[0].memory_usage "
                          f"{{weight, kvcache, graph}} ({type(e).__name__}: {e})") from e
    return {tag: round(float(v) * 2**30) for tag, v in gib.items()}


def sglang_checksum(engine: Any) -> str:
    """The engine's weight checksum (SGLang's ``check_weights`` action ``checksum``)."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    r = engine.loop.run_until_complete(
        engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None))
    return str(r[-1] if isinstance(r, tuple | list) else r)


def flattened_bucket(buffer: torch.Tensor, entries: Sequence[Any]) -> dict[str, Any]:
    """SGLang's ``load_format="flattened_bucket"`` payload for tensors at byte offsets of one
    buffer (a packed bucket, or a trainer storage sent in place): ``{"flattened_tensor": the
    buffer as bytes, "metadata": [name, shape, dtype, start_idx, end_idx, numel (bytes)]}``.
    SGLang rebuilds the tensors as views of the buffer (``FlattenedTensorBucket``), so one CUDA
    IPC handle and one event cross instead of one per tensor. The metadata are
    ``types.SimpleNamespace`` objects: SGLang reads them by attribute, and its unpickler
    (``SafeUnpickler``) admits ``types`` and ``torch`` classes, none of ours. ``entries``:
    objects with ``name``, ``shape``, ``dtype``, ``offset`` (:class:`~colocate.buckets.Entry`)."""
    flat = buffer.view(torch.uint8).reshape(-1)
    meta = []
    for e in entries:
        n = e.dtype.itemsize
        for x in e.shape:
            n *= int(x)
        meta.append(types.SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype,
                                          start_idx=int(e.offset), end_idx=int(e.offset) + n, numel=n))
    return {"flattened_tensor": flat, "metadata": meta}


def _dump(obj: Any) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One ``update_weights_from_tensor`` payload: a ``ForkingPickler`` dump (tensors cross as
    CUDA IPC / shared-memory handles, not bytes), base64-encoded for the JSON body."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def server_args_to_cli(kwargs: dict[str, Any]) -> list[str]:
    """``sglang.Engine``-style keyword arguments → ``sglang.launch_server`` flags
    (``tp_size=2`` → ``--tp-size 2``; ``True`` → bare flag; ``False``/``None`` → omitted;
    lists → one flag, several values)."""
    out: list[str] = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, list | tuple):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def engine_devices(server_args: dict[str, Any], devices: Sequence[int] | None) -> list[int] | None:
    """The owner's logical GPUs an SGLang server gets, and ``server_args`` fixed to match.

    The server is started with ``CUDA_VISIBLE_DEVICES`` of exactly those GPUs (mapped to physical
    ids through the owner's, see :class:`~colocate.config.WorkerSpec`), so its ``base_gpu_id``
    becomes 0 whatever the owner's numbering (a Slurm step, a Ray actor that sees one GPU as
    ``cuda:0``). ``base_gpu_id`` in ``server_args`` (the owner's logical id) picks
    ``tp_size · dp_size`` GPUs from there when ``devices`` is None. Neither: None (the server
    sees the owner's devices and SGLang's defaults apply). Edits ``server_args`` in place."""
    base = server_args.pop("base_gpu_id", None)
    need = int(server_args.get("tp_size", 1)) * int(server_args.get("dp_size", 1))
    if devices is None and base is None:
        return None
    if devices is not None and base not in (None, 0):
        raise ConfigError(f"SGLang launch: pass devices={list(devices)} or base_gpu_id={base}, not both "
                          "(with devices the server sees only those GPUs, from its cuda:0)")
    devices = list(range(int(base), int(base) + need)) if devices is None else list(devices)
    if len(devices) < need:
        raise ConfigError(f"SGLang launch: devices={devices} holds fewer than tp_size·dp_size={need} GPUs")
    server_args["base_gpu_id"] = 0
    return devices


class EngineClient:
    """An in-process ``sglang.Engine`` (``checksum_fn``: stands in for :func:`sglang_checksum`).
    Its weight version is kept here (the engine has no version of its own in 0.5.17).

    ``call_timeout_s``: the deadline of each engine call (None: none). The engine's calls block
    on its asyncio loop until the scheduler answers; with a deadline each runs in a helper thread
    and a call that does not return in time raises :class:`~colocate.errors.ReceiverTimeout`
    (a hung or SIGKILLed scheduler: nothing answers). The engine is unusable after that (its
    loop is still inside the abandoned call): later calls raise
    :class:`~colocate.errors.ReceiverDied` and only :meth:`shutdown` runs. A scheduler that
    *raises* makes SGLang kill the owning process itself (its SIGQUIT handler), which no
    deadline can turn into an exception: run the engine as a server
    (:meth:`HTTPClient.launch`) where the owner must survive a crashed engine."""

    ipc = "cuda"
    owner = "sglang"

    def __init__(self, engine: Any, *, checksum_fn: Any = None, call_timeout_s: float | None = None):
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ConfigError(f"EngineClient call_timeout_s must be > 0 or None, got {call_timeout_s!r}")
        self.engine = engine
        self._checksum = checksum_fn or sglang_checksum
        self._version: str | None = None
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        """Why the engine cannot be called any more (a call that missed its deadline), or None."""
        self.tp_size = int(getattr(getattr(engine, "server_args", None), "tp_size", 1) or 1)
        self.has_bracket = hasattr(engine, "begin_weight_update") and hasattr(engine, "end_weight_update")
        self.allocator = allocator_config()  # SGLang's schedulers inherit this process's environment

    @classmethod
    def launch(cls, *, hide_megatron: bool = True, call_timeout_s: float | None = None,
               start_timeout_s: float | None = None, **engine_kwargs: Any) -> EngineClient:
        """Start ``sglang.Engine(**engine_kwargs)`` (lazy import). With ``hide_megatron`` the engine
        starts with :func:`~colocate.sglang_engine.hide_megatron_dir` first on ``sys.path``, which
        SGLang's spawned processes inherit; this process's ``sys.path`` is restored at once. The
        processes it spawns inherit this process's environment less the launcher's per-rank
        variables (:func:`sglang_env_overrides`, applied to ``os.environ`` during the start only).

        A start that raises (e.g. no checkpoint at ``model_path``; SGLang's own start-up raises
        when a process it spawned dies) raises :class:`~colocate.errors.EngineStartError`, after
        the processes the engine had started (this process's new children and their
        descendants) were killed. ``start_timeout_s`` (None: none) bounds the start: SGLang's
        ``Engine(...)`` waits for its schedulers as long as they live, so at the deadline those
        processes are SIGKILLed (no SIGQUIT reaches this process), SGLang's wait notices within
        its 5 s poll and raises, and the start fails with ``EngineStartError`` naming the deadline.
        The start runs in the calling thread (SGLang registers signal handlers there)."""
        import sglang

        from colocate.sglang_engine import hide_megatron_dir

        shadow = hide_megatron_dir() if hide_megatron else None
        if start_timeout_s is not None and not start_timeout_s > 0:
            raise ConfigError(f"EngineClient start_timeout_s must be > 0 or None, got {start_timeout_s!r}")
        if shadow is not None:
            sys.path.insert(0, shadow)
        before = _children(os.getpid())
        guard = _StartDeadline(before, start_timeout_s)
        where = f"sglang.Engine(model_path={engine_kwargs.get('model_path')!r})"
        t0 = time.monotonic()
        logger.info("%s: starting (start_timeout_s=%s)", where, start_timeout_s)
        try:
            with _scoped_environ(sglang_env_overrides(os.environ, hide_megatron=False)):
                engine = sglang.Engine(**engine_kwargs)
            if not guard.finish():  # the deadline fired as the start returned: its processes are gone
                with contextlib.suppress(Exception):
                    engine.shutdown()
                raise TimeoutError("the start completed only after its deadline")
        except Exception as e:  # noqa: BLE001 - any start failure becomes one typed error
            guard.finish()
            started = _kill_new_children(before) or guard.killed
            why = (f"not started within start_timeout_s={start_timeout_s}s (its processes were SIGKILLed at the "
                   f"deadline); then {type(e).__name__}: {e}") if guard.fired else f"failed to start: {type(e).__name__}: {e}"
            raise EngineStartError(f"{where} {why}" + (f" (killed the {started} process(es) it had started)"
                                                       if started else "")) from e
        finally:
            if shadow is not None and shadow in sys.path:
                sys.path.remove(shadow)
        logger.info("%s: started in %.1fs", where, time.monotonic() - t0)
        return cls(engine, call_timeout_s=call_timeout_s)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` within :attr:`call_timeout_s` (see the class docstring)."""
        if self.broken is not None:
            raise ReceiverDied(f"sglang engine unusable ({self.broken}); shut it down and start another")
        if self.call_timeout_s is None:
            return fn(*args, **kwargs)
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"sglang-{what}", daemon=True).start()
        if not done.wait(self.call_timeout_s):
            self.broken = f"{what} did not return within {self.call_timeout_s:.1f}s"
            raise ReceiverTimeout(f"sglang engine: {self.broken} (scheduler hung or dead)")
        if "error" in box:
            raise box.pop("error")
        return box["result"]

    def _checked(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._call(what, fn, *args, **kwargs)
        ok, msg = _ok(result)
        if not ok:
            raise UpdateError(f"sglang {what} failed: {msg}")
        return result

    def begin_weight_update(self) -> None:
        self._checked("begin_weight_update", self.engine.begin_weight_update)

    def end_weight_update(self) -> None:
        self._checked("end_weight_update", self.engine.end_weight_update)

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]], *, flush_cache: bool = False) -> None:
        """One load of HF-named tensors; ``flush_cache``: SGLang flushes its radix cache after the
        load, in the same call (it asserts, in the scheduler, that no request is running)."""
        self._checked("update_weights_from_tensor", self.engine.update_weights_from_tensor, named_tensors=named,
                      load_format=None, flush_cache=flush_cache)

    def update_weights_from_bucket(self, payload: dict[str, Any], *, flush_cache: bool = False) -> None:
        """One load of a :func:`flattened_bucket` payload (``load_format="flattened_bucket"``;
        the engine takes it pre-serialized, one payload per TP rank)."""
        data = [_dump(payload) for _ in range(self.tp_size)]  # one dump per rank: each releases its own handles
        self._checked("update_weights_from_tensor(flattened_bucket)", self.engine.update_weights_from_tensor,
                      named_tensors=data, load_format="flattened_bucket", flush_cache=flush_cache)

    def update_weights_from_disk(self, model_path: str, version: str | None) -> None:
        self._checked(f"update_weights_from_disk({model_path!r})", self.engine.update_weights_from_disk, model_path)
        self._version = version

    def memory_occupation(self, op: str, tag: str) -> None:
        """``release`` or ``resume`` one tag."""
        self._checked(f"{op}_memory_occupation({tag})", getattr(self.engine, f"{op}_memory_occupation"), tags=[tag])

    def flush_cache(self) -> None:
        self._checked("flush_cache", self.engine.flush_cache)

    def checksum(self) -> str:
        return self._call("checksum", self._checksum, self.engine)

    def server_info(self) -> dict:
        return self._call("server_info", self.engine.get_server_info)

    def weight_version(self) -> str | None:
        return self._version

    def set_weight_version(self, version: str | None) -> None:
        self._version = version

    def generate(self, input_ids: list[list[int]], sampling_params: dict, *, return_logprob: bool,
                 logprob_start_len: int | None = None) -> list[dict]:
        extra = {} if logprob_start_len is None else {"logprob_start_len": logprob_start_len}
        return self._call("generate", self.engine.generate, input_ids=input_ids, sampling_params=sampling_params,
                          return_logprob=return_logprob, **extra)

    def shutdown(self) -> None:
        self.engine.shutdown()


class HTTPClient:
    """A running SGLang server at ``base_url`` (see the module docstring). ``ipc``: ``"cuda"``
    (tensors must be on the GPU; the real server) or ``"cpu"`` (shared-memory CPU tensors;
    servers that implement the contract on CPU). ``timeout_s``: the deadline of each request.
    ``worker``: the :mod:`colocate.workers` worker running the server (:meth:`launch`);
    :meth:`shutdown` kills it. ``allocator``: the server process's allocator settings, for the
    residency logs (unknown for a server started elsewhere)."""

    owner = "sglang-http"

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, ipc: str = "cuda", worker: Any = None,
                 allocator: str | None = None):
        if ipc not in ("cuda", "cpu"):
            raise ConfigError(f"SGLang HTTP client ipc must be 'cuda' or 'cpu', got {ipc!r}")
        if not timeout_s > 0:
            raise ConfigError(f"SGLang HTTP client timeout_s must be > 0, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        url = urllib.parse.urlsplit(self.base_url)
        self._conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._prefix = url.hostname, url.port, url.path
        self.timeout_s, self.ipc, self.worker = timeout_s, ipc, worker
        self.scheduler = None
        self.allocator = allocator or "unknown (server process)"
        self.tp_size = int(self.get("/server_info").get("tp_size", 1))
        self.has_bracket = {"/begin_weight_update", "/end_weight_update"} <= self._routes()

    # ----- requests -----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None, *,
                timeout: float | None = None) -> tuple[int, Any]:
        """``(status, decoded JSON or text)``, the whole exchange within ``timeout`` (default
        ``timeout_s``): at the deadline the socket is shut down under the blocked read."""
        limit = timeout or self.timeout_s
        deadline = time.monotonic() + limit
        conn = self._conn_cls(self._host, self._port, timeout=limit)
        cut = None
        data = None if body is None else json.dumps(body).encode()
        try:
            conn.connect()
            # the response may detach the socket from conn (HTTP/1.0): keep our own reference
            cut = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn.sock,))
            cut.daemon = True
            cut.start()
            conn.request(method, self._prefix + path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
            if time.monotonic() > deadline:  # the cut made the read end early
                raise TimeoutError
        except TimeoutError as e:
            raise ReceiverTimeout(f"SGLang server {self.base_url} gave no answer to {method} {path} within "
                                  f"{limit:.1f}s") from e
        except (OSError, http.client.HTTPException) as e:
            if time.monotonic() > deadline:
                raise ReceiverTimeout(f"SGLang server {self.base_url}: {method} {path} not answered within "
                                      f"{limit:.1f}s") from e
            raise ReceiverDied(f"SGLang server {self.base_url} unreachable for {method} {path}: {e!r}") from e
        finally:
            if cut is not None:
                cut.cancel()
            conn.close()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def _checked(self, method: str, path: str, body: dict | None, timeout: float | None) -> Any:
        status, payload = self.request(method, path, body, timeout=timeout)
        if status >= 400 or (isinstance(payload, dict) and payload.get("success") is False):
            msg = payload
            if isinstance(payload, dict):
                msg = payload.get("message") or (payload.get("error") or {}).get("message") or payload
            raise UpdateError(f"SGLang {method} {path} failed (HTTP {status}): {msg}")
        return payload

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self._checked("GET", path, None, timeout)

    def post(self, path: str, body: dict, *, timeout: float | None = None) -> Any:
        return self._checked("POST", path, body, timeout)

    def _routes(self) -> set[str]:
        status, payload = self.request("GET", "/openapi.json")
        if status != 200 or not isinstance(payload, dict):
            return set()  # docs disabled: assume no bracket (0.5.17 behaviour)
        return set(payload.get("paths", {}))

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout``."""
        try:
            return self.request("GET", "/health", timeout=timeout)[0] == 200
        except (ReceiverDied, ReceiverTimeout):
            return False

    # ----- the engine's calls ---------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self.post("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self.post("/end_weight_update", {})

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]], *, flush_cache: bool = False) -> None:
        # one payload per TP rank (each rank opens and releases its own handles)
        payloads = [serialize_named_tensors(named) for _ in range(self.tp_size)]
        self.post("/update_weights_from_tensor", {"serialized_named_tensors": payloads, "load_format": None,
                                                  "flush_cache": flush_cache})

    def update_weights_from_bucket(self, payload: dict[str, Any], *, flush_cache: bool = False) -> None:
        """One load of a :func:`flattened_bucket` payload, one base64 copy per TP rank."""
        data = [base64.b64encode(_dump(payload)).decode("ascii") for _ in range(self.tp_size)]
        self.post("/update_weights_from_tensor", {"serialized_named_tensors": data,
                                                  "load_format": "flattened_bucket", "flush_cache": flush_cache})

    def update_weights_from_disk(self, model_path: str, version: str | None) -> None:
        self.post("/update_weights_from_disk", {"model_path": model_path, "weight_version": version})
        if version is None:
            self.set_weight_version("disk")

    def memory_occupation(self, op: str, tag: str) -> None:
        self.post(f"/{op}_memory_occupation", {"tags": [tag]})

    def flush_cache(self) -> None:
        self.post("/flush_cache", {})

    def checksum(self) -> str:
        return str(self.post("/weights_checker", {"action": "checksum"}).get("per_engine_checksum"))

    def server_info(self) -> dict:
        return self.get("/server_info")

    def weight_version(self) -> str | None:
        return self.get("/model_info").get("weight_version")

    def set_weight_version(self, version: str | None) -> None:
        """Stamp the server (None: ``poisoned``, which no caller takes for a version)."""
        self.post("/update_weight_version", {"new_version": "poisoned" if version is None else version,
                                             "abort_all_requests": False})

    def generate(self, input_ids: list[list[int]], sampling_params: dict, *, return_logprob: bool,
                 logprob_start_len: int | None = None) -> list[dict]:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        out = self.post("/generate", body)
        return out if isinstance(out, list) else [out]

    def shutdown(self) -> None:
        """Stop the server if :meth:`launch` started it (its worker's whole process group)."""
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    # ----- launching ----------------------------------------------------------------------------
    @classmethod
    def launch(cls, *, port: int | None = None, start_timeout_s: float = 300.0, log_path: str | None = None,
               env: dict[str, str | None] | None = None, timeout_s: float = 600.0, hide_megatron: bool = True,
               devices: Sequence[int] | None = None, scheduler: Any = None, ipc: str = "cuda", role: str = "rollout",
               server_module: str = "sglang.launch_server", **server_args: Any) -> HTTPClient:
        """Start ``python -m sglang.launch_server`` as a colocated worker of this process and
        connect once ``/health`` answers.

        ``scheduler``: a :mod:`colocate.workers` scheduler (default a new
        :class:`~colocate.workers.LocalScheduler`); the server runs under its guard, so it is
        killed with its whole process group by :meth:`shutdown`, at owner exit, and when the owner
        dies hard. ``env``: the role's overrides (``None`` removes a variable, e.g.
        ``PYTORCH_CUDA_ALLOC_CONF``), applied over the owner's environment less its launcher
        variables; with ``hide_megatron`` Megatron is hidden from the server
        (:func:`sglang_env_overrides`). The start is logged (``logging``: INFO at its begin and
        end, a WARNING every :data:`HEARTBEAT_S` seconds with the elapsed time and the last line
        of ``log_path``); a server that exits first or is not healthy within ``start_timeout_s``
        raises :class:`~colocate.errors.EngineStartError` / :class:`~colocate.errors.ReceiverTimeout`
        with the last lines of ``log_path``, after its worker was killed. ``devices`` / ``base_gpu_id``: see
        :func:`engine_devices`. ``server_args`` as for ``sglang.Engine``; ``server_module``
        replaces ``sglang.launch_server`` (a CPU server implementing the same contract, in tests).
        """
        scheduler = scheduler or LocalScheduler()
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        devices = engine_devices(server_args, devices)
        overrides = {k: "" if v is None else v
                     for k, v in sglang_env_overrides(scheduler.owner_env, env, hide_megatron=hide_megatron).items()}
        cmd = [sys.executable, "-m", server_module, "--host", "127.0.0.1", "--port", str(port),
               *server_args_to_cli(server_args)]
        t0 = time.monotonic()
        logger.info("%s (role %r, port %d): starting (start_timeout_s=%s, log: %s)", server_module, role, port,
                    start_timeout_s, log_path)
        worker = scheduler.fork(WorkerSpec(role=role, command=cmd, env=overrides, devices=devices,
                                           health_timeout_s=start_timeout_s, kill_grace_s=10.0, log_path=log_path),
                                wait=False)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, worker, start_timeout_s, log_path)
            client = cls(url, timeout_s=timeout_s, ipc=ipc, worker=worker,
                         allocator=allocator_config(merge_env(scheduler.owner_env, overrides)))
            client.scheduler = scheduler  # kept alive: its exit hook also stops the server at owner exit
            logger.info("%s (role %r) at %s: healthy in %.1fs", server_module, role, url, time.monotonic() - t0)
            return client
        except BaseException:
            worker.kill()
            raise


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for d in entries:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _kill_new_children(before: set[int], *, reap: bool = True) -> int:
    """SIGKILL this process's children that are not in ``before``, with their descendants;
    returns how many children there were. ``reap=False`` leaves the children's exit status to
    their owner (``multiprocessing`` cannot tell a child reaped elsewhere from one not yet started)."""
    new = _children(os.getpid()) - before
    todo, seen = list(new), set()
    while todo:  # descendants first collected, so none is reparented away before it is found
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(_children(p))
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    for p in new if reap else ():  # reap our own children
        try:
            os.waitpid(p, 0)
        except OSError:
            pass
    return len(new)


class _StartDeadline:
    """SIGKILLs the processes an in-process start spawned (children of this process not in
    ``before``, with their descendants) if :meth:`finish` is not called within ``timeout_s``."""

    def __init__(self, before: set[int], timeout_s: float | None):
        self._before, self._lock = before, threading.Lock()
        self.fired, self.done, self.killed = False, False, 0
        self._timer = None
        if timeout_s is not None:
            self._timer = threading.Timer(timeout_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self.done:
                return
            self.fired = True
            self.killed = _kill_new_children(self._before, reap=False)  # SGLang's wait must see them die

    def finish(self) -> bool:
        """Stop the timer; True when the deadline had not fired."""
        with self._lock:
            self.done = True
        if self._timer is not None:
            self._timer.cancel()
        return not self.fired


def _shut(sock: socket.socket) -> None:
    """Shut a socket down: a read blocked on it returns at once (the request's deadline)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def log_tail(path: str | None, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of the text file at ``path`` (empty when there is none); reads at
    most the last 64 KiB."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (64 << 10)))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _with_tail(msg: str, log_path: str | None) -> str:
    tail = log_tail(log_path)
    return msg + (f"; last {len(tail)} line(s) of the log:\n" + "\n".join("  | " + ln for ln in tail) if tail
                  else "; the log is empty")


def _wait_healthy(url: str, worker: Any, timeout_s: float, log_path: str | None) -> None:
    """Poll ``GET /health`` until 200; the worker exiting first raises EngineStartError, the
    deadline ReceiverTimeout, both with the last lines of the log (the caller kills the worker).
    Every :data:`HEARTBEAT_S` a warning names the elapsed time and the log's last line."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    heartbeat_s = HEARTBEAT_S
    t0 = time.monotonic()
    deadline, beat = t0 + timeout_s, t0 + heartbeat_s
    what = f"{worker.spec.command[2]} (role {worker.spec.role!r})"
    while True:
        if not worker.alive():
            raise EngineStartError(_with_tail(f"{what} exited during start after {time.monotonic() - t0:.1f}s; "
                                              f"log: {log_path}", log_path))
        conn = http.client.HTTPConnection(host, port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        now = time.monotonic()
        if now > deadline:
            raise ReceiverTimeout(_with_tail(f"{what} not healthy within {timeout_s:.0f}s; log: {log_path}", log_path))
        if now >= beat:
            beat += heartbeat_s
            last = log_tail(log_path, 1)
            logger.warning("%s at %s: waiting for /health, %.0fs of %.0fs; log's last line: %s", what, url, now - t0,
                           timeout_s, last[0] if last else "(empty)")
        time.sleep(0.5)
