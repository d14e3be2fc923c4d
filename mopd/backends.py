"""Teacher back-ends behind one protocol, the token batch they score, and teacher shard files.

Log-prob convention (same as Megatron labels = tokens shifted left): for ``input_ids [B, L]``
right-padded to ``lengths [B]``, a teacher returns ``logp [B, L]`` with

    logp[b, t] = log softmax(z_t / τ)[input_ids[b, t+1]]   for score_from[b] ≤ t < lengths[b] − 1

(z_t the logits after reading ``input_ids[b, :t+1]``, τ the rollout temperature) and 0 elsewhere.

Back-ends here: :class:`HTTPTeacher` (SGLang-compatible ``/generate`` server; any architecture)
and :class:`TransformersTeacher` (an in-process torch causal LM, moved between host and device).
The Megatron teacher lives in :mod:`mopd.megatron` (the only module importing Megatron-Core).
"""

from __future__ import annotations

import http.client
import io
import json
import math
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mcore_distill.atomic import atomic_torch_save
from mcore_distill.validate import check_type
from mopd.errors import (
    ConfigError,
    FingerprintMismatchError,
    TeacherServerError,
    TeacherStateError,
    TeacherTimeoutError,
)

__all__ = ["HTTPTeacher", "TeacherBackend", "TokenBatch", "TransformersTeacher", "read_teacher_shard",
           "write_teacher_shard"]


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Right-padded token rows to score.

    ``input_ids [B, L]`` int64, ``lengths [B]`` int64 (valid tokens per row, ≥ 1),
    ``score_from [B]`` int64 (first label position needed, e.g. prompt length − 1; default 0).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    score_from: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_type("TokenBatch.input_ids", self.input_ids, torch.Tensor)
        check_type("TokenBatch.lengths", self.lengths, torch.Tensor)
        check_type("TokenBatch.score_from", self.score_from, torch.Tensor | None)
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        b, L = self.input_ids.shape
        if self.lengths.shape != (b,):
            raise ValueError(f"lengths must be [B]={b}, got shape {tuple(self.lengths.shape)}")
        if b and (int(self.lengths.min()) < 1 or int(self.lengths.max()) > L):
            raise ValueError(f"lengths must be in [1, L={L}], got {self.lengths.tolist()}")
        if self.score_from is not None and self.score_from.shape != (b,):
            raise ValueError(f"score_from must be [B]={b}, got shape {tuple(self.score_from.shape)}")

    @property
    def starts(self) -> torch.Tensor:
        return torch.zeros_like(self.lengths) if self.score_from is None else self.score_from

    def label_mask(self) -> torch.Tensor:
        """``[B, L]`` bool: positions t with a defined teacher log-prob (see module docstring)."""
        t = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return (t[None] < (self.lengths[:, None] - 1)) & (t[None] >= self.starts[:, None])

    def subset(self, indices: torch.Tensor) -> TokenBatch:
        """Rows ``indices`` (trimmed to their longest length)."""
        lengths = self.lengths[indices]
        width = int(lengths.max()) if lengths.numel() else 1
        return TokenBatch(self.input_ids[indices, :width], lengths,
                          None if self.score_from is None else self.score_from[indices])


@runtime_checkable
class TeacherBackend(Protocol):
    """What :class:`mopd.teachers.TeacherPool` drives. Lifecycle methods are called at most
    once per transition and never retried; ``prefetch`` runs on a background thread and may
    only do host-side work (no device work, no collectives)."""

    teacher_id: str

    def prefetch(self) -> None: ...

    def load(self) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def score(self, batch: TokenBatch) -> torch.Tensor: ...

    def close(self) -> None: ...


