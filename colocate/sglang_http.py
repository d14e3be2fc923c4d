"""SGLang HTTP server adapter: the receiver and residency surface of
:class:`~colocate.sglang_engine.SGLangEngine`, over a running ``sglang.launch_server``.

The server's HTTP contract (SGLang 0.5.17, ``sglang/srt/entrypoints/http_server.py``) as used here:

=====================================  ================================================================
``GET /health``                        200 once the server serves
``GET /server_info``                   ``tp_size`` (one tensor payload per TP rank)
``GET /model_info``                    ``weight_version`` (a string; ours are decimal integers)
``POST /update_weights_from_tensor``   ``{serialized_named_tensors: [base64 per TP rank], load_format,
                                       flush_cache}`` → ``{success, message}``; each payload is a
                                       ``ForkingPickler`` dump of ``[(hf_name, tensor), ...]``, so a
                                       CUDA tensor crosses as an IPC handle (server on the same node)
``POST /update_weights_from_disk``     ``{model_path, weight_version}``; SGLang rolls back a failed load
``POST /update_weight_version``        ``{new_version, abort_all_requests}``
``POST /weights_checker``              ``{action: "checksum"}`` → ``per_engine_checksum``
``POST /release_memory_occupation``    ``{tags: [...]}``; ``/resume_memory_occupation`` likewise
``POST /flush_cache``                  empties the radix cache
``POST /generate``                     ``{input_ids, sampling_params, return_logprob,
                                       logprob_start_len}`` → one output dict per prompt
=====================================  ================================================================

The ``begin/end_weight_update`` bracket (SGLang ≥ 0.5.21) is feature-detected from the server's
``/openapi.json`` route list (route names assumed to follow the ``Engine`` method names; 0.5.17
has neither). Errors: a refused connection → :class:`~colocate.transports.ReceiverDied`, no
answer in time → :class:`~colocate.transports.ReceiverTimeout`, an HTTP error or
``success: false`` → :class:`~colocate.engines.UpdateError`. As with the in-process adapter,
SGLang acknowledges a load before its copies finish (``unsynced_acks``) and ``end_update`` reads
the weight checksum, which synchronizes the scheduler.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions (shared memory, CUDA IPC)

from colocate.buckets import Entry, unpack_bucket
from colocate.config import HFModelSpec
from colocate.convert import check_params, hf_param_specs
from colocate.engines import UpdateError
from colocate.residency import ENGINE_TAGS, Residency
from colocate.sglang_engine import logprobs_of_prompt, sglang_named_tensors, sglang_process_env
from colocate.transports import ReceiverDied, ReceiverTimeout

__all__ = ["SGLangHTTPEngine", "kill_process_group", "serialize_named_tensors", "server_args_to_cli"]


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


class SGLangHTTPEngine:
    """Receiver + residency adapter over an SGLang HTTP server at ``base_url`` (see module
    docstring). ``ipc``: ``"cuda"`` (tensors must be on the GPU; the real server) or ``"cpu"``
    (shared-memory CPU tensors; servers that implement the contract on CPU)."""

    unsynced_acks = True
    verifies_checksums = False

    def __init__(self, base_url: str, *, spec: HFModelSpec, dtype: torch.dtype = torch.bfloat16,
                 timeout_s: float = 600.0, ipc: str = "cuda", process: subprocess.Popen | None = None):
        if ipc not in ("cuda", "cpu"):
            raise ValueError(f"SGLangHTTPEngine ipc must be 'cuda' or 'cpu', got {ipc!r}")
        if not timeout_s > 0:
            raise ValueError(f"SGLangHTTPEngine timeout_s must be > 0, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self.spec, self.dtype, self.timeout_s, self.ipc = spec, dtype, timeout_s, ipc
        self.process = process
        self._specs = hf_param_specs(spec, dtype=dtype)
        self._open: int | None = None
        self.last_checksum: str | None = None
        self.tp_size = int(self._get("/server_info").get("tp_size", 1))
        routes = self._routes()
        self.has_bracket = {"/begin_weight_update", "/end_weight_update"} <= routes

        def hook(op: str, tag: str):
            def run() -> int:
                free0 = self._free_bytes()
                self._post(f"/{op}_memory_occupation", {"tags": [tag]})
                return abs(self._free_bytes() - free0)
            return run

        self.residency = Residency({t: (hook("release", t), hook("resume", t)) for t in ENGINE_TAGS},
                                   owner="sglang-http")

    # ----- HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None, timeout: float | None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except TimeoutError as e:
            raise ReceiverTimeout(f"SGLang server {self.base_url} gave no answer to {method} {path} within "
                                  f"{timeout or self.timeout_s:.1f}s") from e
        except (urllib.error.URLError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise ReceiverTimeout(f"SGLang server {self.base_url}: {method} {path} timed out") from e
            raise ReceiverDied(f"SGLang server {self.base_url} unreachable for {method} {path}: {reason}") from e
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        return status, payload

    def _check(self, method: str, path: str, status: int, payload: Any) -> Any:
        failed = status >= 400 or (isinstance(payload, dict) and payload.get("success") is False)
        if failed:
            msg = payload
            if isinstance(payload, dict):
                msg = payload.get("message") or (payload.get("error") or {}).get("message") or payload
            raise UpdateError(f"SGLang {method} {path} failed (HTTP {status}): {msg}")
        return payload

    def _get(self, path: str, *, timeout: float | None = None) -> Any:
        return self._check("GET", path, *self._request("GET", path, None, timeout))

    def _post(self, path: str, body: dict, *, timeout: float | None = None) -> Any:
        return self._check("POST", path, *self._request("POST", path, body, timeout))

    def _routes(self) -> set[str]:
        status, payload = self._request("GET", "/openapi.json", None, None)
        if status != 200 or not isinstance(payload, dict):
            return set()  # docs disabled: assume no bracket (0.5.17 behaviour)
        return set(payload.get("paths", {}))

    def _free_bytes(self) -> int:
        if self.ipc == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[0]
        return 0

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout``."""
        try:
            return self._request("GET", "/health", None, timeout)[0] == 200
        except (ReceiverDied, ReceiverTimeout):
            return False

    def checksum(self) -> str:
        """The server's weight checksum (``/weights_checker``, action ``checksum``)."""
        r = self._post("/weights_checker", {"action": "checksum"})
        return str(r.get("per_engine_checksum"))

    # ----- receiver surface ---------------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        return frozenset({"cuda_ipc" if self.ipc == "cuda" else "shm"})

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def weight_version(self) -> int | None:
        """The server's ``weight_version`` as an int (None when it is not one of ours)."""
        v = self._get("/model_info").get("weight_version")
        try:
            return int(v)
        except (TypeError, ValueError):
            return None

    def begin_update(self, version: int) -> None:
        self.residency.require("weights")
        if self.has_bracket:
            self._post("/begin_weight_update", {})
        self._open = version

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None:
        if self._open is None:
            raise UpdateError("load without begin_update")
        if (self.ipc == "cuda") != buffer.is_cuda:
            raise UpdateError(f"this server takes {'CUDA' if self.ipc == 'cuda' else 'CPU'} tensors, got a buffer "
                              f"on {buffer.device}")
        named = list(unpack_bucket(buffer, entries).items())
        check_params({n: (tuple(t.shape), t.dtype) for n, t in named}, self._specs, require_all=False)
        named = sglang_named_tensors(named, self.spec)
        # one payload per TP rank (each rank opens and releases its own handles)
        payloads = [serialize_named_tensors(named) for _ in range(self.tp_size)]
        self._post("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                   "load_format": None, "flush_cache": False})

    def end_update(self, version: int, checksums: dict[str, int] | None = None) -> None:
        if self._open != version:
            raise UpdateError(f"end_update({version}) without a matching begin_update (open: {self._open})")
        if self.has_bracket:
            self._post("/end_weight_update", {})
        if self.residency.is_resident("kv_cache"):
            self._post("/flush_cache", {})
        self.last_checksum = self.checksum()  # also: scheduler-side device sync
        self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self._open = None

    def abort_update(self, version: int) -> None:
        if self._open == version:
            if self.has_bracket:
                self._post("/end_weight_update", {})
            self._open = None
            # weights may be half-updated: no version is valid
            self._post("/update_weight_version", {"new_version": "poisoned", "abort_all_requests": False})

    def restore_from_disk(self, model_path: str, *, version: int | None = None) -> None:
        """Reload weights from an HF checkpoint folder on the server's file system (SGLang rolls
        back a failed load)."""
        self._post("/update_weights_from_disk", {"model_path": model_path,
                                                 "weight_version": None if version is None else str(version)})
        if version is None:
            self._post("/update_weight_version", {"new_version": "disk", "abort_all_requests": False})

    # ----- residency and rollout ----------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        return self.residency.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        return self.residency.resume(tags)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16, temperature: float = 0.0,
                 return_logprob: bool = True, seed: int | None = None) -> list[dict]:
        """Token-in/token-out generation (``POST /generate``); one output dict per prompt
        (``output_ids``, ``meta_info.output_token_logprobs``)."""
        with self.residency.busy():
            params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                      "ignore_eos": True}
            if seed is not None:
                params["sampling_seed"] = seed
            out = self._post("/generate", {"input_ids": [list(map(int, p)) for p in prompts],
                                           "sampling_params": params, "return_logprob": return_logprob})
        return out if isinstance(out, list) else [out]

    def prompt_logprobs(self, prompt: Sequence[int]) -> list[float]:
        """Log-probabilities the server assigns to tokens 1..T-1 of ``prompt``."""
        with self.residency.busy():
            out = self._post("/generate", {"input_ids": list(map(int, prompt)), "return_logprob": True,
                                           "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        out = out[0] if isinstance(out, list) else out
        return logprobs_of_prompt(out["meta_info"]["input_token_logprobs"], prompt)

    # ----- launching ----------------------------------------------------------------------------
    @classmethod
    def launch(cls, *, spec: HFModelSpec, param_dtype: torch.dtype = torch.bfloat16, port: int | None = None,
               start_timeout_s: float = 300.0, log_path: str | None = None, env: dict[str, str | None] | None = None,
               timeout_s: float = 600.0, hide_megatron: bool = True, **server_args: Any) -> SGLangHTTPEngine:
        """Start ``python -m sglang.launch_server`` (own process group; ``server_args`` as for
        ``sglang.Engine``, its ``dtype`` included; ``param_dtype`` is the dtype the publisher
        sends; the environment is :func:`~colocate.sglang_engine.sglang_process_env` of ``env``,
        which hides Megatron from the server unless ``hide_megatron=False``), wait until
        ``/health`` answers, and connect. :meth:`shutdown` stops it."""
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
               *server_args_to_cli(server_args)]
        full_env = sglang_process_env(env, hide_megatron=hide_megatron)
        log = open(log_path or os.devnull, "w")  # noqa: SIM115 - owned by the process's lifetime
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)
        log.close()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        probe = urllib.request.Request(url + "/health")
        while True:
            if proc.poll() is not None:
                raise ReceiverDied(f"sglang.launch_server exited during start (exit {proc.returncode}); "
                                   f"log: {log_path}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                kill_process_group(proc)
                raise ReceiverTimeout(f"sglang.launch_server not healthy within {start_timeout_s:.0f}s; log: {log_path}")
            time.sleep(1.0)
        try:
            return cls(url, spec=spec, dtype=param_dtype, timeout_s=timeout_s, process=proc)
        except BaseException:
            kill_process_group(proc)
            raise

    def shutdown(self) -> None:
        """Stop the server if :meth:`launch` started it (its whole process group)."""
        if self.process is not None:
            kill_process_group(self.process)
            self.process = None


def kill_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM its process group, wait
    ``grace_s`` for the leader, then SIGKILL the whole group (members that outlived the leader,
    e.g. SGLang's scheduler and detokenizer, included) and reap the leader."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
