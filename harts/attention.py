"""Tree attention from O(T) metadata: query ``q`` may attend key ``k`` iff ``k <= q <= last[k]``.

Backends (all take ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with ``Hq % Hkv == 0`` and return
``[T, Hq, D]``):

* ``"dense"``: builds the [T, T] boolean mask and calls SDPA. Tests and tiny inputs only.
* ``"flex"``: FlexAttention with an interval ``mask_mod`` over the O(T) ``last`` tensor. The
  :class:`BlockMask` is built by :func:`build_block_mask` once per microbatch directly from
  per-block min/max of ``last`` (O(T + nb²) work, never a [T, T] tensor) and reused by every
  layer. On CPU, torch 2.11 runs FlexAttention forward only (no backward).
* ``"varlen"``: FlashAttention-2 varlen kernels over the compressed-trie segments, no masked
  work: either keys gathered along each segment's ancestor path, or a cascade of causal self
  attention plus one full attention per tree level merged by log-sum-exp (:mod:`harts.varlen`,
  plan built once per microbatch by :func:`build_varlen_plan`; ``auto`` = the key gather). CUDA
  needs bf16/fp16; CPU runs the same plans on plain-torch kernels.

The dense mask itself lives in :mod:`harts.reference` (:func:`~harts.reference.tree_mask`).
"""

from __future__ import annotations

import math

import torch

from harts.config import AttentionBackend
from harts.reference import tree_attention_reference
from harts.varlen import VarlenPlan, build_varlen_plan, varlen_tree_attention
from mcore_distill.validate import check_choice

__all__ = ["AttentionBackend", "VarlenPlan", "build_block_mask", "build_varlen_plan", "tree_attention",
           "flex_tree_attention", "varlen_tree_attention"]


def _check_last(last: torch.Tensor) -> None:
    if last.dim() != 1:
        raise ValueError(f"last must be 1-D [T], got shape {tuple(last.shape)}")


def build_block_mask(last: torch.Tensor, *, block_size: int = 128):
    """FlexAttention ``BlockMask`` of the tree mask, from O(T) ``last`` [T] (int).

    For query block ``qb = [q0, q1)`` and key block ``kb < qb``: some pair is allowed iff
    ``max(last[kb]) >= q0``; all pairs are allowed iff ``min(last[kb]) >= q1 - 1``. Diagonal
    blocks are partial, blocks above the diagonal empty. Build once per microbatch.
    """
    from torch.nn.attention.flex_attention import BlockMask

    _check_last(last)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    t = last.numel()
    nb = -(-t // block_size)
    dev = last.device
    pad = nb * block_size - t
    lp = torch.nn.functional.pad(last, (0, pad), value=-1).view(nb, block_size)
    lmin = torch.nn.functional.pad(last, (0, pad), value=2**62).view(nb, block_size).amin(1)
    lmax = lp.amax(1)
    starts = torch.arange(nb, device=dev) * block_size
    ends = (starts + block_size).clamp_max(t) - 1  # last query index of each block
    qb = torch.arange(nb, device=dev)[:, None]
    kb = torch.arange(nb, device=dev)[None, :]
    below = kb < qb
    anyb = (below & (lmax[None, :] >= starts[:, None])) | (kb == qb)
    full = below & (lmin[None, :] >= ends[:, None])
    partial = anyb & ~full

    def pack(m: torch.Tensor):
        num = m.sum(1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return num[None, None], idx[None, None]

    last_i = last

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx <= last_i[kv_idx])

    kv_num, kv_idx = pack(partial)
    f_num, f_idx = pack(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, f_num, f_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(t, t))


def _plain_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` as a contiguous tensor (no copy when it already is one)."""
    return x if x.is_contiguous() else x.contiguous()


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask, scale: float,
                        compile: bool | None = None) -> torch.Tensor:
    """FlexAttention over ``[T, H, D]`` inputs with a prebuilt tree ``block_mask``.

    ``compile`` defaults to True on CUDA (eager FlexAttention materializes scores) and False on
    CPU (where torch 2.11 has no FlexAttention backward).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if compile is None:
        compile = q.is_cuda
    fn = torch.compile(flex_attention) if compile else flex_attention  # dynamic after the first new shape
    # Inductor's flex template has no kernel choice for some strided views (e.g. ``v`` sliced out of
    # a fused QKV projection, T-stride != H·D): hand it plain [T, H, D] rows (a copy only then)
    qh, kh, vh = (_plain_rows(x).transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    out = fn(qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, last: torch.Tensor,
                   scale: float | None = None, backend: AttentionBackend | str = AttentionBackend.flex, block_mask=None,
                   varlen_plan: VarlenPlan | None = None, context_rows: int = 0) -> torch.Tensor:
    """Softmax attention restricted to ancestors-or-self in the pre-order tree.

    ``o_q = Σ_{k: k <= q <= last[k]} softmax_k(scale · q·k) v_k``. ``q [T, Hq, D]``,
    ``k, v [T, Hkv, D]``, ``last [T]``; returns ``[T, Hq, D]``. ``block_mask`` (flex) should come
    from :func:`build_block_mask` once per microbatch; it is built here if omitted. ``varlen_plan``
    (varlen) must come from :func:`build_varlen_plan`. ``context_rows = c``: ``k, v`` hold ``c`` rows of
    a shared prefix first (``[c + T, Hkv, D]``), an ancestor chain of every root; varlen only, with a
    plan built with the same ``context_rows``.
    """
    _check_last(last)
    backend = check_choice("backend", backend, AttentionBackend, error=ValueError)
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"expected q [T,Hq,D] and k, v [T,Hkv,D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[0] != last.numel() or k.shape[0] != last.numel() + context_rows:
        raise ValueError(f"q/k length {q.shape[0]}/{k.shape[0]} != len(last) {last.numel()} (+ context_rows "
                         f"{context_rows} for k)")
    if context_rows and (backend != "varlen" or varlen_plan is None or
                         varlen_plan.copy_ptr is None or varlen_plan.copy_ptr.numel() != k.shape[0] + 1):
        raise ValueError(f"context_rows={context_rows} needs backend='varlen' and a plan built with "
                         f"build_varlen_plan(..., context_rows={context_rows})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of key/value heads {k.shape[1]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend == "dense":
        return tree_attention_reference(q, k, v, last=last, scale=scale)
    if backend == "flex":
        if block_mask is None:
            block_mask = build_block_mask(last)
        return flex_tree_attention(q, k, v, block_mask=block_mask, scale=scale)
    if varlen_plan is None:
        raise ValueError("backend='varlen' needs varlen_plan (build_varlen_plan(forest.seg_offsets, forest.seg_parent))")
    return varlen_tree_attention(q, k, v, plan=varlen_plan, scale=scale)