class _DeadlineSocket:
    """The socket of one HTTP exchange as :mod:`http.client` uses it (``sendall``, ``makefile``,
    ``close``). Every send and receive gets the time left until ``deadline`` (monotonic seconds)
    as its timeout and none starts after it, so the exchange ends by the deadline however the
    server paces its bytes (socket timeouts alone bound each read, not the reply). ``close`` is
    left to the owner of the real socket: http.client closes its side before the body is read."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline reached")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        self._arm()
        return self.sock.recv_into(buf, nbytes)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        return None


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        return self._sock.recv_into(buf)


# Failures of one attempt that a new attempt may not repeat: refused/reset connections, a reply
# cut short or garbled in transit (http.client.HTTPException: IncompleteRead, BadStatusLine, ...).
_TRANSIENT = (OSError, http.client.HTTPException)
_POSITIVE_ROUNDING = 1e-5
"""Largest log-prob above 0 read as rounding of log 1 (and stored as 0); larger ones are refused."""


class HTTPTeacher:
    """Teacher behind an SGLang-compatible HTTP server.

    ``score`` POSTs ``{url}/generate`` with ``input_ids``, ``sampling_params={max_new_tokens,
    temperature}``, ``return_logprob=true`` and per-row ``logprob_start_len``, and reads
    ``meta_info.input_token_logprobs`` (entries ``[logprob, token_id, ...]`` for token
    positions ``start .. len−1`` with ``start = score_from``; SGLang pads entry 0 with None).
    Every returned token id is checked against the request (a misaligned reply raises).

    SGLang's reply contract (read from SGLang 0.5.17's scheduler): entry ``i ≥ 1`` holds
    log softmax(z_{start+i−1})[x_{start+i}] with the *true* token id, but the reported id is
    passed through ``id if id < vocab_size − 1 else 0`` (meant for multimodal hash ids), so
    the last vocabulary id ``vocab_size − 1`` comes back as 0. With ``vocab_size`` given, that
    one substitution is accepted (only for a request id of ``vocab_size − 1``); without it,
    such a reply is refused with an error naming the fix.

    Temperature: the teacher must score at the rollout temperature τ. SGLang (0.5.17: always;
    the request temperature scales only sampling and output-token log-probs) returns *unscaled*
    input-token log-probs, so τ ≠ 1 is refused unless ``server_scales_temperature=True``
    declares that the server returns log softmax(z / τ) for the ``temperature`` sent (e.g.
    :mod:`mopd.hf_server` in its default ``reference`` mode).

    Failures. ``timeout_s`` is the budget of one request (one ``/health`` check, or one
    ``/generate`` of at most ``max_batch`` rows): connecting, sending, waiting, reading, every
    retry and every backoff sleep end within it, however slowly the server sends. A request
    that reaches it raises :class:`TeacherTimeoutError`. Refused or reset connections, replies
    cut short or garbled in transit and HTTP 5xx are retried up to ``max_retries`` times (sleep
    ``retry_backoff_s · 2**i`` before retry ``i + 1``, never past the budget), then raise
    :class:`TeacherServerError`. HTTP 4xx and unusable replies (not UTF-8 JSON, wrong number of
    rows or entries, a misaligned token id, a log-prob that is not a number in [−inf, 0]: NaN,
    +inf, > 0) raise :class:`TeacherServerError` at once. In a :class:`~mopd.teachers.TeacherPool`
    each of these marks the teacher BROKEN. A log-prob of −inf (probability 0) is a valid reply
    and is returned as is. Errors carry text, never the failed attempts' exception objects,
    so nothing of the caller's frames (its tensors) outlives a retry. One connection per
    attempt (``Connection: close``): the forward pass dominates a request, and no attempt
    can read a stale reply of an earlier one. Server memory is managed by the server:
    ``offload``/``onload`` are no-ops. ``server``: an object with ``shutdown()`` this teacher
    owns (the server process it scores against, started by
    :meth:`colocate.SGLangEngine.launch_server`); :meth:`close` shuts it down.
    """

    def __init__(self, teacher_id: str, url: str, *, temperature: float = 1.0, timeout_s: float = 60.0,
                 max_retries: int = 2, retry_backoff_s: float = 0.5, max_batch: int = 64,
                 max_new_tokens: int = 1, server_scales_temperature: bool = False,
                 vocab_size: int | None = None, server: Any = None) -> None:
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
        if temperature != 1.0 and not server_scales_temperature:
            raise ConfigError(
                f"teacher {teacher_id!r}: temperature={temperature!r} needs a server that scales input-token "
                "log-probs by the request temperature (SGLang does not by default); pass "
                "server_scales_temperature=True for such a server")
        if max_new_tokens not in (0, 1):
            raise ValueError(f"max_new_tokens must be 0 or 1, got {max_new_tokens!r}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 2):
            raise ValueError(f"vocab_size must be an int >= 2 or None, got {vocab_size!r}")
        for name, value in (("timeout_s", timeout_s), ("retry_backoff_s", retry_backoff_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"teacher {teacher_id!r}: {name} must be a finite number >= 0, got {value!r}")
        if timeout_s <= 0:
            raise ConfigError(f"teacher {teacher_id!r}: timeout_s must be > 0, got {timeout_s!r}")
        for name, value, low in (("max_retries", max_retries, 0), ("max_batch", max_batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"teacher {teacher_id!r}: {name} must be an int >= {low}, got {value!r}")
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except (ValueError, TypeError, AttributeError):
            parts = port = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"teacher {teacher_id!r}: url must be http(s)://host[:port][/prefix], got {url!r}")
        self._conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._prefix = parts.hostname, port, parts.path.rstrip("/")
        self.vocab_size = vocab_size
        self.teacher_id, self.url = teacher_id, url.rstrip("/")
        self.temperature, self.timeout_s = float(temperature), float(timeout_s)
        self.max_retries, self.retry_backoff_s, self.max_batch = max_retries, float(retry_backoff_s), max_batch
        self.max_new_tokens = max_new_tokens
        self.requests = 0
        self.closed = False
        self.server = server

    @classmethod
    def from_spec(cls, teacher_id: str, spec: Any, *, temperature: float) -> HTTPTeacher:
        """Build from a :class:`mopd.config.TeacherSpec` (``backend='http'``); ``vocab_size`` is
        ``spec.vocab_size`` or else read from ``spec.hf_path``'s ``config.json``."""
        vocab_size = spec.vocab_size
        if vocab_size is None and spec.hf_path:
            cfg = Path(spec.hf_path) / "config.json"
            if cfg.is_file():
                try:
                    vocab_size = json.loads(cfg.read_text()).get("vocab_size")
                except (ValueError, AttributeError) as err:
                    raise ConfigError(f"teacher {teacher_id!r}: {cfg} is not a JSON object: {err}") from None
        return cls(teacher_id, spec.url, temperature=temperature, timeout_s=spec.timeout_s,
                   max_retries=spec.max_retries, retry_backoff_s=spec.retry_backoff_s, max_batch=spec.max_batch,
                   server_scales_temperature=spec.server_scales_temperature, vocab_size=vocab_size)

    # ---- transport -----------------------------------------------------------------------
    def _exchange(self, method: str, path: str, body: bytes | None, deadline: float) -> tuple[int, bytes]:
        """One HTTP exchange on a fresh connection, all of it before ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline reached")
        conn = self._conn_cls(self._host, self._port, timeout=left)  # bounds connect (and a TLS handshake)
        raw = None
        try:
            conn.connect()
            raw = conn.sock
            conn.sock = _DeadlineSocket(raw, deadline)
            conn.request(method, self._prefix + path, body=body,
                         headers={"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()
            if raw is not None:
                raw.close()

    def _request(self, path: str, payload: dict | None) -> Any:
        """``GET path`` (no payload) or ``POST path`` with JSON; the decoded JSON reply.

        Retries, budget and error types as in the class docstring."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        body = None if payload is None else json.dumps(payload).encode()
        method = "GET" if body is None else "POST"
        where = f"teacher {self.teacher_id!r}: {self.url}{path}"
        failures: list[str] = []  # text only: a kept exception would keep this frame and the caller's alive
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = self.retry_backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:
                    failures.append(f"no retry: backoff {pause:.3g}s would pass the budget")
                    break
                time.sleep(pause)
            self.requests += 1
            try:
                status, data = self._exchange(method, path, body, deadline)
            except TimeoutError as err:
                if deadline - time.monotonic() > 0.05:  # the kernel's ETIMEDOUT, not our deadline
                    failures.append(f"{type(err).__name__}: {err}")
                    continue
                raise TeacherTimeoutError(
                    f"{where} timed out: budget timeout_s={self.timeout_s}s spent after {attempt + 1} attempt(s)"
                    + (f"; earlier: {'; '.join(failures)}" if failures else "")) from None
            except _TRANSIENT as err:
                failures.append(f"{type(err).__name__}: {err}")
                continue
            if status >= 500:
                failures.append(f"HTTP {status}: {data[:200]!r}")
                continue
            if status >= 400 or status < 200:
                raise TeacherServerError(f"{where} answered HTTP {status}: {data[:300]!r}")
            try:
                return json.loads(data.decode("utf-8")) if data else None
            except (UnicodeDecodeError, ValueError) as err:
                raise TeacherServerError(f"{where} returned a reply that is not UTF-8 JSON ({err}): "
                                         f"{data[:120]!r}") from None
        attempts = sum(not f.startswith("no retry") for f in failures)
        raise TeacherServerError(f"{where} failed after {attempts} attempt(s) in "
                                 f"{time.monotonic() - start:.2f}s: {'; '.join(failures)}")

    # ---- lifecycle -----------------------------------------------------------------------
    def prefetch(self) -> None:
        return None

    def load(self) -> None:
        """Health check (``GET /health``) with the same retries and budget."""
        self._check_open()
        self._request("/health", None)

    def offload(self) -> None:
        return None

    def onload(self) -> None:
        return None

    def close(self) -> None:
        """Closed for scoring; a ``server`` this teacher owns (e.g. a
        :meth:`colocate.SGLangEngine.launch_server` engine, killed with its process group) is shut down."""
        self.closed = True
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()

    def _check_open(self) -> None:
        if self.closed:
            raise TeacherStateError(f"teacher {self.teacher_id!r} ({self.url}) is closed")

    # ---- scoring -------------------------------------------------------------------------
    def score(self, batch: TokenBatch) -> torch.Tensor:
        """``logp [B, L]`` float32 on the batch's device (see module docstring)."""
        self._check_open()
        b, L = batch.input_ids.shape
        out = torch.zeros(b, L, dtype=torch.float32)
        ids_cpu, lens = batch.input_ids.cpu(), batch.lengths.cpu().tolist()
        # label t is the log-prob of token t + 1; entry 0 (token ``start``) comes back as None
        starts = batch.starts.cpu().tolist()
        todo = [r for r in range(b) if starts[r] < lens[r] - 1]
        for lo in range(0, len(todo), self.max_batch):
            rows = todo[lo: lo + self.max_batch]
            payload = {
                "input_ids": [ids_cpu[r, : lens[r]].tolist() for r in rows],
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature},
                "return_logprob": True,
                "logprob_start_len": [starts[r] for r in rows],
            }
            reply = self._request("/generate", payload)
            if isinstance(reply, dict):
                reply = [reply]
            if not isinstance(reply, list) or len(reply) != len(rows):
                raise TeacherServerError(f"teacher {self.teacher_id!r}: expected {len(rows)} results, got "
                                         f"{type(reply).__name__} of length {len(reply) if hasattr(reply, '__len__') else '?'}")
            for r, item in zip(rows, reply):
                self._fill(out, r, item, ids_cpu[r], lens[r], starts[r])
        return out.to(batch.input_ids.device)

    def _fill(self, out: torch.Tensor, r: int, item: Any, ids: torch.Tensor, length: int, start: int) -> None:
        where = f"teacher {self.teacher_id!r}: row {r}"
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError, IndexError):
            raise TeacherServerError(f"{where} has no meta_info.input_token_logprobs") from None
        if not isinstance(entries, list):
            raise TeacherServerError(f"{where}: input_token_logprobs is {type(entries).__name__}, not a list")
        if len(entries) != length - start:
            raise TeacherServerError(f"{where} got {len(entries)} input log-probs, "
                                     f"expected {length - start} (length {length}, logprob_start_len {start})")
        last_id = None if self.vocab_size is None else self.vocab_size - 1
        for i, e in enumerate(entries):
            pos = start + i
            if not isinstance(e, list | tuple) or len(e) < 2 or not _is_int(e[1]):
                raise TeacherServerError(f"{where} position {pos}: entry {e!r:.80} is not [logprob, token_id, ...]")
            got, want = e[1], int(ids[pos])
            if got != want and not (got == 0 and want == last_id):
                hint = ""
                if got == 0 and last_id is None:
                    hint = (" (SGLang reports the last vocabulary id, vocab_size-1, as 0: if "
                            f"{want} is vocab_size-1, pass vocab_size={want + 1} / set TeacherSpec.vocab_size)")
                raise TeacherServerError(f"{where} position {pos}: server token id "
                                         f"{got} != request id {want} (misaligned log-probs){hint}")
            if i == 0:
                continue  # SGLang always pads the first entry with None
            v = e[0]
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v > _POSITIVE_ROUNDING:
                raise TeacherServerError(f"{where} position {pos}: log-prob {v!r} is not a number in [-inf, 0]")
            out[r, pos - 1] = min(float(v), 0.0)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _labels(batch: TokenBatch) -> torch.Tensor:
    """``labels[b, t] = input_ids[b, t+1]`` (last column repeats the last id; masked anyway)."""
    ids = batch.input_ids
    return torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)


