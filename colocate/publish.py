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
commit rolls back receivers that have ``rollback``, and an abort that reaches a receiver after
it committed makes it stop serving that version), marks the version poisoned (it can never be
published again) and raises :class:`PublishError` with the cause.
Timings per phase (:class:`PhaseClock`, exclusive: a phase inside another pauses it): convert
(pulling tensors from the iterator), begin (metadata check and ``begin_update``), plan (the
publisher's per-tensor bookkeeping: checks against ``meta``, entries, storage grouping), bucket
(packing copies and sender checksums), transfer (hand-over until ack), load (verify + commit),
release (unmapping, freeing staging), verify (read-back); only building the report is outside them.
The receiver is reached through a :class:`~colocate.protocol.ReceiverLink`
(:func:`~colocate.transports.link_to`: the proxy of a receiver in another process, or a shim that
calls an in-process one), and every wait on it is bounded by ``PublishConfig.timeout_s``.
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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colocate.buckets import Entry, align, bucket_nbytes, nbytes, pack_bucket, tensor_checksum
from colocate.config import PublishConfig
from colocate.convert import check_params
from colocate.errors import ConfigError, PoisonedVersionError, PublishError, UpdateError
from colocate.protocol import WeightReceiver
from colocate.transports import choose_transport, link_to, write_bucket_file

__all__ = ["PublishError", "PoisonedVersionError", "PublishReport", "Publisher", "PhaseClock", "PHASES"]

log = logging.getLogger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
Meta = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

PHASES = ("convert", "begin", "plan", "bucket", "transfer", "load", "release", "verify")


class PhaseClock:
    """Wall time per phase, exclusive: ``with clock("bucket"):`` inside ``with clock("plan"):``
    pauses ``plan`` until it ends, so the phases add up to the time spent inside any of them.
    ``stage`` is the last ``stage=`` entered (what a failure is reported as). One instance is
    reused as the context manager (phases nest strictly), so entering one allocates nothing."""

    __slots__ = ("times", "stage", "_cur", "_mark", "_stack", "_next")

    def __init__(self, phases: Iterable[str] = PHASES):
        self.times: dict[str, float] = dict.fromkeys(phases, 0.0)
        self.stage: str | None = None
        self._cur: str | None = None
        self._mark = 0.0
        self._stack: list[str | None] = []
        self._next: tuple[str, str | None] = ("", None)

    def __call__(self, phase: str, *, stage: str | None = None) -> PhaseClock:
        self._next = (phase, stage)
        return self

    def __enter__(self) -> None:
        now = time.perf_counter()
        if self._cur is not None:
            self.times[self._cur] += now - self._mark
        self._stack.append(self._cur)
        self._cur, stage = self._next
        if stage is not None:
            self.stage = stage
        self._mark = now

    def __exit__(self, *exc: object) -> None:
        now = time.perf_counter()
        self.times[self._cur] += now - self._mark
        self._cur = self._stack.pop()
        self._mark = now

    def timed(self, items: Iterator, phase: str) -> Iterator:
        """``items``, each pull timed as ``phase`` (the enclosing phase does not count it): the
        per-item form of ``with clock(phase): next(items)``, for a hot loop."""
        times, now = self.times, time.perf_counter
        while True:
            t0 = now()
            item = next(items, _END)
            dt = now() - t0
            times[phase] += dt
            self._mark += dt
            if item is _END:
                return
            yield item


_END = object()


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
    """One storage handed over in place: its receiver slot, entries, the storage as bytes, key,
    and the bytes its entries cover."""

    slot: tuple
    entries: list[Entry]
    storage: torch.Tensor
    key: tuple[int, int]
    nbytes: int


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


@dataclass
class _Sent:
    """What the hand-over of one publish did (the stream or a replay)."""

    nbytes: int = 0
    handles: int = 0
    buckets: int = 0
    shared: int = 0
    checksums: dict[str, int] | None = None
    samples: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    groups: list[_Group] = field(default_factory=list)
    fresh: list[torch.Tensor] = field(default_factory=list)
    """Buckets of a receiver with ``unsynced_acks``: alive until its ``end_update`` synchronized."""


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

    ``receiver``: an in-process engine (:class:`~colocate.engines.HFEngine`,
    :class:`~colocate.sglang_engine.SGLangEngine`) or a :class:`~colocate.transports.RemoteReceiver`.
    ``device``: where staging buffers live (defaults to CUDA for ``cuda_ipc``, CPU otherwise).
    ``share_min_bytes``: contiguous tensors whose storage has at least this many bytes are sent in
    place instead of packed (``None``: always pack). ``keep_shared``: keep such storages mapped in
    the receiver between publishes (no new handles next time; call :meth:`release_staging` before
    the trainer frees them).

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

    def __init__(self, receiver: WeightReceiver, config: PublishConfig | None = None, *,
                 device: str | torch.device | None = None, share_min_bytes: int | None = 64 << 20,
                 keep_shared: bool = False, replay_sources: Iterable[torch.Tensor] | None = None, arena=None):
        self.receiver = receiver
        self.config = config or PublishConfig()
        self._link = link_to(receiver)
        self.transport = choose_transport(self.config.transport, frozenset(receiver.capabilities()))
        self.device = torch.device(device or ("cuda" if self.transport == "cuda_ipc" else "cpu"))
        # A receiver whose acknowledgement does not mean "copied on the device" (SGLang returns
        # before its copies finish) gets a fresh buffer per bucket, freed after the final sync.
        self._fresh = bool(getattr(receiver, "unsynced_acks", False))
        self._verifies = bool(getattr(receiver, "verifies_checksums", True))
        if self.config.verify == "sampled" and not hasattr(receiver, "sample"):
            raise ConfigError(f"PublishConfig.verify='sampled': receiver {type(receiver).__name__} cannot sample")
        if share_min_bytes is not None and share_min_bytes < 1:
            raise ConfigError(f"Publisher share_min_bytes must be >= 1 or None, got {share_min_bytes!r}")
        self.share_min_bytes, self.keep_shared = share_min_bytes, keep_shared
        self.poisoned: set[int] = set()
        self.last_good: int | None = None
        self.reports: list[PublishReport] = []
        self._staging: list[torch.Tensor | None] = [None] * self.config.max_in_flight
        self._disk: Path | None = Path(self.config.disk_dir) if self.config.disk_dir else None
        self._shared_slots: set[tuple] = set()
        self._plan: _Plan | None = None
        self.plan_reused = 0
        """Publishes that reused the plan (names/shapes/dtypes unchanged, check not re-run)."""
        self._sources = None if replay_sources is None else list(
            {_key(t.untyped_storage()): t.untyped_storage() for t in replay_sources}.values())
        if arena is not None and self._sources is None:
            raise ConfigError("Publisher arena= is for replay: pass replay_sources= (the trainer's parameters) too")
        self.arena = arena
        self._recipe: _Recipe | None = None
        self.replays = 0
        """Publishes that repeated the previous one's hand-overs without reading the stream."""

    # ----- publish ----------------------------------------------------------------------------
    def publish(self, weights: Weights, *, version: int, meta: Meta | None = None,
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
        clock, t = PhaseClock(), self.config.timeout_s
        began, items = False, weights.items() if isinstance(weights, Mapping) else weights
        try:
            if meta is None:  # drained first: the arena cannot record, no recipe is kept
                with clock("convert", stage="check"):
                    items = list(items)
            with clock("begin", stage="check"):
                plan = self._plan_for({n: (tuple(x.shape), x.dtype) for n, x in items} if meta is None else meta,
                                      require_all)
                recipe, self._recipe = self._recipe, None  # set again only by a successful publish
                if recipe is not None and (recipe.plan is not plan or not recipe.unchanged()):
                    recipe = None
            with clock("begin", stage="begin"):
                self._link.call("begin_update", version, timeout=t)
                began = True
            replayed = recipe is not None
            with clock("plan", stage="transfer"):
                if replayed:
                    sent = self._replay(recipe, clock)
                else:
                    sent, recipe = self._send(iter(items), plan, version, clock, record=meta is not None)
            with clock("load", stage="load"):
                self._link.call("end_update", version, sent.checksums, timeout=t)
            with clock("release"):
                self._after_load(sent)
            with clock("verify", stage="verify"):
                self._verify(version, sent)
        except BaseException as e:
            raise self._failed(version, clock.stage, began, e) from e
        return self._succeeded(version, len(plan.meta), sent, recipe, replayed, clock.times)

    def _plan_for(self, meta: Mapping, require_all: bool) -> _Plan:
        """The plan of the last publish if ``meta``, the receiver's specs (asked every time) and
        ``require_all`` are unchanged, else a new one (``check_params`` runs again)."""
        specs = self._link.call("param_specs", timeout=self.config.timeout_s)
        if self._plan is not None and self._plan.matches(meta, specs, require_all):
            self.plan_reused += 1
            return self._plan
        self._plan = None
        self._plan = _Plan.build(meta, specs, require_all)
        return self._plan

    def _send(self, items: Iterator, plan: _Plan, version: int, clock: PhaseClock, *,
              record: bool) -> tuple[_Sent, _Recipe | None]:
        """Stream ``items`` to the receiver; with replay sources (and ``meta`` given) also record
        what a replay of this publish would repeat."""
        recording = self._sources is not None and self.arena is not None
        if recording:
            self.arena.record()
        try:
            sent = _Stream(self, plan, version, clock).run(items)
        finally:
            ops = self.arena.recorded() if recording else None
        return sent, self._record(plan, sent, ops) if self._sources is not None and record else None

    def _after_load(self, sent: _Sent) -> None:
        """Unmap storages shared in place (unless kept), free the buckets of an ``unsynced_acks``
        receiver, and collect the CUDA IPC blocks the receiver has let go of."""
        if not self.keep_shared:
            self._drop_shared()
        if self._fresh:
            self._staging = [None] * self.config.max_in_flight
        sent.fresh = []
        if (self._fresh or not self.keep_shared) and torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def _verify(self, version: int, sent: _Sent) -> None:
        got = self._link.call("weight_version", timeout=self.config.timeout_s)
        if got != version:
            raise UpdateError(f"receiver reports weight_version {got!r} after publishing {version}")
        if self.config.verify == "sampled":
            want = sent.samples or {}
            have = self._link.call("sample", {n: idx for n, (idx, _) in want.items()}, timeout=self.config.timeout_s)
            bad = [n for n, (_, w) in want.items() if not torch.equal(have[n].to(w.dtype), w)]
            if bad:
                raise UpdateError(f"sampled verification: {len(bad)} tensor(s) differ after commit: {bad[:10]}")

    def _failed(self, version: int, stage: str | None, began: bool, cause: BaseException) -> PublishError:
        """Poison ``version``, unmap shared storages, and abort the update on the receiver (roll
        back a commit whose read-back failed); the receiver then does not serve ``version``."""
        self.poisoned.add(version)
        t = self.config.timeout_s
        try:
            self._drop_shared()
        except Exception as err:  # noqa: BLE001 - the receiver may be gone
            log.warning("receiver could not unmap shared storages: %s", err)
            self._shared_slots.clear()
        if began:
            try:
                if stage == "verify" and hasattr(self.receiver, "rollback"):
                    self._link.call("rollback", timeout=t)  # committed but unverified: back to the previous weights
                else:
                    self._link.abort(version, timeout=t)
            except Exception as err:  # noqa: BLE001 - the receiver may be gone
                log.warning("abort/rollback of %s failed: %s", version, err)
        log.error("publish %s poisoned in %s: %s", version, stage, cause)
        return PublishError(version, stage or "check", cause)

    def _succeeded(self, version: int, num_tensors: int, sent: _Sent, recipe: _Recipe | None, replayed: bool,
                   timings: dict[str, float]) -> PublishReport:
        self.last_good, self._recipe = version, recipe
        self.replays += replayed
        rep = PublishReport(version=version, transport=self.transport, num_tensors=num_tensors, nbytes=sent.nbytes,
                            num_buckets=sent.buckets, handles=sent.handles, num_shared=sent.shared, timings=timings,
                            verify=self.config.verify if self._verifies else "version-only", replayed=replayed)
        self.reports.append(rep)
        log.info("published v%s via %s: %d tensors, %.1f MiB, %d buckets, %d shared storages, %s", version,
                 self.transport, num_tensors, rep.nbytes / 2**20, rep.num_buckets, rep.num_shared,
                 {k: round(v * 1e3, 2) for k, v in timings.items()})
        return rep

    # ----- hand-over ------------------------------------------------------------------------------
    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            self._staging[slot] = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if self.transport == "shm":
                buf.share_memory_()
            self._staging[slot] = buf
        return buf

    def _wait(self, clock: PhaseClock, below: int) -> None:
        """Block until fewer than ``below`` hand-overs are unacknowledged."""
        with clock("transfer"):
            self._link.wait(below=below, timeout=self.config.timeout_s)

    def _hand_over(self, slot, entries: list[Entry], buf: torch.Tensor, size: int, version: int, sent: _Sent,
                   clock: PhaseClock) -> int:
        """Give the receiver ``entries`` of ``buf[:size]`` (a bucket or a storage shared in place);
        returns the bytes they cover."""
        with clock("transfer"):
            if self.transport == "disk":
                self._send_file(entries, buf, size, version, sent)
            else:
                sent.handles += self._link.send(slot, entries, buf, size, timeout=self.config.timeout_s)
        covered = sum(e.nbytes for e in entries)
        sent.nbytes += covered
        return covered

    def _send_file(self, entries: list[Entry], buf: torch.Tensor, size: int, version: int, sent: _Sent) -> None:
        self._link.wait(below=1, timeout=self.config.timeout_s)
        if self._disk is None:
            self._disk = Path(tempfile.mkdtemp(prefix="colocate-publish-"))
        path = self._disk / f"v{version}-b{sent.buckets}.bin"
        write_bucket_file(buf, size, path)
        sent.handles += 1
        try:
            self._link.send_file(entries, str(path), size, timeout=self.config.timeout_s)
        finally:
            path.unlink(missing_ok=True)

    def _drop_shared(self) -> None:
        """Make the receiver unmap storages shared in place (so the trainer can free them)."""
        if self._shared_slots:
            self._link.detach(sorted(self._shared_slots), timeout=self.config.timeout_s)
        self._shared_slots.clear()

    def release_staging(self) -> int:
        """Free the staging buffers (returns bytes) and unmap everything the receiver keeps
        mapped (storages kept shared too); they are re-allocated on the next publish."""
        freed = sum(b.numel() for b in self._staging if b is not None)
        self._staging = [None] * self.config.max_in_flight
        self._shared_slots.clear()
        self._recipe = None  # it holds the storages it handed over
        self._link.detach(None, timeout=self.config.timeout_s)
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return freed

    # ----- replay -------------------------------------------------------------------------------
    def _record(self, plan: _Plan, sent: _Sent, ops: list | None) -> _Recipe | None:
        """A recipe from a publish that went wholly in place out of replay sources (and the arena,
        whose fill ``ops`` were all recorded); ``None`` if anything else was involved."""
        if sent.buckets or not sent.groups or self.transport == "disk" or self.config.verify != "none":
            return None
        allowed = {_key(st) for st in self._sources}
        if self.arena is not None:
            if ops is None:
                return None
            allowed.add(_key(self.arena.buffer.untyped_storage()))
        if any(g.key not in allowed for g in sent.groups):
            return None
        if any(_key(t.untyped_storage()) not in allowed for _, reads in ops or () for t in reads):
            return None  # an arena fill read a temporary: re-running it would copy stale bytes
        return _Recipe(plan, sent.groups, [op for op, _ in ops or ()])

    def _replay(self, recipe: _Recipe, clock: PhaseClock) -> _Sent:
        """Re-run the arena's recorded fills, then hand the same storages over with the same entries."""
        with clock("convert"):
            for op in recipe.ops:
                op()
            for dev in {g.storage.device for g in recipe.groups if g.storage.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()  # the fills (and the trainer's writes) are done
        sent, t = _Sent(groups=recipe.groups), self.config.timeout_s
        with clock("transfer"):  # never the disk transport: a recipe holds storages sent in place
            for g in recipe.groups:
                self._link.wait(below=self.config.max_in_flight, timeout=t)
                self._shared_slots.add(g.slot)
                sent.handles += self._link.send(g.slot, g.entries, g.storage, g.storage.numel(), timeout=t)
                sent.nbytes += g.nbytes
                sent.shared += 1
            self._link.wait(below=1, timeout=t)
        return sent


class _Stream:
    """One publish's pass over the stream: each tensor is checked against the plan, then either
    collected under its storage (sent in place) or packed into the current bucket; buckets and
    storages are handed over as they fill, at most ``max_in_flight`` unacknowledged."""

    __slots__ = ("pub", "plan", "version", "clock", "sharing", "entry", "sizes", "limit", "min_bytes", "transport",
                 "sent", "gen", "seen", "bucket", "tensors", "used", "open")

    def __init__(self, pub: Publisher, plan: _Plan, version: int, clock: PhaseClock):
        cfg = pub.config
        self.pub, self.plan, self.version, self.clock = pub, plan, version, clock
        self.sharing = pub.share_min_bytes is not None and pub.transport != "disk"
        # read once per tensor below: kept here (the loop runs ~400 times per publish of an 8B model)
        self.entry, self.sizes, self.limit = plan.entry, plan.sizes, cfg.bucket_bytes
        self.min_bytes, self.transport = pub.share_min_bytes, pub.transport
        self.sent = _Sent(checksums={} if cfg.verify == "checksum" and pub._verifies else None,
                          samples={} if cfg.verify == "sampled" else None)
        self.gen = torch.Generator().manual_seed(version) if cfg.verify == "sampled" else None
        self.seen: set[str] = set()
        self.bucket: list[Entry] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.used = 0
        self.open: dict[tuple[int, int], tuple[torch.Tensor, list[Entry]]] = {}  # in-place groups, oldest first

    def run(self, items: Iterator) -> _Sent:
        """Pull, check and route every tensor; hand the rest over and wait for every ack."""
        meta, seen, sent, pack = self.plan.meta, self.seen, self.sent, self._pack
        share = self._share if self.sharing else None
        fingerprint = self._fingerprint if sent.checksums is not None or sent.samples is not None else None
        for name, t in self.clock.timed(items, "convert"):
            want = meta.get(name)
            if want is None or name in seen or t.dtype != want[1] or t.shape != want[0]:  # Size == tuple
                self._refuse(name, t, want)
            seen.add(name)
            if fingerprint is not None:
                fingerprint(name, t)
            if share is None or not share(name, t):
                pack(name, t)
        self._flush_bucket()
        for key in list(self.open):
            self._flush_group(key)
        self.pub._wait(self.clock, 1)
        if len(seen) != len(meta):  # seen ⊆ meta
            missing = [n for n in meta if n not in seen]
            raise ValueError(f"weights ended before {len(missing)} planned tensor(s): {missing[:10]}")
        if self.pub._fresh:
            sent.handles = len(sent.fresh) + sent.shared
        return sent

    def _refuse(self, name: str, t: torch.Tensor, want) -> None:
        if want is None:
            raise ValueError(f"weights yielded {name!r}, which is not in meta")
        if name in self.seen:
            raise ValueError(f"weights yielded {name!r} twice")
        raise ValueError(f"weights yielded {name!r} as {tuple(t.shape)} {t.dtype}, meta says {want[0]} {want[1]}")

    def _fingerprint(self, name: str, t: torch.Tensor) -> None:
        """Checksum / sample ``t`` when yielded, so a later change of the tensor is caught."""
        sent = self.sent
        with self.clock("bucket"):
            if sent.checksums is not None:
                sent.checksums[name] = tensor_checksum(t)
            if sent.samples is not None:
                n = t.numel()
                idx = torch.randint(0, n, (min(self.pub.config.sample_count, n),), generator=self.gen)
                sent.samples[name] = (idx, t.reshape(-1)[idx.to(t.device)].cpu())

    def _share(self, name: str, t: torch.Tensor) -> bool:
        """Collect ``t`` under its storage if it goes in place: a contiguous view into a storage of
        at least ``share_min_bytes`` that the transport hands over as it is (CUDA for
        ``cuda_ipc``, CPU shared memory for ``shm``, anything in process)."""
        s = t.untyped_storage()
        size, transport = s.nbytes(), self.transport
        if size < self.min_bytes or not t.is_contiguous():
            return False
        if transport == "cuda_ipc" and not t.is_cuda:
            return False
        if transport == "shm" and not (s.device.type == "cpu" and s.is_shared()):  # Tensor.is_shared() minus its wrapper
            return False
        key = (s.data_ptr(), size)
        group = self.open.get(key)
        if group is None:
            if len(self.open) >= Publisher.OPEN_STORAGES:
                self._flush_group(next(iter(self.open)))
            group = self.open[key] = (torch.empty(0, dtype=torch.uint8, device=t.device).set_(s), [])
        group[1].append(self.entry(name, t.storage_offset() * t.dtype.itemsize))
        return True

    def _pack(self, name: str, t: torch.Tensor) -> None:
        size = self.sizes[name]
        if self.bucket and self.used + size > self.limit:
            self._flush_bucket()
        self.bucket.append(self.entry(name, self.used))
        self.tensors[name] = t
        self.used += size

    def _flush_bucket(self) -> None:
        if not self.bucket:
            return
        pub, sent, n = self.pub, self.sent, self.pub.config.max_in_flight
        pub._wait(self.clock, n)
        with self.clock("bucket"):
            size = bucket_nbytes(self.bucket)
            if pub._fresh:
                buf = torch.empty(size, dtype=torch.uint8, device=pub.device)
                sent.fresh.append(buf)  # alive until the receiver's end_update synchronized
            else:
                buf = pub._buffer(sent.buckets % n, max(size, min(pub.config.bucket_bytes, self.plan.cap)))
            pack_bucket(self.tensors, self.bucket, buf)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
        pub._hand_over(sent.buckets % n, self.bucket, buf, size, self.version, sent, self.clock)
        sent.buckets += 1
        self.bucket, self.tensors, self.used = [], {}, 0

    def _flush_group(self, key: tuple[int, int]) -> None:
        storage, entries = self.open.pop(key)
        spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:  # e.g. a generator that reuses one buffer for successive tensors
                raise ValueError(f"weights {a!r} and {b!r} are overlapping views of one storage; tensors must "
                                 "stay unchanged and distinct until publish returns")
        self.pub._wait(self.clock, self.pub.config.max_in_flight)
        if storage.is_cuda:
            torch.cuda.current_stream(storage.device).synchronize()  # producer writes done
        slot = ("shared", *key)
        self.pub._shared_slots.add(slot)
        covered = self.pub._hand_over(slot, entries, storage, storage.numel(), self.version, self.sent, self.clock)
        self.sent.shared += 1
        self.sent.groups.append(_Group(slot, entries, storage, key, covered))
