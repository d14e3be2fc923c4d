"""The publisher: converted weights → flattened buckets → transport → receiver, verified.

Per publish (one ``weight_version``):

1. name/shape/dtype check of everything to be sent against ``receiver.param_specs()``
   (:class:`~colocate.convert.ParamMismatchError` lists the first 10 with both sides);
2. ``begin_update(version)``; tensors are packed into at most ``max_in_flight`` (≤ 2) staging
   buffers of ``bucket_bytes``, a buffer being reused only after the receiver acknowledged its
   previous bucket and the device synchronized;
3. ``end_update(version, checksums)``: the receiver verifies the staged data (bit-exact
   checksums, ``verify="checksum"``) and commits atomically;
4. the version is read back; ``verify="sampled"`` compares sampled elements after commit.

Any failure aborts the update on the receiver (previous weights stay; a failure after the
commit rolls back receivers that have ``rollback``), marks the version poisoned (it can never
be published again) and raises :class:`PublishError` with the cause.
Timings per phase: convert (pulling tensors from the iterator), bucket (packing copies),
transfer (hand-over until ack), load (verify + commit), verify (read-back).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colocate.buckets import bucket_nbytes, pack_bucket, plan_buckets, tensor_checksum
from colocate.config import PublishConfig
from colocate.convert import check_params
from colocate.transports import RemoteReceiver, choose_transport, write_bucket_file

__all__ = ["PublishError", "PoisonedVersionError", "PublishReport", "Publisher"]

log = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """A publish failed; ``version`` is poisoned and the receiver kept its previous weights."""

    def __init__(self, version: int, phase: str, cause: BaseException):
        self.version, self.phase, self.cause = version, phase, cause
        super().__init__(f"publish of weight_version {version} failed in {phase}: {type(cause).__name__}: {cause}")


class PoisonedVersionError(ValueError):
    """A version that failed before (or is not newer than the last good one) was published."""


@dataclass
class PublishReport:
    """What one publish did: sizes, buckets, handles, timings (seconds) per phase."""

    version: int
    transport: str
    num_tensors: int
    nbytes: int
    num_buckets: int
    handles: int
    """Distinct buffers that crossed the process boundary (IPC / shm handles, files)."""
    timings: dict[str, float] = field(default_factory=dict)
    verify: str = "none"

    @property
    def gbps(self) -> float:
        total = sum(self.timings.values())
        return self.nbytes / total / 1e9 if total > 0 else float("inf")


class Publisher:
    """Publishes versioned weights to one receiver (see module docstring for the protocol).

    ``receiver``: an in-process engine (:class:`~colocate.engines.HFEngine`, SGLang adapter) or
    a :class:`~colocate.transports.RemoteReceiver`. ``device``: where staging buffers live
    (defaults to CUDA for ``cuda_ipc``, CPU otherwise).
    """

    def __init__(self, receiver, config: PublishConfig | None = None, *, device: str | torch.device | None = None):
        self.receiver = receiver
        self.config = config or PublishConfig()
        local = not isinstance(receiver, RemoteReceiver)
        self.transport = choose_transport(self.config.transport, frozenset(receiver.capabilities()), local=local)
        if device is None:
            device = "cuda" if self.transport == "cuda_ipc" else "cpu"
        self.device = torch.device(device)
        self.poisoned: set[int] = set()
        self.last_good: int | None = None
        self.reports: list[PublishReport] = []
        # A receiver whose acknowledgement does not mean "copied on the device" (SGLang returns
        # before its copies finish) gets a fresh buffer per bucket, freed after the final sync.
        self._fresh = bool(getattr(receiver, "unsynced_acks", False))
        self._verifies = bool(getattr(receiver, "verifies_checksums", True))
        if self.config.verify == "sampled" and not hasattr(receiver, "sample"):
            from colocate.config import ConfigError

            raise ConfigError(f"PublishConfig.verify='sampled': receiver {type(receiver).__name__} cannot sample")
        self._staging: list[torch.Tensor | None] = [None] * self.config.max_in_flight
        self._disk: Path | None = Path(self.config.disk_dir) if self.config.disk_dir else None

    # ----- staging buffers --------------------------------------------------------------------
    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            self._staging[slot] = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if self.transport == "shm":
                buf.share_memory_()
            self._staging[slot] = buf
        return buf

    def release_staging(self) -> int:
        """Free the staging buffers (returns bytes); they are re-allocated on the next publish."""
        freed = sum(b.numel() for b in self._staging if b is not None)
        self._staging = [None] * self.config.max_in_flight
        if isinstance(self.receiver, RemoteReceiver) and self.receiver.process.is_alive():
            self.receiver.detach_buffers()
        return freed

    # ----- publish ----------------------------------------------------------------------------
    def publish(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, version: int,
                meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                require_all: bool = True) -> PublishReport:
        """Publish ``weights`` (HF name → tensor, or an iterator of pairs) as ``version``.

        ``meta`` (name → (shape, dtype)) lets the checks run before the iterator is consumed,
        so a lazy Megatron gather (:func:`colocate.megatron.iter_hf_weights`) is never
        materialised whole; without it the iterator is drained first. Raises
        :class:`PoisonedVersionError` for a reused/poisoned/old version and
        :class:`PublishError` for any failure during the publish.
        """
        if version in self.poisoned or (self.last_good is not None and version <= self.last_good):
            raise PoisonedVersionError(f"weight_version {version} is poisoned or not newer than the last good "
                                       f"version {self.last_good} (poisoned: {sorted(self.poisoned)})")
        timings = dict.fromkeys(("convert", "bucket", "transfer", "load", "verify"), 0.0)
        phase = "check"
        began = False
        try:
            items = weights.items() if isinstance(weights, Mapping) else weights
            if meta is None:
                t0 = time.perf_counter()
                items = list(items)
                timings["convert"] += time.perf_counter() - t0
                meta = {n: (tuple(t.shape), t.dtype) for n, t in items}
            check_params(meta, self.receiver.param_specs(), require_all=require_all)
            plan = plan_buckets(((n, s, d) for n, (s, d) in meta.items()), bucket_bytes=self.config.bucket_bytes)
            phase = "begin"
            self.receiver.begin_update(version)
            began = True
            phase = "transfer"
            report = self._send(iter(items), plan, version, timings)
            phase = "load"
            t0 = time.perf_counter()
            self.receiver.end_update(version, report.pop("checksums"))
            timings["load"] = time.perf_counter() - t0
            if self._fresh:
                self._staging = [None] * self.config.max_in_flight
                report.pop("fresh", None)
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()
            phase = "verify"
            t0 = time.perf_counter()
            got = self.receiver.weight_version()
            if got != version:
                raise RuntimeError(f"receiver reports weight_version {got!r} after publishing {version}")
            if self.config.verify == "sampled":
                self._verify_sampled(report.pop("samples"))
            timings["verify"] = time.perf_counter() - t0
        except BaseException as e:
            self.poisoned.add(version)
            if began:
                try:
                    if phase == "verify" and hasattr(self.receiver, "rollback"):
                        self.receiver.rollback()  # committed but unverified: back to the previous weights
                    else:
                        self.receiver.abort_update(version)
                except Exception as abort_err:  # noqa: BLE001 - the receiver may be gone
                    log.warning("abort/rollback of %s failed: %s", version, abort_err)
            log.error("publish %s poisoned in %s: %s", version, phase, e)
            raise PublishError(version, phase, e) from e
        self.last_good = version
        rep = PublishReport(version=version, transport=self.transport, num_tensors=len(meta),
                            nbytes=report["nbytes"], num_buckets=len(plan), handles=report["handles"],
                            timings=timings, verify=self.config.verify if self._verifies else "version-only")
        self.reports.append(rep)
        log.info("published v%s via %s: %d tensors, %.1f MiB, %d buckets, %s", version, self.transport, len(meta),
                 rep.nbytes / 2**20, len(plan), {k: round(v * 1e3, 2) for k, v in timings.items()})
        return rep

    def _send(self, items, plan, version: int, timings: dict[str, float]) -> dict:
        cfg = self.config
        want = {e.name: b for b, entries in enumerate(plan) for e in entries}
        pending: dict[str, torch.Tensor] = {}
        checksums: dict[str, int] | None = {} if cfg.verify == "checksum" and self._verifies else None
        samples: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        gen = torch.Generator().manual_seed(version)
        nbytes = handles = 0
        remote = isinstance(self.receiver, RemoteReceiver)
        cap = max(bucket_nbytes(entries) for entries in plan)
        fresh: list[torch.Tensor] = []
        for b, entries in enumerate(plan):
            while any(e.name not in pending for e in entries):
                t0 = time.perf_counter()
                try:
                    name, t = next(items)
                except StopIteration:
                    missing = [e.name for e in entries if e.name not in pending]
                    raise ValueError(f"weights ended before {len(missing)} planned tensor(s): {missing[:10]}") from None
                timings["convert"] += time.perf_counter() - t0
                if name not in want:
                    raise ValueError(f"weights yielded {name!r}, which is not in meta")
                pending[name] = t
            slot = b % cfg.max_in_flight
            size = bucket_nbytes(entries)
            t0 = time.perf_counter()
            if remote and self.receiver.in_flight >= cfg.max_in_flight:
                self.receiver.wait_one(cfg.timeout_s)  # slot's previous bucket acked (receiver synced)
            timings["transfer"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if self._fresh:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                fresh.append(buf)  # alive until the receiver's end_update synchronized
            else:
                buf = self._buffer(slot, cap)
            tensors = {e.name: pending.pop(e.name) for e in entries}
            pack_bucket(tensors, entries, buf)
            for e in entries:
                if checksums is not None:
                    checksums[e.name] = tensor_checksum(tensors[e.name])
                if cfg.verify == "sampled":
                    n = tensors[e.name].numel()
                    idx = torch.randint(0, n, (min(cfg.sample_count, n),), generator=gen)
                    samples[e.name] = (idx, tensors[e.name].reshape(-1)[idx.to(tensors[e.name].device)].cpu())
            del tensors
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            timings["bucket"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.transport == "inprocess":
                self.receiver.load_bucket(entries, buf[:size])
            elif self.transport in ("shm", "cuda_ipc"):
                if remote:
                    handles += self.receiver.attach_buffer(slot, buf)
                    self.receiver.submit_slot(slot, entries)
                else:
                    self.receiver.load_bucket(entries, buf[:size])
            elif self.transport == "disk":
                while remote and self.receiver.in_flight:
                    self.receiver.wait_one(cfg.timeout_s)
                if self._disk is None:
                    self._disk = Path(tempfile.mkdtemp(prefix="colocate-publish-"))
                path = self._disk / f"v{version}-b{b}.bin"
                write_bucket_file(buf, size, path)
                handles += 1
                try:
                    if remote:
                        self.receiver.load_file(entries, str(path), size)
                    else:
                        from colocate.transports import read_bucket_file

                        self.receiver.load_bucket(entries, read_bucket_file(path, size))
                finally:
                    path.unlink(missing_ok=True)
            timings["transfer"] += time.perf_counter() - t0
            nbytes += sum(e.nbytes for e in entries)
        t0 = time.perf_counter()
        while remote and self.receiver.in_flight:
            self.receiver.wait_one(cfg.timeout_s)
        timings["transfer"] += time.perf_counter() - t0
        if pending:
            raise ValueError(f"weights yielded {len(pending)} tensor(s) twice or unplanned: {sorted(pending)[:10]}")
        if self._fresh:
            handles = len(fresh)
        return {"nbytes": nbytes, "handles": int(handles), "checksums": checksums, "samples": samples,
                "fresh": fresh}

    def _verify_sampled(self, samples: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        got = self.receiver.sample({n: idx for n, (idx, _) in samples.items()})
        bad = [n for n, (_, want) in samples.items() if not torch.equal(got[n].to(want.dtype), want)]
        if bad:
            raise RuntimeError(f"sampled verification: {len(bad)} tensor(s) differ after commit: {bad[:10]}")
