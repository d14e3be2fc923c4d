"""Ranges of a tensor's flattened (row-major) order, for tensors of any strides.

The slabs hold each parameter's state in its logical row-major order (``p.reshape(-1)``), and an
AdamW unit may hold only the range ``[start, start + n)`` of a parameter. For a contiguous tensor
that range is the view ``t.view(-1)[start:start + n]``. A non-contiguous tensor (a transposed or
permuted weight, a strided slice) has no such view, but the range is the union of at most
``2 * t.dim() - 1`` strided blocks: a partial leading row, a run of whole rows ``t[r0:r1]``, a
partial trailing row, recursively. :func:`flat_range_blocks` returns those blocks, so ranges are
read and written in place, without copying the whole tensor.
"""

from __future__ import annotations

import torch

__all__ = ["flat_range_blocks", "read_flat_range", "write_flat_range"]


def flat_range_blocks(t: torch.Tensor, start: int, end: int) -> list[tuple[torch.Tensor, int]]:
    """Views of ``t`` covering ``t.reshape(-1)[start:end]``, each with its offset from ``start``,
    in order; the elements of a view, in its own row-major order, are consecutive in the range."""
    if start >= end:
        return []
    if t.is_contiguous():
        return [(t.view(-1)[start:end], 0)]
    if t.dim() == 1:
        return [(t[start:end], 0)]
    inner = t[0].numel()
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:  # inside one row
        return flat_range_blocks(t[r0], c0, c1)
    out: list[tuple[torch.Tensor, int]] = []
    off = 0
    if c0:  # partial leading row
        out += flat_range_blocks(t[r0], c0, inner)
        off, r0 = inner - c0, r0 + 1
    if r1 > r0:  # whole rows
        out.append((t[r0:r1], off))
        off += (r1 - r0) * inner
    if c1:  # partial trailing row
        out += [(v, off + o) for v, o in flat_range_blocks(t[r1], 0, c1)]
    return out


def read_flat_range(t: torch.Tensor, start: int, out: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``out[:] = t.reshape(-1)[start:start + out.numel()]`` (cast to ``out``'s dtype)."""
    for v, o in flat_range_blocks(t, start, start + out.numel()):
        out[o:o + v.numel()].view(v.shape).copy_(v, non_blocking=non_blocking)


def write_flat_range(t: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """``t.reshape(-1)[start:start + src.numel()] = src`` in place (cast to ``t``'s dtype)."""
    for v, o in flat_range_blocks(t, start, start + src.numel()):
        v.copy_(src[o:o + v.numel()].view(v.shape))
