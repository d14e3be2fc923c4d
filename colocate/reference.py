"""Plain-loop references for the converter and the bucket codec (slow, obvious, fp64-capable).

* :func:`reference_split_qkv` walks the grouped QKV rows head by head.
* :func:`reference_merge_glu` rebuilds the full [gate; up] from per-rank [gate_r; up_r] row by row.
* :func:`reference_tensor_checksum` is the bit-exact weighted integer sum that
  :func:`colocate.buckets.tensor_checksum` computes vectorized.
"""

from __future__ import annotations

import torch

__all__ = ["reference_split_qkv", "reference_merge_glu", "reference_tensor_checksum"]


def reference_split_qkv(qkv: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-by-row split of Megatron ``linear_qkv`` [G·(Q/G+2)·D, ...]: for group g, rows
    ``[g·(Q/G+2)·D, ...)`` hold Q/G query heads, then one key head, then one value head."""
    per = num_heads // num_groups
    q_rows, k_rows, v_rows = [], [], []
    row = 0
    for _g in range(num_groups):
        for _h in range(per):
            q_rows += [qkv[row + d] for d in range(head_dim)]
            row += head_dim
        k_rows += [qkv[row + d] for d in range(head_dim)]
        row += head_dim
        v_rows += [qkv[row + d] for d in range(head_dim)]
        row += head_dim
    return torch.stack(q_rows), torch.stack(k_rows), torch.stack(v_rows)


def reference_merge_glu(shards: list[torch.Tensor]) -> torch.Tensor:
    """Full [gate; up] from TP shards [gate_r; up_r], built row by row."""
    gate, up = [], []
    for s in shards:
        half = s.shape[0] // 2
        gate += [s[i] for i in range(half)]
        up += [s[half + i] for i in range(half)]
    return torch.stack(gate + up)


def reference_tensor_checksum(t: torch.Tensor) -> int:
    """Bit-exact checksum, element by element: sum_i bits(x_i) · (1 + i mod 7) over the
    flattened tensor, where bits() reads the element as a signed integer of its own width;
    wrapped to a signed 64-bit int."""
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat = t.detach().contiguous().reshape(-1).view(width).cpu().tolist()
    total = 0
    for i, x in enumerate(flat):
        total += int(x) * (1 + i % 7)
    total &= (1 << 64) - 1
    return total - (1 << 64) if total >= 1 << 63 else total