class TransformersTeacher:
    """An in-process teacher: any causal LM ``module(input_ids) -> logits [B, L, V]`` (e.g. a
    transformers model) built by ``factory()`` on the host.

    ``prefetch`` builds the module on the host (weights read from disk there), ``load`` builds
    it if needed and moves it to ``device``, ``offload`` moves it to host memory, ``onload``
    back to ``device``. Scores are log softmax(logits / τ) gathered at the next token.
    """

    def __init__(self, teacher_id: str, factory: Any, *, device: str | torch.device = "cpu",
                 temperature: float = 1.0) -> None:
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
        self.teacher_id, self.factory, self.device, self.temperature = teacher_id, factory, device, temperature
        self.module: torch.nn.Module | None = None
        self.on_device = False

    def _build(self) -> torch.nn.Module:
        module = self.factory().eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return module

    def prefetch(self) -> None:
        if self.module is None:
            self.module = self._build()

    def load(self) -> None:
        if self.module is None:
            self.module = self._build()
        self.module.to(self.device)
        self.on_device = True

    def offload(self) -> None:
        self.module.to("cpu")
        self.on_device = False

    def onload(self) -> None:
        self.module.to(self.device)
        self.on_device = True

    @torch.no_grad()
    def score(self, batch: TokenBatch) -> torch.Tensor:
        if self.module is None or not self.on_device:
            raise TeacherStateError(f"teacher {self.teacher_id!r} is not resident")
        ids = batch.input_ids.to(self.device)
        out = self.module(ids)
        logits = getattr(out, "logits", out)
        logp = torch.log_softmax(logits.float() / self.temperature, -1)
        logp = logp.gather(-1, _labels(batch).to(self.device)[..., None])[..., 0]
        return torch.where(batch.label_mask().to(self.device), logp, torch.zeros_like(logp))

    def close(self) -> None:
        self.module = None
        self.on_device = False


