"""Host slabs (flat state tensors), the unit layout over them, and the slot ring that streams them.

* :class:`StateSlabs` — one flat fp32 tensor per state key (``master_param``, ``exp_avg``, ...),
  all the same length. On CUDA machines the host copy is *registered* with the driver
  (``cudaHostRegister``) instead of being taken from PyTorch's pinned caching allocator, which
  rounds every block up to a power of two (a 10.99 GiB pool would pin 18.1 GiB). Host RAM is
  checked before allocating.
* :class:`Unit` — a contiguous element range ``[start, end)`` of the slabs plus the parameter
  pieces it covers. AdamW units may split parameters; Muon units are one whole matrix.
* :class:`SlotRing` — ``num_slots`` device buffers per key, one fp32 scratch buffer, and three
  streams (H2D, compute, D2H) with per-slot events. Ordering points:

  0. Slot buffers are allocated on the H2D stream, their first writer (not on the caller's
     stream, whose queued work the first H2D would not be ordered after).
  1. H2D into a slot waits on that slot's previous D2H (reuse only after drain-out); once per
     step the H2D stream also waits for the D2H stream, so a host range is read only after its
     last write-back.
  2. Compute waits on the slot's H2D event (late keys: inside the compute, before they are used)
     and, once per step, on an event recorded on the caller's stream at ``step()`` entry
     (gradients written there, or joined into it, are ready).
  3. D2H of the early keys waits on the compute's early-done event, D2H of the late keys on the
     compute event.
  4. The caller's stream waits on compute only: the parameter all-gather can start while state
     drains. ``drain()`` writes back cached slots and waits for the last D2H.

  Slots double as a write-back cache (``keep_resident``): the last ``num_slots`` units of a step
  stay in their slots and the next step walks the units in reverse, starting on them without any
  transfer (and without waiting for the previous step's D2H tail).

  Without CUDA the ring uses CPU buffers and runs every copy synchronously (same code path, same
  cache, so CPU tests cover its logic).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from optim_staged.config import HostMemoryError

__all__ = ["StateSlabs", "host_zeros", "Piece", "Unit", "SlotRing", "Phases", "available_host_bytes", "build_units"]


def available_host_bytes() -> int:
    """Currently available host RAM in bytes (``MemAvailable``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a declared dependency
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise


_HUGE = 2 << 20  # bytes in one transparent huge page (x86-64; arm64 with 4 KiB base pages)


def host_zeros(numel: int, dtype: torch.dtype = torch.float32, *, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor of ``numel`` elements. With ``huge_pages`` (and >= 2 MiB, on a system
    with ``MADV_HUGEPAGE``) it lives in its own anonymous mapping, 2 MiB-aligned and advised for
    transparent huge pages, pre-faulted by a parallel ``zero_()``; the tensor keeps the mapping
    alive (``torch.frombuffer``) and it is unmapped when the last view is freed. A kernel that
    refuses the advice (built without transparent huge pages: ``EINVAL``) leaves ordinary pages."""
    nbytes = numel * _itemsize(dtype)
    if not huge_pages or nbytes < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    try:
        mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise HostMemoryError(f"mapping {nbytes + _HUGE} bytes of host memory for a state slab failed: {e}") from e
    anchor = ctypes.c_char.from_buffer(mm)
    off = -ctypes.addressof(anchor) % _HUGE
    del anchor  # releases the buffer export taken to read the address
    with contextlib.suppress(OSError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off).view(dtype).zero_()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _register(t: torch.Tensor) -> int | None:
    """Pin ``t``'s host memory in place (exact size, no power-of-two rounding); returns the pointer
    to unregister later, or None for an empty tensor."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return None
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    return t.data_ptr()


def _unregister(ptrs: list[int]) -> None:
    for ptr in ptrs:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(ptr)


class StateSlabs:
    """Flat state tensors ``{key: [numel]}`` on the host (or on a device when resident).

    ``dtype`` is one dtype for every key, or a ``{key: dtype}`` mapping (keys it omits are fp32),
    e.g. bf16 moments next to an fp32 master. ``huge_pages``: host tensors from :func:`host_zeros`."""

    def __init__(self, keys: Sequence[str], numel: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | Mapping[str, torch.dtype] = torch.float32, pin: bool = False,
                 memory_margin: float = 0.9, huge_pages: bool = False) -> None:
        self.keys = tuple(keys)
        self.numel = int(numel)
        self.device = torch.device(device)
        if isinstance(dtype, torch.dtype):
            self.dtypes = {k: dtype for k in self.keys}
        else:
            self.dtypes = {k: dtype.get(k, torch.float32) for k in self.keys}
        self.dtype = self.dtypes[self.keys[0]] if self.keys else torch.float32
        nbytes = self.nbytes
        if self.device.type == "cpu":
            avail = available_host_bytes()
            if nbytes > memory_margin * avail:
                per = "+".join(str(_itemsize(self.dtypes[k])) for k in self.keys)
                raise HostMemoryError(
                    f"optimizer state slabs need {nbytes} bytes of host RAM ({self.numel} x ({per}) B) but only "
                    f"{avail} bytes are available "
                    f"(host_memory_margin={memory_margin} allows {int(memory_margin * avail)})"
                )
        if self.device.type == "cpu":
            self.tensors = {k: host_zeros(self.numel, self.dtypes[k], huge_pages=huge_pages) for k in self.keys}
        else:
            self.tensors = {k: torch.zeros(self.numel, dtype=self.dtypes[k], device=self.device) for k in self.keys}
        self.pinned = False
        if pin and self.device.type == "cpu" and torch.cuda.is_available():
            self.pin()

    def pin(self) -> None:
        """Register the slabs with the CUDA driver; unregistered when this object is collected
        (before its tensors are freed)."""
        if self.pinned:
            return
        ptrs = [p for p in (_register(t) for t in self.tensors.values()) if p is not None]
        weakref.finalize(self, _unregister, ptrs)
        self.pinned = True

    @staticmethod
    def nbytes_for(num_keys: int, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return num_keys * numel * (torch.finfo(dtype).bits // 8)

    @property
    def nbytes(self) -> int:
        return sum(self.numel * _itemsize(self.dtypes[k]) for k in self.keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of one parameter inside a unit: ``param.view(-1)[p_start:p_start+numel]`` sits at
    ``unit_offset`` within the unit (and at ``unit.start + unit_offset`` in the slabs)."""

    param_index: int
    p_start: int
    numel: int
    unit_offset: int


@dataclass(frozen=True, slots=True)
class Unit:
    """A contiguous slab range ``[start, end)`` streamed through one slot; ``group`` indexes
    ``param_groups``; ``shape`` is set for whole-matrix units."""

    group: int
    start: int
    end: int
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


def build_units(param_numels: Sequence[int], param_offsets: Sequence[int], param_groups: Sequence[int],
                *, slot_numel: int, whole_params: bool = False) -> list[Unit]:
    """Chunk each group's contiguous slab range into units of at most ``slot_numel`` elements
    (parameters may be split across units). Parameters are listed in slab order.

    ``whole_params``: a unit holds either one part of a single parameter or several whole
    parameters (a parameter that does not fit the rest of a unit starts a new one; one larger
    than a unit gets units of its own), so a unit never waits for two parameters of which one is
    only partly in it (gradients consumed as they arrive)."""
    units: list[Unit] = []
    n = len(param_numels)
    i = 0
    while i < n:
        g = param_groups[i]
        j = i
        while j < n and param_groups[j] == g:
            j += 1
        g_start = param_offsets[i]
        g_end = param_offsets[j - 1] + param_numels[j - 1]
        ends = _aligned_ends(param_numels[i:j], param_offsets[i:j], slot_numel) if whole_params else None
        pos, k = g_start, i
        while pos < g_end:
            u_end = min(pos + slot_numel, g_end) if ends is None else ends[pos]
            pieces = []
            while k < j and param_offsets[k] + param_numels[k] <= pos:
                k += 1
            kk = k
            while kk < j and param_offsets[kk] < u_end:
                s = max(pos, param_offsets[kk])
                e = min(u_end, param_offsets[kk] + param_numels[kk])
                if e > s:
                    pieces.append(Piece(kk, s - param_offsets[kk], e - s, s - pos))
                kk += 1
            units.append(Unit(g, pos, u_end, tuple(pieces)))
            pos = u_end
        i = j
    return units


def _aligned_ends(numels: Sequence[int], offsets: Sequence[int], slot_numel: int) -> dict[int, int]:
    """Unit start -> unit end for ``build_units(whole_params=True)`` over one group."""
    ends: dict[int, int] = {}
    start, fill = offsets[0], 0
    for n, o in zip(numels, offsets):
        if n > slot_numel:  # close the open unit; whole units of this parameter, remainder alone
            if fill:
                ends[start] = o
            for a in range(o, o + n, slot_numel):
                ends[a] = min(a + slot_numel, o + n)
            start, fill = o + n, 0
        elif fill + n > slot_numel:
            ends[start] = o
            start, fill = o, n
        else:
            fill += n
    if fill:
        ends[start] = start + fill
    return ends


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor]
    h2d_early: object = None
    h2d_late: object = None
    compute_early: object = None
    compute: object = None
    d2h: object = None


class Phases:
    """Handed to the per-unit compute: ``early_done()`` marks the early keys final (their D2H may
    start while the compute goes on), ``wait_late()`` makes the compute wait for the late keys' H2D."""

    __slots__ = ("_ring", "_slot", "early_marked")

    def __init__(self, ring: SlotRing, slot: _Slot) -> None:
        self._ring, self._slot, self.early_marked = ring, slot, False

    def early_done(self) -> None:
        if self._ring.cuda:
            self._slot.compute_early.record(self._ring.compute_stream)
        self.early_marked = True

    def wait_late(self) -> None:
        if self._ring.cuda and self._ring.late_keys:
            self._ring.compute_stream.wait_event(self._slot.h2d_late)


class SlotRing:
    """``num_slots`` device buffers per key, the H2D / compute / D2H streams that move them, and a
    small write-back cache: with ``keep_resident`` the last ``num_slots`` units of a step stay in
    their slots (not copied back), and the next step walks the units in the opposite order so it
    starts on them with no transfer. Host slabs are current after :meth:`drain`.

    ``late_keys`` are needed only at the end of a unit's compute (Muon's master weight): their H2D
    is queued after the early keys' and awaited by the compute through :class:`Phases`.

    ``dtypes`` maps keys to their slot dtype (fp32 when omitted).
    """

    def __init__(self, keys: Sequence[str], *, slot_numel: int, num_slots: int, device: torch.device | str,
                 late_keys: Sequence[str] = (), keep_resident: bool = True,
                 dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        self.keys = tuple(keys)
        self.dtypes = {k: (dtypes or {}).get(k, torch.float32) for k in self.keys}
        self.late_keys = tuple(k for k in self.keys if k in late_keys)
        self.early_keys = tuple(k for k in self.keys if k not in late_keys)
        self.slot_numel = int(slot_numel)
        self.num_slots = int(num_slots)
        self.keep_resident = bool(keep_resident)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: list[_Slot] = []
        self._scratch: torch.Tensor | None = None
        if self.cuda:
            # Streams are created once per ring (fresh streams per step grow allocator pools).
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.compute_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
            # ends of the last run() on the compute and D2H streams (timed: rate measurements)
            self.end_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._reset_cache()

    def _reset_cache(self) -> None:
        n = self.num_slots
        self._held: list[int | None] = [None] * n  # slab start of the unit whose current state a slot holds
        self._dirty: list[Unit | None] = [None] * n  # unit whose slot copy is newer than the host slab
        self._lru: list[int] = list(range(n))  # least recently used first
        self._slabs: StateSlabs | None = None  # slabs the cache refers to
        self._written_back: set[int] = set()

    # ----------------------------------------------------------------- memory
    @property
    def allocated_bytes(self) -> int:
        n = sum(b.numel() * b.element_size() for s in self.slots for b in s.buffers.values())
        return n + (0 if self._scratch is None else self._scratch.numel() * self._scratch.element_size())

    def ensure_allocated(self) -> None:
        """Allocate the slot buffers on the H2D stream, their first writer (ordering point 0).

        Allocated on the caller's stream instead, two writes race with the first H2D into a
        fresh slot, which nothing orders after the caller's queued work: the caching allocator
        may hand out a block the caller freed while its kernels (a backward temporary, a pending
        NCCL all-gather) still use it, and with ``torch.use_deterministic_algorithms(True)``
        ``torch.empty`` enqueues a NaN fill of the new block on the caller's stream. On the H2D
        stream both happen before the copies. The buffers are also marked as used by the compute
        and D2H streams (``record_stream``), so that if they are freed without :meth:`drain`
        the allocator waits for those streams before reusing the memory."""
        if self.slots:
            return
        with self._stream(self.h2d_stream if self.cuda else None):
            for _ in range(self.num_slots):
                bufs = {k: torch.empty(self.slot_numel, dtype=self.dtypes[k], device=self.device)
                        for k in self.keys}
                slot = _Slot(bufs)
                if self.cuda:
                    for b in bufs.values():
                        b.record_stream(self.compute_stream)
                        b.record_stream(self.d2h_stream)
                    slot.h2d_early, slot.h2d_late, slot.compute_early, slot.compute, slot.d2h = (
                        torch.cuda.Event() for _ in range(5))
                self.slots.append(slot)

    def scratch(self, numel: int) -> torch.Tensor:
        """An fp32 buffer of ``numel`` elements for the unit being computed (e.g. a gradient cast
        to fp32). One buffer serves every slot: all compute runs on one stream. Allocated once."""
        if self._scratch is None or self._scratch.numel() < numel:  # grows only for whole resident params
            cur = torch.cuda.current_stream(self.device) if self.cuda else None
            off_ring = self.cuda and cur != self.compute_stream  # resident units compute on the caller's stream
            if off_ring:  # the allocation (block reuse, deterministic NaN fill) after the caller's uses
                self.compute_stream.wait_stream(cur)
            with self._stream(self.compute_stream if self.cuda else None):
                self._scratch = torch.empty(max(numel, self.slot_numel), dtype=torch.float32, device=self.device)
            if off_ring:  # and the caller's writes after the allocation
                cur.wait_stream(self.compute_stream)
                self._scratch.record_stream(cur)
        return self._scratch[:numel]

    def drain(self, *, release: bool = True) -> None:
        """Write back every slot that is newer than the host slabs and wait for all transfers; with
        ``release`` free the slot buffers (the cache is dropped), else keep them and their content."""
        for si in range(len(self.slots)):
            if self._dirty[si] is not None:
                self._write_back(si)
        if self.cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
            self.compute_stream.synchronize()
        self._written_back.clear()
        if release:
            self.slots = []
            self._scratch = None
            self._reset_cache()

    def release(self) -> None:
        """Free the slot buffers and the scratch without waiting for the streams (no slot may hold
        unwritten state). Safe because every buffer is marked as used by the compute and D2H
        streams (``record_stream``) and was allocated on the H2D stream: the caching allocator
        hands the memory out again only after those uses. Unlike :meth:`drain` this does not
        block the host, so a step can give its slots back before the next backward pass."""
        if any(d is not None for d in self._dirty):
            raise RuntimeError("SlotRing.release() with unwritten slots: use drain()")
        self.slots = []
        self._scratch = None
        self._reset_cache()

    def forget(self) -> None:
        """Drop the cache after the host slabs were written or replaced (call after :meth:`drain`).

        Also waits for the ring's transfer streams (a no-op after :meth:`drain`): no H2D may
        still read, and no D2H still write, a host range whose cache entry is dropped here."""
        if any(d is not None for d in self._dirty):
            raise RuntimeError("SlotRing.forget() with unwritten slots: call drain() first")
        if self.cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
        self._reset_cache()

    # --------------------------------------------------------------- pipeline
    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _touch(self, si: int) -> None:
        self._lru.remove(si)
        self._lru.append(si)

    def _bind(self, slabs: StateSlabs) -> None:
        if self._slabs is not slabs:  # new slabs (load_state_dict): nothing cached refers to them
            if any(d is not None for d in self._dirty):
                raise RuntimeError("SlotRing: slabs replaced while slots hold unwritten state")
            self._reset_cache()
            self._slabs = slabs

    def _write_back(self, si: int) -> None:
        """D2H of the unit in slot ``si``: early keys after its early-done event, late keys after
        its compute event."""
        slot, unit, slabs = self.slots[si], self._dirty[si], self._slabs
        with self._stream(self.d2h_stream if self.cuda else None):
            if self.cuda and self.early_keys:
                self.d2h_stream.wait_event(slot.compute_early)  # (3) state final on the device
            for k in self.early_keys:
                slabs[k][unit.start:unit.end].copy_(slot.buffers[k][: unit.numel], non_blocking=True)
            if self.cuda and self.late_keys:
                self.d2h_stream.wait_event(slot.compute)
            for k in self.late_keys:
                slabs[k][unit.start:unit.end].copy_(slot.buffers[k][: unit.numel], non_blocking=True)
            if self.cuda:
                slot.d2h.record(self.d2h_stream)
        self._dirty[si] = None
        self._written_back.add(unit.start)

    def _load(self, unit: Unit, slabs: StateSlabs, *, protect: set[int]) -> int:
        """H2D of ``unit`` into the least recently used slot not holding a unit in ``protect``."""
        si = next((s for s in self._lru if self._held[s] is None or self._held[s] not in protect), self._lru[0])
        if self._dirty[si] is not None:
            self._write_back(si)
        slot = self.slots[si]
        with self._stream(self.h2d_stream if self.cuda else None):
            if self.cuda:
                self.h2d_stream.wait_event(slot.d2h)  # (1) slot reused only after it drained out
                if unit.start in self._written_back:  # host range written back this step: read after it
                    self.h2d_stream.wait_stream(self.d2h_stream)
            for k in self.early_keys:
                slot.buffers[k][: unit.numel].copy_(slabs[k][unit.start:unit.end], non_blocking=True)
            if self.cuda:
                slot.h2d_early.record(self.h2d_stream)
            for k in self.late_keys:
                slot.buffers[k][: unit.numel].copy_(slabs[k][unit.start:unit.end], non_blocking=True)
            if self.cuda and self.late_keys:
                slot.h2d_late.record(self.h2d_stream)
        self._held[si] = unit.start
        self._touch(si)
        return si

    def _begin(self, slabs: StateSlabs, *, after_write_backs: bool = True) -> None:
        self.ensure_allocated()
        self._bind(slabs)
        if not after_write_backs:
            return
        self._written_back.clear()
        if self.cuda:  # host ranges written back by earlier steps are read only after that D2H
            self.h2d_stream.wait_stream(self.d2h_stream)

    def _order(self, units: Sequence[Unit], reverse: bool) -> list[Unit]:
        return list(reversed(units)) if (self.keep_resident and reverse) else list(units)

    def prefetch(self, units: Sequence[Unit], slabs: StateSlabs, *, reverse: bool = False,
                 after_write_backs: bool = True) -> None:
        """Start H2D of the next step's first ``num_slots`` units that are not already in a slot;
        needs no gradients. ``reverse`` must be what the next :meth:`run` gets.

        Within a step streamed in several calls (gradient hooks), ``after_write_backs=False``
        prefetches the units of the next call: their host ranges were not written back in this
        step, so their H2D need not wait for the D2H stream. A prefetched slot is clean; a later
        load may evict it (its host range is still current)."""
        if not units:
            return
        self._begin(slabs, after_write_backs=after_write_backs)
        first = self._order(units, reverse)[: self.num_slots]
        want = {u.start for u in first}
        for unit in first:
            if unit.start not in self._held:
                self._load(unit, slabs, protect=want)

    def run(self, units: Sequence[Unit], slabs: StateSlabs,
            compute: Callable[[Unit, dict[str, torch.Tensor], Phases], None], *, reverse: bool = False,
            join_caller: bool = True, after_write_backs: bool = True) -> None:
        """Stream every unit: H2D (unless cached) -> ``compute(unit, views, phases)`` on the compute
        stream -> D2H (the last ``num_slots`` units stay in their slots with ``keep_resident``).

        ``views[k]`` are the slot buffers narrowed to the unit. Returns after enqueueing; the
        caller stream waits on compute only. ``reverse`` walks the units last to first (with
        ``keep_resident``); callers alternate it per step, identically on every rank (TP
        collectives inside the compute follow this order).

        A step may also be streamed in several calls (units as they become ready, e.g. from
        gradient hooks): later calls pass ``after_write_backs=False`` (their host ranges were not
        written back in this step, so their H2D need not wait for the D2H stream) and
        ``join_caller=False`` (the caller's stream must not wait on the compute yet: it is still
        running the backward pass); the caller joins ``compute_stream`` itself at the end.
        """
        if not units:
            return
        self._begin(slabs, after_write_backs=after_write_backs)
        order = self._order(units, reverse)
        keep = {u.start for u in order[-self.num_slots:]} if self.keep_resident else set()
        caller = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(caller)  # (2) grads written on (or joined into) the caller stream
            self.compute_stream.wait_event(ready)
        upcoming = [u.start for u in order]
        for i, unit in enumerate(order):
            try:
                si = self._held.index(unit.start)
                self._touch(si)
            except ValueError:
                si = self._load(unit, slabs, protect=set(upcoming[i:i + self.num_slots]))
            slot = self.slots[si]
            views = {k: b[: unit.numel] for k, b in slot.buffers.items()}
            phases = Phases(self, slot)
            with self._stream(self.compute_stream if self.cuda else None):
                if self.cuda:
                    self.compute_stream.wait_event(slot.h2d_early)
                    self.compute_stream.wait_event(slot.d2h)  # an earlier write-back still reading it
                compute(unit, views, phases)
                if self.cuda:
                    slot.compute.record(self.compute_stream)
                    if not phases.early_marked:
                        slot.compute_early.record(self.compute_stream)
            self._dirty[si] = unit
            if unit.start not in keep:
                self._write_back(si)
        if self.cuda:
            self.end_events[0].record(self.compute_stream)
            self.end_events[1].record(self.d2h_stream)
            if join_caller:
                caller.wait_stream(self.compute_stream)  # (4) caller waits on compute only
