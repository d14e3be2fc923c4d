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

import json
import math
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mcore_distill.validate import check_type
from mopd.errors import ConfigError, FingerprintMismatchError, TeacherServerError, TeacherTimeoutError

__all__ = ["HTTPTeacher", "TeacherBackend", "TokenBatch", "TransformersTeacher", "atomic_torch_save", "read_teacher_shard",
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

    Failures (connection refused, timeout, HTTP 5xx) are retried ``max_retries`` times with
    exponential backoff, then raise :class:`TeacherServerError` / :class:`TeacherTimeoutError`
    (the pool then marks the teacher BROKEN). HTTP 4xx and malformed payloads are not retried.
    Server memory is managed by the server: ``offload``/``onload`` are no-ops.
    """

    def __init__(self, teacher_id: str, url: str, *, temperature: float = 1.0, timeout_s: float = 60.0,
                 max_retries: int = 2, retry_backoff_s: float = 0.5, max_batch: int = 64,
                 max_new_tokens: int = 1, server_scales_temperature: bool = False,
                 vocab_size: int | None = None) -> None:
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
        self.vocab_size = vocab_size
        self.teacher_id, self.url = teacher_id, url.rstrip("/")
        self.temperature, self.timeout_s = float(temperature), float(timeout_s)
        self.max_retries, self.retry_backoff_s, self.max_batch = max_retries, retry_backoff_s, max_batch
        self.max_new_tokens = max_new_tokens
        self.requests = 0
        self.closed = False

    @classmethod
    def from_spec(cls, teacher_id: str, spec: Any, *, temperature: float) -> HTTPTeacher:
        """Build from a :class:`mopd.config.TeacherSpec` (``backend='http'``); ``vocab_size`` is
        ``spec.vocab_size`` or else read from ``spec.hf_path``'s ``config.json``."""
        vocab_size = spec.vocab_size
        if vocab_size is None and spec.hf_path:
            cfg = Path(spec.hf_path) / "config.json"
            if cfg.is_file():
                vocab_size = json.loads(cfg.read_text()).get("vocab_size")
        return cls(teacher_id, spec.url, temperature=temperature, timeout_s=spec.timeout_s,
                   max_retries=spec.max_retries, retry_backoff_s=spec.retry_backoff_s, max_batch=spec.max_batch,
                   server_scales_temperature=spec.server_scales_temperature, vocab_size=vocab_size)

    def _request(self, path: str, payload: dict | None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
            self.requests += 1
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    body = resp.read()
                return json.loads(body) if body else None
            except urllib.error.HTTPError as err:
                if err.code < 500:
                    raise TeacherServerError(f"teacher {self.teacher_id!r}: {self.url}{path} answered HTTP "
                                             f"{err.code}: {err.read()[:300]!r}") from err
                last = err
            except (TimeoutError, urllib.error.URLError, ConnectionError) as err:
                last = err
            except json.JSONDecodeError as err:
                raise TeacherServerError(f"teacher {self.teacher_id!r}: {self.url}{path} returned invalid JSON") from err
        reason = getattr(last, "reason", last)
        if isinstance(reason, TimeoutError | socket.timeout):
            raise TeacherTimeoutError(f"teacher {self.teacher_id!r}: {self.url}{path} timed out after "
                                      f"{self.timeout_s}s, {self.max_retries + 1} attempts") from last
        raise TeacherServerError(f"teacher {self.teacher_id!r}: {self.url}{path} failed after "
                                 f"{self.max_retries + 1} attempts: {type(last).__name__}: {last}") from last

    # ---- lifecycle -----------------------------------------------------------------------
    def prefetch(self) -> None:
        return None

    def load(self) -> None:
        """Health check (``GET /health``) with the same retries and timeout."""
        self._request("/health", None)

    def offload(self) -> None:
        return None

    def onload(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    # ---- scoring -------------------------------------------------------------------------
    def score(self, batch: TokenBatch) -> torch.Tensor:
        """``logp [B, L]`` float32 on the batch's device (see module docstring)."""
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
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError) as err:
            raise TeacherServerError(f"teacher {self.teacher_id!r}: row {r} has no meta_info.input_token_logprobs") from err
        if len(entries) != length - start:
            raise TeacherServerError(f"teacher {self.teacher_id!r}: row {r} got {len(entries)} input log-probs, "
                                     f"expected {length - start} (length {length}, logprob_start_len {start})")
        last_id = None if self.vocab_size is None else self.vocab_size - 1
        for i, e in enumerate(entries):
            pos = start + i
            got, want = int(e[1]), int(ids[pos])
            if got != want and not (got == 0 and want == last_id):
                hint = ""
                if got == 0 and last_id is None:
                    hint = (" (SGLang reports the last vocabulary id, vocab_size-1, as 0: if "
                            f"{want} is vocab_size-1, pass vocab_size={want + 1} / set TeacherSpec.vocab_size)")
                raise TeacherServerError(f"teacher {self.teacher_id!r}: row {r} position {pos}: server token id "
                                         f"{got} != request id {want} (misaligned log-probs){hint}")
            if i == 0:
                continue  # SGLang always pads the first entry with None
            if e[0] is None:
                raise TeacherServerError(f"teacher {self.teacher_id!r}: row {r} position {pos} has no log-prob")
            out[r, pos - 1] = float(e[0])


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
            raise RuntimeError(f"teacher {self.teacher_id!r} is not resident")
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

def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temp file in the same folder, fsync, rename, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_teacher_shard(state: dict[str, torch.Tensor], folder: str | os.PathLike, *, rank_tag: str) -> Path:
    """Write one model-parallel rank's tensors as ``<folder>/shard_<rank_tag>.pt`` (atomic)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    path = Path(folder) / f"shard_{rank_tag}.pt"
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