# ---- teacher shard files (one per model-parallel rank, host-readable without collectives) ----

def write_teacher_shard(state: dict[str, torch.Tensor], folder: str | os.PathLike, *, rank_tag: str) -> Path:
    """Write one model-parallel rank's tensors as ``<folder>/shard_<rank_tag>.pt`` (atomic)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    path = Path(folder) / f"shard_{rank_tag}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"format": "mopd-teacher-shard-v1", "tensors": tensors}, path)
    return path


def read_teacher_shard(folder: str | os.PathLike, *, rank_tag: str,
                       expect: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """Read ``<folder>/shard_<rank_tag>.pt`` (memory-mapped) and check it against ``expect``
    ``{name: (shape, dtype)}``; a different key set, shape or dtype raises
    :class:`FingerprintMismatchError` naming the first difference."""
    path = Path(folder) / f"shard_{rank_tag}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"teacher shard {path} does not exist")
    blob = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != "mopd-teacher-shard-v1":
        raise FingerprintMismatchError(f"{path} is not a mopd teacher shard")
    tensors = blob["tensors"]
    if expect is not None:
        missing, extra = sorted(set(expect) - set(tensors)), sorted(set(tensors) - set(expect))
        if missing or extra:
            raise FingerprintMismatchError(f"{path}: architecture differs: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, (shape, dtype) in expect.items():
            if tuple(tensors[k].shape) != tuple(shape) or tensors[k].dtype != dtype:
                raise FingerprintMismatchError(f"{path}: {k} is {tuple(tensors[k].shape)} {tensors[k].dtype}, the "
                                               f"resident model has {tuple(shape)} {dtype}")
    return tensors
