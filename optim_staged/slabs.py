"""Host slabs (flat state tensors), the unit layout over them, and the slot ring that streams them.

* :class:`StateSlabs` — one flat fp32 tensor per state key (``master_param``, ``exp_avg``, ...),
  all the same length. On CUDA machines the host copy is *registered* with the driver
  (``cudaHostRegister``) instead of being taken from PyTorch's pinned caching allocator, which
  rounds every block up to a power of two (a 10.99 GiB pool would pin 18.1 GiB). Host RAM is
  checked before allocating.
* :class:`Unit` — a contiguous element range ``[start, end)`` of the slabs plus the parameter
  pieces it covers. AdamW units may split parameters; Muon units are one whole matrix.
* :class:`SlotRing` — ``num_slots`` device buffers per key (plus a grad buffer) and three streams
  (H2D, compute, D2H) with one event of each kind per slot. Ordering points:

  1. H2D into a slot waits on that slot's previous D2H event (reuse only after drain-out).
  2. Compute waits on the slot's H2D event and, once per step, on an event recorded on the
     caller's stream at ``step()`` entry (gradients written there, or joined into it, are ready).
  3. D2H waits on the slot's compute event.
  4. The caller's stream waits on the last compute event only: the parameter all-gather can
     start while state drains back to the host. ``drain()`` waits for the last D2H.

  Without CUDA the ring uses CPU buffers and runs every copy synchronously (same code path).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from optim_staged.config import HostMemoryError

__all__ = ["StateSlabs", "Piece", "Unit", "SlotRing", "available_host_bytes", "build_units"]


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
    """Flat state tensors ``{key: [numel]}`` of one dtype on the host (or on a device when resident)."""

    def __init__(self, keys: Sequence[str], numel: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, pin: bool = False, memory_margin: float = 0.9) -> None:
        self.keys = tuple(keys)
        self.numel = int(numel)
        self.device = torch.device(device)
        self.dtype = dtype
        nbytes = self.nbytes_for(len(self.keys), self.numel, dtype)
        if self.device.type == "cpu":
            avail = available_host_bytes()
            if nbytes > memory_margin * avail:
                raise HostMemoryError(
                    f"optimizer state slabs need {nbytes} bytes of host RAM ({len(self.keys)} x {self.numel} "
                    f"x {torch.finfo(dtype).bits // 8} B) but only {avail} bytes are available "
                    f"(host_memory_margin={memory_margin} allows {int(memory_margin * avail)})"
                )
        self.tensors = {k: torch.zeros(self.numel, dtype=dtype, device=self.device) for k in self.keys}
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
        return self.nbytes_for(len(self.keys), self.numel, self.dtype)

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
                *, slot_numel: int) -> list[Unit]:
    """Chunk each group's contiguous slab range into units of at most ``slot_numel`` elements
    (parameters may be split across units). Parameters are listed in slab order."""
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
        pos, k = g_start, i
        while pos < g_end:
            u_end = min(pos + slot_numel, g_end)
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


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor]
    h2d: object = None
    compute: object = None
    d2h: object = None
    used: bool = field(default=False)


class SlotRing:
    """``num_slots`` device buffers per key and the H2D / compute / D2H streams that move them."""

    def __init__(self, keys: Sequence[str], *, slot_numel: int, num_slots: int, device: torch.device | str) -> None:
        self.keys = tuple(keys)
        self.slot_numel = int(slot_numel)
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: list[_Slot] = []
        if self.cuda:
            # Streams are created once per ring (fresh streams per step grow allocator pools).
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.compute_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
        self._prefetched: dict[int, int] = {}  # slot index -> slab start of the prefetched unit

    # ----------------------------------------------------------------- memory
    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self.slots for b in s.buffers.values())

    def ensure_allocated(self) -> None:
        if self.slots:
            return
        for _ in range(self.num_slots):
            bufs = {k: torch.empty(self.slot_numel, dtype=torch.float32, device=self.device) for k in self.keys}
            bufs["grad"] = torch.empty(self.slot_numel, dtype=torch.float32, device=self.device)
            slot = _Slot(bufs)
            if self.cuda:
                slot.h2d, slot.compute, slot.d2h = (torch.cuda.Event() for _ in range(3))
            self.slots.append(slot)

    def drain(self, *, release: bool = True) -> None:
        """Wait for every outstanding D2H; with ``release`` free the slot buffers."""
        if self.cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
            self.compute_stream.synchronize()
        self._prefetched.clear()
        if release:
            self.slots = []

    # --------------------------------------------------------------- pipeline
    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _h2d(self, slot_index: int, unit: Unit, slabs: StateSlabs) -> None:
        slot = self.slots[slot_index]
        with self._stream(self.h2d_stream if self.cuda else None):
            if self.cuda and slot.used:
                self.h2d_stream.wait_event(slot.d2h)  # (1) reuse only after the slot drained out
            for k in self.keys:
                slot.buffers[k][: unit.numel].copy_(slabs[k][unit.start:unit.end], non_blocking=True)
            if self.cuda:
                slot.h2d.record(self.h2d_stream)

    def prefetch(self, units: Sequence[Unit], slabs: StateSlabs) -> None:
        """Start H2D of the first ``num_slots`` units; needs no gradients."""
        self.ensure_allocated()
        for i, unit in enumerate(units[: self.num_slots]):
            if self._prefetched.get(i) == unit.start:
                continue
            self._h2d(i, unit, slabs)
            self._prefetched[i] = unit.start

    def run(self, units: Sequence[Unit], slabs: StateSlabs,
            compute: Callable[[Unit, dict[str, torch.Tensor]], None]) -> None:
        """Stream every unit: H2D -> ``compute(unit, views)`` on the compute stream -> D2H.

        ``views[k]`` are the slot buffers narrowed to the unit (``views['grad']`` is scratch for
        the gathered gradient). Returns after enqueueing; the caller stream waits on compute.
        """
        if not units:
            return
        self.ensure_allocated()
        caller = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(caller)  # (2) grads written on (or joined into) the caller stream
            self.compute_stream.wait_event(ready)
        n = self.num_slots
        for i, unit in enumerate(units):
            si = i % n
            slot = self.slots[si]
            if i < n and self._prefetched.get(si) == unit.start:
                pass  # state already on its way
            else:
                self._h2d(si, unit, slabs)
            views = {k: b[: unit.numel] for k, b in slot.buffers.items()}
            with self._stream(self.compute_stream if self.cuda else None):
                if self.cuda:
                    self.compute_stream.wait_event(slot.h2d)
                compute(unit, views)
                if self.cuda:
                    slot.compute.record(self.compute_stream)
            with self._stream(self.d2h_stream if self.cuda else None):
                if self.cuda:
                    self.d2h_stream.wait_event(slot.compute)  # (3)
                for k in self.keys:
                    slabs[k][unit.start:unit.end].copy_(views[k], non_blocking=True)
                if self.cuda:
                    slot.d2h.record(self.d2h_stream)
            slot.used = True
        self._prefetched.clear()
        if self.cuda:
            caller.wait_stream(self.compute_stream)  # (4) caller waits on compute only
