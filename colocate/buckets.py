"""Flattened buckets: many named tensors of mixed dtypes packed into one byte buffer.

A bucket is a ``uint8`` buffer plus :class:`Entry` records ``(name, dtype, shape, offset)``;
offsets are aligned to 256 bytes so every entry can be viewed in place with its own dtype.
One bucket means one IPC handle / shared-memory segment / file, however many tensors it holds.
The same records describe tensors that already live in one large storage (the publisher's
in-place path): the "buffer" is then that storage viewed as bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["Entry", "align", "nbytes", "bucket_nbytes", "plan_buckets", "pack_bucket", "unpack_bucket", "copy_tensors",
           "tensor_checksum", "ALIGN", "FOREACH_MAX_BYTES"]

ALIGN = 256
# Below this size a tensor's copy is launch-bound: batch those in one ``_foreach_copy_``. Above it
# each tensor gets torch's plain copy kernel (the device-copy floor: 16.4 GB in 399 copies took
# 8.8 ms on the H200). Whether the foreach kernel is slower for large tensors was not isolated:
# the publish transfers measured 12-15 ms both ways (2026-11-30, benchmarks.md).
FOREACH_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor inside a bucket: byte ``offset``, ``dtype``, ``shape`` (contiguous)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a ``(shape, dtype)`` tensor (``dtype.itemsize``: no allocation to ask it)."""
    n = dtype.itemsize
    for x in shape:
        n *= int(x)
    return n


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(meta: Iterable[tuple[str, tuple[int, ...], torch.dtype]], *, bucket_bytes: int
                 ) -> list[list[Entry]]:
    """Greedy in-order packing of ``(name, shape, dtype)`` into buckets of at most
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own)."""
    buckets: list[list[Entry]] = []
    cur: list[Entry] = []
    used = 0
    for name, shape, dtype in meta:
        e = Entry(name, dtype, tuple(int(s) for s in shape), 0)
        size = align(e.nbytes)
        if cur and used + size > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(Entry(name, dtype, e.shape, used))
        used += size
    if cur:
        buckets.append(cur)
    return buckets


def bucket_nbytes(entries: list[Entry]) -> int:
    """Bytes a buffer needs to hold ``entries``."""
    last = entries[-1]
    return align(last.offset + last.nbytes)


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, non_blocking: bool = False,
                 foreach_max_bytes: int = FOREACH_MAX_BYTES) -> None:
    """``dst.copy_(src)`` for every pair: tensors under ``foreach_max_bytes`` in one
    ``_foreach_copy_`` (one batched launch), larger ones each with its own copy kernel."""
    small_d, small_s = [], []
    for d, s in zip(dsts, srcs, strict=True):
        if d.numel() * d.element_size() < foreach_max_bytes:
            small_d.append(d)
            small_s.append(s)
        else:
            d.copy_(s, non_blocking=non_blocking)
    if small_d:
        torch._foreach_copy_(small_d, small_s, non_blocking=non_blocking)


def pack_bucket(tensors: dict[str, torch.Tensor], entries: list[Entry], buffer: torch.Tensor) -> None:
    """Copy each entry's tensor into ``buffer`` (uint8, ≥ :func:`bucket_nbytes`) at its offset
    (:func:`copy_tensors`: small entries batched, large ones one copy kernel each)."""
    srcs = [tensors[e.name] for e in entries]
    for e, t in zip(entries, srcs):
        if t.shape != e.shape or t.dtype != e.dtype:
            raise ValueError(f"pack_bucket: {e.name} is {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
    copy_tensors([view(buffer, e) for e in entries], srcs)


def view(buffer: torch.Tensor, e: Entry) -> torch.Tensor:
    """The entry's tensor as a view into ``buffer`` (no copy)."""
    return buffer[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape)


def unpack_bucket(buffer: torch.Tensor, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """Views of every entry in ``buffer`` by name (no copy)."""
    return {e.name: view(buffer, e) for e in entries}


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor, *, chunk: int = 1 << 24) -> int:
    """Bit-exact, device-independent checksum: ``sum_i bits(x_i)·(1 + i mod 7)`` in wrapping
    int64, ``bits`` reading each element as a signed int of its width (reference:
    :func:`colocate.reference.reference_tensor_checksum`). Works in chunks of ``chunk``
    elements, so the int64 temporaries stay bounded."""
    flat = t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start: start + chunk].to(torch.int64)
        w = (torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64) % 7) + 1
        total += (part * w).sum()
    return int(total.item())
