"""The publisher: converted weights → flattened buckets → transport → receiver, verified.

Per publish (one ``weight_version``):

1. name/shape/dtype check of everything to be sent against ``receiver.param_specs()``
   (:class:`~colocate.convert.ParamMismatchError` lists the first 10 with both sides);
2. ``begin_update(version)``; then, in iterator order, each tensor goes one of two ways:

   * **in place**: a contiguous view into a storage of at least ``share_min_bytes`` (a Megatron
     DDP param buffer, a converter output that is a view of it) is not copied: the storage is
     handed over once (one IPC/shm handle) with the byte offsets of its tensors, and the
     receiver copies straight from it into its weights (the tensors of up to
     :attr:`Publisher.OPEN_STORAGES` storages are collected at once, so the trainer's buffer and
     a :class:`~colocate.convert.ConversionArena` interleaving per layer go as one request each);
   * **packed**: everything else (converted tensors such as the GQA-split q/k/v without an arena, small
     storages) is packed into flattened buckets of at most ``bucket_bytes`` in at most
     ``max_in_flight`` (≤ 2) staging buffers, a buffer being reused only after the receiver
     acknowledged its previous bucket and the device synchronized;
3. ``end_update(version, checksums)``: the receiver verifies the staged data (bit-exact
   checksums, ``verify="checksum"``) and commits atomically;
4. the version is read back; ``verify="sampled"`` compares sampled elements after commit.

Any failure aborts the update on the receiver (previous weights stay; a failure after the
commit rolls back receivers that have ``rollback``), marks the version poisoned (it can never
be published again) and raises :class:`PublishError` with the cause.
Timings per phase: convert (pulling tensors from the iterator), begin (metadata check and
``begin_update``), plan (the publisher's per-tensor bookkeeping: checks against ``meta``, entries,
storage grouping), bucket (packing copies and sender checksums), transfer (hand-over until ack),
load (verify + commit), release (unmapping, freeing staging), verify (read-back); the send loop
is timed whole, so only building the report is outside them.
What depends on ``meta`` and the receiver's specs alone (the passed check, the staging capacity,
per-name sizes and entries) is kept in a plan and reused while both compare equal, so repeated
publishes of one model skip it; tensors and storages are still checked on every publish.
Storages shared in place are unmapped by the receiver at the end of each publish (so the trainer
can release them) unless ``keep_shared``; then :meth:`Publisher.release_staging` unmaps them.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colocate.buckets import Entry, align, bucket_nbytes, nbytes, pack_bucket, tensor_checksum
from colocate.config import PublishConfig
from colocate.convert import check_params
from colocate.transports import RemoteReceiver, choose_transport, read_bucket_file, write_bucket_file

__all__ = ["PublishError", "PoisonedVersionError", "PublishReport", "Publisher"]

log = logging.getLogger(__name__)


PHASES = ("convert", "begin", "plan", "bucket", "transfer", "load", "release", "verify")


def _equal(a: Mapping, b: Mapping) -> bool:
    """``a == b``, False where the comparison itself fails (odd values in a caller's meta)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. array-valued shapes: treated as a changed layout
        return False


def _layout(m: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """An immutable snapshot of name → (shape, dtype) with int tuples as shapes."""
    return {n: (tuple(int(x) for x in s), d) for n, (s, d) in m.items()}


@dataclass
class _Plan:
    """What one ``meta`` against one receiver layout determines, reused by later publishes while
    both compare equal: ``check_params`` passed (for this ``require_all``), the staging
    capacity ``cap``, each name's (shape, dtype) and aligned packed size, and the last
    :class:`Entry` made per name (frozen, so shared when its offset recurs)."""

    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    require_all: bool
    cap: int
    sizes: dict[str, int]
    entries: dict[str, Entry] = field(default_factory=dict)

    @classmethod
    def build(cls, meta: Mapping, specs: Mapping, require_all: bool) -> _Plan:
        """Check ``meta`` against ``specs`` (raises :class:`ParamMismatchError`) and plan it."""
        check_params(meta, specs, require_all=require_all)
        snap = _layout(meta)
        sizes = {n: align(nbytes(s, d)) for n, (s, d) in snap.items()}
        return cls(snap, _layout(specs), require_all, sum(sizes.values()), sizes)

    def matches(self, meta: Mapping, specs: Mapping, require_all: bool) -> bool:
        return require_all == self.require_all and _equal(self.meta, meta) and _equal(self.specs, specs)

    def entry(self, name: str, offset: int) -> Entry:
        """``Entry(name, dtype, shape, offset)`` from the planned layout (cached per name)."""
        e = self.entries.get(name)
        if e is None or e.offset != offset:
            shape, dtype = self.meta[name]
            e = self.entries[name] = Entry(name, dtype, shape, offset)
        return e


def _key(storage: torch.UntypedStorage) -> tuple[int, int]:
    return storage.data_ptr(), storage.nbytes()


@dataclass(frozen=True)
class _Group:
    """One storage handed over in place: its receiver slot, entries, the storage as bytes, key."""

    slot: tuple
    entries: list[Entry]
    storage: torch.Tensor
    key: tuple[int, int]


@dataclass
class _Recipe:
    """How the last publish went, for :meth:`Publisher.publish` to repeat without the stream:
    its plan, the storages it handed over (in order, with their entries) and the arena fills."""

    plan: _Plan
    groups: list[_Group]
    ops: list

    def unchanged(self) -> bool:
        """Every storage still has the address and size it had (not released/re-allocated)."""
        return all(_key(g.storage.untyped_storage()) == g.key for g in self.groups)


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
    num_shared: int = 0
    """Storages sent in place (no packing copy): their tensors are views the receiver copies from."""
    timings: dict[str, float] = field(default_factory=dict)
    verify: str = "none"
    replayed: bool = False
    """The stream was not read: the previous publish's hand-overs were repeated (replay)."""

    @property
    def gbps(self) -> float:
        total = sum(self.timings.values())
        return self.nbytes / total / 1e9 if total > 0 else float("inf")


class Publisher:
    """Publishes versioned weights to one receiver (see module docstring for the protocol).

    ``receiver``: an in-process engine (:class:`~colocate.engines.HFEngine`, SGLang adapter) or
    a :class:`~colocate.transports.RemoteReceiver`. ``device``: where staging buffers live
    (defaults to CUDA for ``cuda_ipc``, CPU otherwise). ``share_min_bytes``: contiguous tensors
    whose storage has at least this many bytes are sent in place instead of packed (``None``:
    always pack). ``keep_shared``: keep such storages mapped in the receiver between publishes
    (no new handles next time; call :meth:`release_staging` before the trainer frees them).

    Replay (``replay_sources``: the trainer's parameters, e.g. ``model.parameters()``; ``arena``:
    the :class:`~colocate.convert.ConversionArena` the stream writes into): when a publish went
    wholly in place out of those parameters' storages and the arena (no packed bucket, every
    arena view's fill recorded, ``verify="none"``), the next publish with the same ``meta`` and
    receiver layout, while those storages have not moved, does not read ``weights`` at all: it
    re-runs the arena fills (the strided q/k/v copies: current values) and hands the same storages
    over with the same entries, so the receiver copies the trainer's current bytes. Valid when the
    stream is the same function of the same storages each time (:func:`~colocate.megatron.iter_hf_weights`
    of one model, TP = EP = 1: a pass with all-gathers is never recorded). A generator passed as
    ``weights`` is then not started. Needs ``meta``: without it the stream is drained before the
    arena could record, and no recipe is kept.
    """

    OPEN_STORAGES = 2
    """In-place storages whose tensors are collected at once, each handed over as one request
    when a further storage arrives (the oldest goes) or at the end: the trainer's buffer and a
    :class:`~colocate.convert.ConversionArena` interleave per layer and still go as one request
    each. A stream of distinct large storages (TP-gathered tensors) keeps at most this many alive."""

    def __init__(self, receiver, config: PublishConfig | None = None, *, device: str | torch.device | None = None,
                 share_min_bytes: int | None = 64 << 20, keep_shared: bool = False,
                 replay_sources: Iterable[torch.Tensor] | None = None, arena=None):
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
        if share_min_bytes is not None and share_min_bytes < 1:
            from colocate.config import ConfigError

            raise ConfigError(f"Publisher share_min_bytes must be >= 1 or None, got {share_min_bytes!r}")
        self.share_min_bytes = share_min_bytes
        self.keep_shared = keep_shared
        self._shared_slots: set[tuple] = set()
        self._plan: _Plan | None = None
        self.plan_reused = 0
        """Publishes that reused the plan (names/shapes/dtypes unchanged, check not re-run)."""
        self._sources: list[torch.UntypedStorage] | None = None
        if replay_sources is not None:
            by_key = {}
            for t in replay_sources:
                st = t.untyped_storage()
                by_key.setdefault(_key(st), st)
            self._sources = list(by_key.values())
        if arena is not None and self._sources is None:
            from colocate.config import ConfigError

            raise ConfigError("Publisher arena= is for replay: pass replay_sources= (the trainer's parameters) too")
        self.arena = arena
        self._recipe: _Recipe | None = None
        self.replays = 0
        """Publishes that repeated the previous one's hand-overs without reading the stream."""

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
        self._shared_slots.clear()
        self._recipe = None  # it holds the storages it handed over
        if isinstance(self.receiver, RemoteReceiver) and self.receiver.process.is_alive():
            self.receiver.detach_buffers()  # staging slots and storages kept shared (keep_shared)
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return freed

    # ----- publish ----------------------------------------------------------------------------
    def publish(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, version: int,
                meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                require_all: bool = True) -> PublishReport:
        """Publish ``weights`` (HF name → tensor, or an iterator of pairs) as ``version``.

        ``meta`` (name → (shape, dtype)) lets the checks run before the iterator is consumed,
        so a lazy Megatron gather (:func:`colocate.megatron.iter_hf_weights`) is never
        materialised whole; without it the iterator is drained first. Yielded tensors must stay
        unchanged until this call returns (they are packed, or read in place, later). Raises
        :class:`PoisonedVersionError` for a reused/poisoned/old version and
        :class:`PublishError` for any failure during the publish.
        """
        if version in self.poisoned or (self.last_good is not None and version <= self.last_good):
            raise PoisonedVersionError(f"weight_version {version} is poisoned or not newer than the last good "
                                       f"version {self.last_good} (poisoned: {sorted(self.poisoned)})")
        timings = dict.fromkeys(PHASES, 0.0)
        phase = "check"
        began = False
        try:
            items = weights.items() if isinstance(weights, Mapping) else weights
            drained = meta is None  # then the stream ran before recording could start: no recipe
            if meta is None:
                t0 = time.perf_counter()
                items = list(items)
                timings["convert"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if meta is None:
                meta = {n: (tuple(t.shape), t.dtype) for n, t in items}
            plan = self._plan_for(meta, require_all)
            recipe, self._recipe = self._recipe, None  # set again only by a successful publish
            if recipe is not None and (recipe.plan is not plan or not recipe.unchanged()):
                recipe = None
            phase = "begin"
            self.receiver.begin_update(version)
            began = True
            timings["begin"] = time.perf_counter() - t0
            phase = "transfer"
            replayed = recipe is not None
            if replayed:
                report = self._replay(recipe, version, timings)
            else:
                recording = self._sources is not None and self.arena is not None
                if recording:
                    self.arena.record()
                try:
                    report = self._send(iter(items), plan, version, timings)
                finally:
                    ops = self.arena.recorded() if recording else None
                if self._sources is not None and not drained:
                    recipe = self._record(plan, report, ops)
            phase = "load"
            t0 = time.perf_counter()
            self.receiver.end_update(version, report.pop("checksums"))
            timings["load"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if not self.keep_shared:
                self._drop_shared()
            if self._fresh:
                self._staging = [None] * self.config.max_in_flight
            report.pop("fresh", None)
            if self._fresh or not self.keep_shared:
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()  # free the IPC-limbo blocks the receiver has let go
            timings["release"] = time.perf_counter() - t0
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
            try:
                self._drop_shared()
            except Exception as drop_err:  # noqa: BLE001 - the receiver may be gone
                log.warning("receiver could not unmap shared storages: %s", drop_err)
                self._shared_slots.clear()
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
        self._recipe = recipe
        self.replays += replayed
        rep = PublishReport(version=version, transport=self.transport, num_tensors=len(meta),
                            nbytes=report["nbytes"], num_buckets=report["buckets"], handles=report["handles"],
                            num_shared=report["shared"],
                            timings=timings, verify=self.config.verify if self._verifies else "version-only",
                            replayed=replayed)
        self.reports.append(rep)
        log.info("published v%s via %s: %d tensors, %.1f MiB, %d buckets, %d shared storages, %s", version,
                 self.transport, len(meta), rep.nbytes / 2**20, rep.num_buckets, rep.num_shared,
                 {k: round(v * 1e3, 2) for k, v in timings.items()})
        return rep

    def _plan_for(self, meta: Mapping, require_all: bool) -> _Plan:
        """The plan of the last publish if ``meta``, the receiver's specs (asked every time) and
        ``require_all`` are unchanged, else a new one (``check_params`` runs again)."""
        specs = self.receiver.param_specs()
        if self._plan is not None and self._plan.matches(meta, specs, require_all):
            self.plan_reused += 1
            return self._plan
        self._plan = None
        self._plan = _Plan.build(meta, specs, require_all)
        return self._plan

    # ----- sending -----------------------------------------------------------------------------
    def _shares_storage(self) -> bool:
        """Whether any tensor can go in place with this transport and ``share_min_bytes``."""
        return self.share_min_bytes is not None and self.transport != "disk"

    def _shareable(self, t: torch.Tensor, s: torch.UntypedStorage) -> bool:
        """True when ``t`` (with storage ``s``) is sent in place: a contiguous view into a storage
        of at least ``share_min_bytes`` that the transport can hand over as it is (no packing copy).
        Callers check :meth:`_shares_storage` first."""
        if s.nbytes() < self.share_min_bytes or not t.is_contiguous():
            return False
        if self.transport == "cuda_ipc":
            return t.is_cuda
        if self.transport == "shm":
            return s.device.type == "cpu" and s.is_shared()  # what Tensor.is_shared() asks, minus its wrapper
        return True  # inprocess: handed over by reference

    def _send(self, items, plan: _Plan, version: int, timings: dict[str, float]) -> dict:
        """Pull, check, group and hand over every tensor; the whole call is timed (``plan`` gets
        what the convert/bucket/transfer timers inside it did not count)."""
        start = time.perf_counter()
        inner = timings["convert"] + timings["bucket"] + timings["transfer"]
        try:
            return self._send_all(items, plan, version, timings)
        finally:
            inner = timings["convert"] + timings["bucket"] + timings["transfer"] - inner
            timings["plan"] += time.perf_counter() - start - inner

    def _send_all(self, items, plan: _Plan, version: int, timings: dict[str, float]) -> dict:
        cfg = self.config
        remote = isinstance(self.receiver, RemoteReceiver)
        checksums: dict[str, int] | None = {} if cfg.verify == "checksum" and self._verifies else None
        samples: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        gen = torch.Generator().manual_seed(version)
        st = {"nbytes": 0, "handles": 0, "buckets": 0, "shared": 0, "groups": []}
        fresh: list[torch.Tensor] = []
        cur: list[Entry] = []
        cur_t: dict[str, torch.Tensor] = {}
        used = 0
        # open in-place groups, oldest first: storage key → (storage as bytes, entries)
        groups: dict[tuple[int, int], tuple[torch.Tensor, list[Entry]]] = {}
        seen: set[str] = set()

        def wait_slot() -> None:
            self._wait_slot(timings)

        def hand_over(slot, entries: list[Entry], buf: torch.Tensor, size: int) -> None:
            self._hand_over(slot, entries, buf, size, version, st, timings)

        def flush_bucket() -> None:
            nonlocal cur, cur_t, used
            if not cur:
                return
            wait_slot()
            t0 = time.perf_counter()
            size = bucket_nbytes(cur)
            if self._fresh:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                fresh.append(buf)  # alive until the receiver's end_update synchronized
            else:
                buf = self._buffer(st["buckets"] % cfg.max_in_flight, max(size, min(cfg.bucket_bytes, plan.cap)))
            pack_bucket(cur_t, cur, buf)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            timings["bucket"] += time.perf_counter() - t0
            hand_over(st["buckets"] % cfg.max_in_flight, cur, buf, size)
            st["buckets"] += 1
            cur, cur_t, used = [], {}, 0

        def flush_group(key: tuple[int, int]) -> None:
            storage, entries = groups.pop(key)
            spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries)
            for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
                if start < end:  # e.g. a generator that reuses one buffer for successive tensors
                    raise ValueError(f"weights {a!r} and {b!r} are overlapping views of one storage; tensors must "
                                     "stay unchanged and distinct until publish returns")
            wait_slot()
            if storage.is_cuda:
                torch.cuda.current_stream(storage.device).synchronize()  # producer writes done
            slot = ("shared", *key)
            self._shared_slots.add(slot)
            hand_over(slot, entries, storage, storage.numel())
            st["shared"] += 1
            st["groups"].append(_Group(slot, entries, storage, key))

        meta, sizes, sampled = plan.meta, plan.sizes, cfg.verify == "sampled"
        sharing = self._shares_storage()
        while True:
            t0 = time.perf_counter()
            try:
                name, t = next(items)
            except StopIteration:
                break
            finally:
                timings["convert"] += time.perf_counter() - t0
            want = meta.get(name)
            if want is None:
                raise ValueError(f"weights yielded {name!r}, which is not in meta")
            if name in seen:
                raise ValueError(f"weights yielded {name!r} twice")
            seen.add(name)
            shape, dtype = want
            if t.dtype != dtype or t.shape != shape:  # torch.Size == tuple: compared as tuples
                raise ValueError(f"weights yielded {name!r} as {tuple(t.shape)} {t.dtype}, meta says {shape} "
                                 f"{dtype}")
            if checksums is not None or sampled:
                t0 = time.perf_counter()
                if checksums is not None:
                    checksums[name] = tensor_checksum(t)
                if sampled:
                    n = t.numel()
                    idx = torch.randint(0, n, (min(cfg.sample_count, n),), generator=gen)
                    samples[name] = (idx, t.reshape(-1)[idx.to(t.device)].cpu())
                timings["bucket"] += time.perf_counter() - t0
            if sharing:
                s = t.untyped_storage()
                if self._shareable(t, s):
                    key = (s.data_ptr(), s.nbytes())
                    group = groups.get(key)
                    if group is None:
                        if len(groups) >= self.OPEN_STORAGES:
                            flush_group(next(iter(groups)))
                        group = groups[key] = (torch.empty(0, dtype=torch.uint8, device=t.device).set_(s), [])
                    group[1].append(plan.entry(name, t.storage_offset() * dtype.itemsize))
                    continue
            size = sizes[name]
            if cur and used + size > cfg.bucket_bytes:
                flush_bucket()
            cur.append(plan.entry(name, used))
            cur_t[name] = t
            used += size
        flush_bucket()
        for key in list(groups):
            flush_group(key)
        t0 = time.perf_counter()
        while remote and self.receiver.in_flight:
            self.receiver.wait_one(cfg.timeout_s)
        timings["transfer"] += time.perf_counter() - t0
        missing = [n for n in meta if n not in seen] if len(seen) != len(meta) else []  # seen ⊆ meta
        if missing:
            raise ValueError(f"weights ended before {len(missing)} planned tensor(s): {missing[:10]}")
        if self._fresh:
            st["handles"] = len(fresh) + st["shared"]
        return {"nbytes": st["nbytes"], "handles": int(st["handles"]), "buckets": st["buckets"],
                "shared": st["shared"], "checksums": checksums, "samples": samples, "fresh": fresh,
                "groups": st["groups"]}

    def _wait_slot(self, timings: dict[str, float]) -> None:
        """Block until fewer than ``max_in_flight`` requests are unacknowledged."""
        t0 = time.perf_counter()
        while isinstance(self.receiver, RemoteReceiver) and self.receiver.in_flight >= self.config.max_in_flight:
            self.receiver.wait_one(self.config.timeout_s)  # that bucket was acked (receiver synced)
        timings["transfer"] += time.perf_counter() - t0

    def _hand_over(self, slot, entries: list[Entry], buf: torch.Tensor, size: int, version: int, st: dict,
                   timings: dict[str, float]) -> None:
        """Give the receiver ``entries`` of ``buf[:size]`` (a bucket or a storage shared in place)."""
        t0 = time.perf_counter()
        remote = isinstance(self.receiver, RemoteReceiver)
        if self.transport == "disk":
            self._send_file(entries, buf, size, version, st, remote)
        elif remote:
            st["handles"] += self.receiver.attach_buffer(slot, buf)
            self.receiver.submit_slot(slot, entries)
        else:
            self.receiver.load_bucket(entries, buf[:size])
        timings["transfer"] += time.perf_counter() - t0
        st["nbytes"] += sum(e.nbytes for e in entries)

    # ----- replay -------------------------------------------------------------------------------
    def _record(self, plan: _Plan, report: dict, ops: list | None) -> _Recipe | None:
        """A recipe from a publish that went wholly in place out of replay sources (and the arena,
        whose fill ``ops`` were all recorded); ``None`` if anything else was involved."""
        if report["buckets"] or not report["groups"] or self.transport == "disk" or self.config.verify != "none":
            return None
        allowed = {_key(st) for st in self._sources}
        if self.arena is not None:
            if ops is None:
                return None
            allowed.add(_key(self.arena.buffer.untyped_storage()))
        if any(g.key not in allowed for g in report["groups"]):
            return None
        if any(_key(t.untyped_storage()) not in allowed for _, reads in ops or () for t in reads):
            return None  # an arena fill read a temporary: re-running it would copy stale bytes
        return _Recipe(plan, report["groups"], [op for op, _ in ops or ()])

    def _replay(self, recipe: _Recipe, version: int, timings: dict[str, float]) -> dict:
        """Re-run the arena's recorded fills, then hand the same storages over with the same entries."""
        t0 = time.perf_counter()
        for op in recipe.ops:
            op()
        for dev in {g.storage.device for g in recipe.groups if g.storage.is_cuda}:
            torch.cuda.current_stream(dev).synchronize()  # the fills (and the trainer's writes) are done
        timings["convert"] += time.perf_counter() - t0
        st = {"nbytes": 0, "handles": 0, "buckets": 0, "shared": 0}
        for g in recipe.groups:
            self._wait_slot(timings)
            self._shared_slots.add(g.slot)
            self._hand_over(g.slot, g.entries, g.storage, g.storage.numel(), version, st, timings)
            st["shared"] += 1
        t0 = time.perf_counter()
        while isinstance(self.receiver, RemoteReceiver) and self.receiver.in_flight:
            self.receiver.wait_one(self.config.timeout_s)
        timings["transfer"] += time.perf_counter() - t0
        return {**st, "checksums": None, "samples": {}, "groups": recipe.groups}

    def _send_file(self, entries: list[Entry], buf: torch.Tensor, size: int, version: int, st: dict,
                   remote: bool) -> None:
        cfg = self.config
        while remote and self.receiver.in_flight:
            self.receiver.wait_one(cfg.timeout_s)
        if self._disk is None:
            self._disk = Path(tempfile.mkdtemp(prefix="colocate-publish-"))
        path = self._disk / f"v{version}-b{st['buckets']}.bin"
        write_bucket_file(buf, size, path)
        st["handles"] += 1
        try:
            if remote:
                self.receiver.load_file(entries, str(path), size)
            else:
                self.receiver.load_bucket(entries, read_bucket_file(path, size))
        finally:
            path.unlink(missing_ok=True)

    def _drop_shared(self) -> None:
        """Make the receiver unmap storages shared in place (so the trainer can free them)."""
        if self._shared_slots and isinstance(self.receiver, RemoteReceiver) and self.receiver.process.is_alive():
            self.receiver.detach_slots(sorted(self._shared_slots))
        self._shared_slots.clear()

    def _verify_sampled(self, samples: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        got = self.receiver.sample({n: idx for n, (idx, _) in samples.items()})
        bad = [n for n, (_, want) in samples.items() if not torch.equal(got[n].to(want.dtype), want)]
        if bad:
            raise RuntimeError(f"sampled verification: {len(bad)} tensor(s) differ after commit: {bad[:10]}")
