"""Host → device transfer of planning metadata in one copy that does not block the host.

A pageable ``torch.as_tensor(array, device="cuda")`` is a copy followed by a stream
synchronization: planning a microbatch with a dozen such copies while the GPU still runs the
previous one stalls the host a dozen times. :func:`upload` packs all integer arrays of a plan into
one pinned int64 buffer and issues one ``non_blocking`` copy (PyTorch's pinned-memory allocator
keeps the buffer until the copy is done), returning views of the device buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["upload"]


def upload(arrays: Sequence[np.ndarray], device) -> list[torch.Tensor]:
    """``[torch.as_tensor(a, dtype=int64, device=device) for a in arrays]`` with one transfer.

    On CUDA the arrays go through one pinned host buffer and one non-blocking copy (no host
    synchronization); elsewhere (CPU, ``meta``) they are converted directly. Every result is a
    contiguous int64 tensor of the array's shape (a view of one device buffer on CUDA).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    if dev.type != "cuda":
        return [torch.from_numpy(a).to(dev) if dev.type != "cpu" else torch.from_numpy(a) for a in arrays]
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    flat = host.numpy()
    off = 0
    for a, n in zip(arrays, sizes):
        flat[off:off + n] = a.reshape(-1)
        off += n
    buf = host.to(dev, non_blocking=True)
    out, off = [], 0
    for a, n in zip(arrays, sizes):
        out.append(buf[off:off + n].view(a.shape))
        off += n
    return out
