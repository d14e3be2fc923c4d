"""Tree attention on FlashAttention-2 varlen kernels (``backend="varlen"`` of
:func:`harts.attention.tree_attention`).

Rows are a pre-order forest split into segments (``seg_offsets``, ``seg_parent``): a row of
segment ``s`` attends every row of the ancestors of ``s`` and, causally, the rows of ``s`` up to
itself. Two exact plans, chosen per microbatch by :func:`build_varlen_plan`:

* ``"gather"``: one varlen sequence per segment whose keys are gathered along its ancestor path
  (bottom-right causal alignment); a segment and its first child, which follows it in pre-order,
  share one sequence. Simple, one kernel call, but every other child re-reads (and in the
  backward re-accumulates) its prefix: key-side work is ``K = Σ_i |path(last segment of i)|``
  rows, which for a GRPO group is ΣL minus the prompt.
* ``"levels"`` (cascade): ``o = merge(o_self, o_1, …, o_Λ)`` where ``o_self`` is plain causal THD
  over the segments themselves (no gather) and ``o_ℓ`` is full (non-causal) attention of the rows
  *below* each depth-ℓ segment ``a`` — the contiguous pre-order range ``[end(a), subtree_end(a))``
  — to the rows of ``a``. Every key row is read once per level it belongs to, so key-side work is
  ``T``; the price is ``Q = Σ_ℓ Q_ℓ`` gathered query rows. Partial outputs merge by their
  log-sum-exp: ``lse = logaddexp(lse_a, lse_b)``, ``o = e^{lse_a−lse} o_a + e^{lse_b−lse} o_b``.
  The backward is exact without a gradient through the partial ``lse``: each partial call's
  flash backward runs with the *merged* ``o`` and ``lse`` (``P = exp(s − lse)`` are then the
  global softmax weights of its keys and ``D = rowsum(dO ∘ o)`` the global one), and the partial
  gradients add up.

In the backward the gather plan hands FlashAttention keys and values expanded to the query heads
(:func:`gather_kv`, one Triton launch for both): the kernel then writes ``dk, dv`` per query
head, and one pass (:func:`sum_kv_copies`: fp32 registers, one rounding, no atomics)
sums each shared row's copies and each key head's query heads together. With grouped keys the
kernel would sum the heads itself over all ``K`` gathered rows, and a second pass would sum the
copies: on an H200 (6-layer Qwen3-1.7B-width GPT, 16 query / 8 key heads, ρ = 0.75) those two passes
took 0.50 ms per layer, the gathers of ``k`` and a strided ``v`` 0.20 ms; the expanded gather takes
0.12 ms and the fused sum 0.11 ms. Only the backward needs the expansion: by default the forward
gathers grouped keys (the kernel maps query head ``h`` to key head ``h // rep`` itself), saves the
compact ``k, v`` (``2·T·Hkv·D`` elements per layer, less than the ``2·K·Hkv·D`` gathered keys that
a plain varlen call would save) and the backward gathers again, expanded;
``save_gathered_kv=True`` gathers expanded once and saves those ``2·K·Hq·D`` instead, skipping a
gather. ``"auto"`` is ``"gather"`` (measured on the same GPT before the expansion, the cascade
was 0.9 % slower at ``K − T = 8 Q``, GRPO with 4000-token prompts, and 4.5 % slower at 4.8 Q);
``"levels"`` stays available and never materializes ``K`` gathered rows, not even transiently.
On CPU the same plans run on plain-torch kernels (:func:`attention_with_lse`,
:func:`attention_backward`) that follow the flash math, so the fp64 tests check the
decomposition and the backward formula themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from harts.reference import bottom_right_causal, segment_attention_reference
from harts.upload import upload

__all__ = ["VarlenLevel", "VarlenMode", "VarlenPlan", "attention_backward", "attention_with_lse",
           "build_varlen_plan", "gather_kv", "gather_kv_torch", "gather_kv_triton", "sum_kv_copies", "sum_row_copies_reference",
           "varlen_tree_attention"]

VarlenMode = Literal["auto", "gather", "levels"]


@dataclass(frozen=True, eq=False)
class VarlenLevel:
    """One cascade level: sequence ``i`` has queries ``q_index[cu_q[i]:cu_q[i+1]]`` (rows below a
    depth-ℓ segment) and keys ``k_index[cu_k[i]:cu_k[i+1]]`` (that segment's rows). ``q_local``:
    positions of ``q_index`` within the first level's ``q_index`` (every non-root row, the rows
    whose partial outputs are merged)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_local: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """Plan of the varlen backend (see the module docstring).

    ``mode == "gather"``: varlen sequence ``i`` has queries ``cu_q[i]:cu_q[i+1]`` (one segment, or
    a chain of first children that follow their parents) and keys ``kv_index[cu_k[i]:cu_k[i+1]]``
    (the last segment's path); ``kv_index`` is None for a forest of chains (plain THD: keys are the
    rows themselves, no gather, ``cu_q`` the segment offsets). ``mode == "levels"``: ``cu_k ==
    cu_q`` (the segment offsets) is the causal self part and ``levels`` the cascade levels."""

    cu_q: torch.Tensor
    """[n+1] int32 query offsets of the ``n`` varlen sequences."""
    cu_k: torch.Tensor
    """[n+1] int32 key offsets (into ``kv_index`` for gather, = ``cu_q`` otherwise)."""
    kv_index: torch.Tensor | None
    """[K] int64 gathered key rows (gather mode, K = Σ_i path length of sequence ``i``'s last row)."""
    max_q: int
    max_k: int
    mode: Literal["gather", "levels"] = "gather"
    levels: tuple[VarlenLevel, ...] = field(default=())
    gathered_rows: int = 0
    """Rows the plan gathers beyond ``T``: duplicated keys (gather) or query rows (levels)."""
    copy_ptr: torch.Tensor | None = None
    """[T+1] int32 CSR offsets of the inverse of ``kv_index`` (gather mode): the copies of row ``r``
    are ``copy_pos[copy_ptr[r]:copy_ptr[r+1]]``, used to sum the key gradients of shared rows."""
    copy_pos: torch.Tensor | None = None
    """[K] int64 positions in the gathered keys, grouped by source row (stable)."""
    save_gathered_kv: bool = False
    """Gather mode: keep the gathered, head-expanded keys/values for the backward (``2·K·Hq·D``
    elements per layer) instead of the compact ones (``2·T·Hkv·D``) and gathering again there."""


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], ends[i])`` (int64)."""
    lens = ends - starts
    if lens.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(int(lens.sum()), dtype=np.int64) + offs


def _cu(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _host(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64) if isinstance(x, np.ndarray) else x.cpu().numpy().astype(np.int64)


def build_varlen_plan(seg_offsets, seg_parent, *, mode: VarlenMode = "auto", save_gathered_kv: bool = False,
                      context_rows: int = 0, device=None) -> VarlenPlan:
    """:class:`VarlenPlan` of a pre-order forest's segments (``keys(s) = rows(ancestors) ++ rows(s)``),
    built on the host once per microbatch. ``mode``: ``"gather"``, ``"levels"`` or ``"auto"``
    (= ``"gather"``, see the module docstring); ``save_gathered_kv``: see :class:`VarlenPlan`.

    ``seg_offsets``, ``seg_parent``: tensors, or host arrays (numpy, e.g. ``Forest.host``) with
    ``device`` naming where the plan goes (default: the tensors' device). All index arrays reach
    the device in one non-blocking transfer (:func:`harts.upload.upload`); from host arrays the
    plan needs no device-to-host copy either.

    ``context_rows = c > 0``: the keys and values passed to the attention hold ``c`` context rows
    first (a shared prefix computed in another microbatch, :func:`harts.megatron.tree_shared_step`),
    then the forest's rows; the context is a chain above every root segment, so each segment's
    keys are ``context ++ rows(ancestors) ++ rows(s)`` while queries are the forest's rows only.
    Gather plan only; ``kv_index`` and the copy CSR then index the ``c + T`` key rows."""
    if mode not in ("auto", "gather", "levels"):
        raise ValueError(f"mode must be 'auto', 'gather' or 'levels', got {mode!r}")
    if context_rows < 0 or (context_rows and mode == "levels"):
        raise ValueError(f"context_rows={context_rows} needs >= 0 and the gather plan (mode={mode!r})")
    dev = device if device is not None else getattr(seg_offsets, "device", "cpu")
    so, sp = _host(seg_offsets), _host(seg_parent)
    lens = np.diff(so)
    mq = int(lens.max())
    if context_rows or not (sp < 0).all():
        if context_rows or mode in ("auto", "gather"):
            return _gather_plan(so, sp, context_rows, dev, save_gathered_kv)
        return _levels_plan(so, sp, mq, dev)
    cu = upload([so], dev)[0].to(torch.int32)  # no sharing: exactly the THD varlen call, without gathers
    return VarlenPlan(cu_q=cu, cu_k=cu, kv_index=None, max_q=mq, max_k=mq)


def _gather_plan(so: np.ndarray, sp: np.ndarray, c: int, dev, save_gathered_kv: bool) -> VarlenPlan:
    """Key-gather plan; with ``c`` context rows (key rows ``0..c-1``, forest row ``r`` is key row
    ``c + r``) the context is one more root segment above every root, without queries of its own.

    A segment whose first child follows it in pre-order (segment ``s + 1`` with parent ``s``) shares
    one varlen sequence with that child: the child's keys are the parent's keys followed by its own
    rows, so causal attention over the rows ``s ++ s+1`` against the child's keys (bottom-right
    aligned) is exactly both segments' attention, and the parent's keys are gathered once, not
    twice. Chains of first children form one sequence (on a multi-turn tree, whose turns each
    have a first child, this gathers 31 % fewer key rows)."""
    n, t = sp.size, int(so[-1])
    path_len = np.diff(so) + c  # with a context, every segment's keys start with all of it
    keys = []
    ctx = np.arange(c, dtype=np.int64)
    for s in range(n):  # pre-order: a parent precedes its children
        own = np.arange(so[s] + c, so[s + 1] + c, dtype=np.int64)
        keys.append(np.concatenate([ctx if sp[s] < 0 else keys[sp[s]], own]))
        if sp[s] >= 0:
            path_len[s] += path_len[sp[s]] - c
    # sequence boundaries: every segment except a first child that directly follows its parent
    head = np.ones(n, dtype=bool)
    head[1:] = sp[1:] != np.arange(n - 1)
    starts = np.flatnonzero(head)
    ends = np.append(starts[1:], n) - 1  # the last (deepest) segment of each sequence
    seq_q = np.append(so[starts], t)
    kv = np.concatenate([keys[s] for s in ends])
    kl = path_len[ends]
    cu_q, cu_k, kv_index, ptr, pos = upload([seq_q, _cu(kl), kv, _cu(np.bincount(kv, minlength=t + c)),
                                             np.argsort(kv, kind="stable")], dev)
    return VarlenPlan(cu_q=cu_q.to(torch.int32), cu_k=cu_k.to(torch.int32), kv_index=kv_index,
                      max_q=int(np.diff(seq_q).max()), max_k=int(kl.max()), mode="gather",
                      gathered_rows=int(kl.sum()) - t, copy_ptr=ptr.to(torch.int32), copy_pos=pos,
                      save_gathered_kv=save_gathered_kv)


def _levels_plan(so: np.ndarray, sp: np.ndarray, mq: int, dev) -> VarlenPlan:
    n = sp.size
    depth = np.zeros(n, dtype=np.int64)
    for s in range(n):  # pre-order: a parent precedes its children
        if sp[s] >= 0:
            depth[s] = depth[sp[s]] + 1
    sub_end = so[1:].copy()
    for s in range(n - 1, -1, -1):
        if sp[s] >= 0:
            sub_end[sp[s]] = max(sub_end[sp[s]], sub_end[s])
    below = sub_end - so[1:]  # rows strictly below each segment; each is a query of s's level
    arrays, shapes, merged = [so], [], None
    for lvl in range(int(depth.max())):
        segs = np.nonzero((depth == lvl) & (below > 0))[0]
        if segs.size == 0:
            continue
        qs, qe, ks, ke = so[segs + 1], sub_end[segs], so[segs], so[segs + 1]
        qi = _ranges(qs, qe)
        merged = qi if merged is None else merged  # level 0: every non-root row; deeper levels ⊆ it
        arrays += [qi, _ranges(ks, ke), np.searchsorted(merged, qi), _cu(qe - qs), _cu(ke - ks)]
        shapes.append((int((qe - qs).max()), int((ke - ks).max())))
    up = upload(arrays, dev)
    cu = up[0].to(torch.int32)
    levels = tuple(VarlenLevel(q_index=up[1 + 5 * i], k_index=up[2 + 5 * i], q_local=up[3 + 5 * i],
                               cu_q=up[4 + 5 * i].to(torch.int32), cu_k=up[5 + 5 * i].to(torch.int32),
                               max_q=mq_, max_k=mk_) for i, (mq_, mk_) in enumerate(shapes))
    return VarlenPlan(cu_q=cu, cu_k=cu, kv_index=None, max_q=mq, max_k=mq, mode="levels", levels=levels,
                      gathered_rows=int(below.sum()))


# ---- kernels: FlashAttention-2 varlen on CUDA, plain torch (same math) elsewhere --------------


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """aten's FlashAttention-2 varlen forward, the kernel ``torch.nn.attention.varlen`` runs, called
    directly: its custom-op layer costs ~0.1–0.2 ms of host time per call (on the critical path of
    a tree step, whose attention layers leave the GPU waiting for the host) and launches a memset
    for an RNG state that dropout 0 never reads. → ``(o, lse, rng)``, ``rng`` for :func:`_flash_backward`."""
    o, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, window_size_left=-1,
        window_size_right=0 if causal else -1)
    return o, lse, (rng_state, unused)


def _flash_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, rng):
    """aten's FlashAttention-2 varlen backward; ``rng``: the forward's ``(rng_state, unused)`` (not
    read at dropout 0; ``None`` passes what ``torch.nn.attention.varlen`` passes: zeros, empty)."""
    if rng is None:
        rng = (torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device))
    return torch.ops.aten._flash_attention_backward(
        do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng[0], rng[1], scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                       max_q: int, max_k: int, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` → ``(o [Tq, Hq, D], lse [Hq, Tq] fp32)``,
    ``lse_i = log Σ_j exp(scale · q_i·k_j)`` over the allowed keys (bottom-right causal alignment)."""
    return _attend(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)[:2]


def _attend(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """:func:`attention_with_lse` plus the CUDA forward's RNG state for :func:`attention_backward`
    (``None`` on CPU): ``(o, lse, rng)``."""
    if q.is_cuda:
        return _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    dt, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs: fp32 math, as flash
    q, k, v = (x.to(acc) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=acc, device=q.device)
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        sc = _scores(q[a:b], k[c:d], rep, scale, causal)
        ls = torch.logsumexp(sc, -1)  # [H, nq]
        o[a:b] = (torch.exp(sc - ls[..., None]) @ v[c:d].repeat_interleave(rep, 1).transpose(0, 1)).transpose(0, 1)
        lse[:, a:b] = ls
    return o.to(dt), lse, None


def _scores(q: torch.Tensor, k: torch.Tensor, rep: int, scale: float, causal: bool) -> torch.Tensor:
    sc = (q.transpose(0, 1) @ k.repeat_interleave(rep, 1).transpose(0, 1).transpose(1, 2)) * scale  # [H, nq, nk]
    if causal:
        sc = sc.masked_fill(~bottom_right_causal(q.shape[0], k.shape[0], q.device), float("-inf"))
    return sc


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *,
                       causal: bool, scale: float, rng=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash backward of :func:`attention_with_lse` given ``o`` and ``lse`` (possibly those of a
    larger merged attention): ``P = exp(scale·qkᵀ − lse)``, ``D = rowsum(dO ∘ o)``,
    ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − D)``, ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``.
    ``rng``: the CUDA forward's RNG state, if kept (see :func:`_flash_backward`)."""
    if q.is_cuda:
        return _flash_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng)
    dt, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    do, q, k, v, o = (x.to(acc) for x in (do, q, k, v, o))
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        p = torch.exp(_scores(q[a:b], k[c:d], rep, scale, causal) - lse[:, a:b, None])  # [H, nq, nk]
        g = do[a:b].transpose(0, 1)  # [H, nq, D]
        kv_h = k[c:d].repeat_interleave(rep, 1).transpose(0, 1)
        dvh = p.transpose(1, 2) @ g  # [H, nk, D]
        ds = p * (g @ v[c:d].repeat_interleave(rep, 1).transpose(0, 1).transpose(1, 2)
                  - (g * o[a:b].transpose(0, 1)).sum(-1, keepdim=True))
        dq[a:b] = (scale * (ds @ kv_h)).transpose(0, 1)
        dkh = scale * (ds.transpose(1, 2) @ q[a:b].transpose(0, 1))
        hk = k.shape[1]
        dk[c:d] = dkh.view(hk, rep, d - c, -1).sum(1).transpose(0, 1)
        dv[c:d] = dvh.view(hk, rep, d - c, -1).sum(1).transpose(0, 1)
    return dq.to(dt), dk.to(dt), dv.to(dt)


# ---- the two plans ----------------------------------------------------------------------------


def sum_row_copies_reference(g: torch.Tensor, index: torch.Tensor, num_rows: int, kv_heads: int | None = None
                             ) -> torch.Tensor:
    """``dx[r, h] = Σ_{i: index[i] = r} Σ_{j < rep} g[i, h·rep + j]`` with ``rep = H / kv_heads``
    (``kv_heads=None``: ``rep = 1``), accumulated in (at least) fp32 and rounded once."""
    x = g.to(torch.promote_types(g.dtype, torch.float32))
    if kv_heads is not None and kv_heads != x.shape[1]:
        x = x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)
    dx = torch.zeros((num_rows, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, index, x)
    return dx.to(g.dtype)


_GATHER_ROWS, _GATHER_WARPS = 4, 4
"""Gathered rows per program and warps of :func:`gather_kv_triton` (``bench/harts_kv_gather.py``
times the alternatives)."""


@functools.cache
def _kv_kernels():
    """Triton gather-with-head-expansion and its transpose (compiled lazily on first use). The
    gather moves ``ROWS`` rows of both ``k`` and ``v`` per program, each row a ``[Hkv, D]`` tile
    flattened (padded to powers of two), so the row indices and then all rows' loads are issued
    together; the sum handles one row per program."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather(k, v, ok, ov, index, n, sk_row, sk_head, sv_row, sv_head, HKV: tl.constexpr, REP: tl.constexpr,
               D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rm = i < n
        src = tl.load(index + i, mask=rm, other=0)
        e = tl.arange(0, HP * DP)
        h, d = e // DP, e % DP
        m = rm[:, None] & ((h < HKV) & (d < D))[None, :]
        kt = tl.load(k + src[:, None] * sk_row + (h * sk_head + d)[None, :], mask=m)
        vt = tl.load(v + src[:, None] * sv_row + (h * sv_head + d)[None, :], mask=m)
        base = i[:, None] * (HKV * REP * D)
        for j in tl.static_range(REP):
            off = base + ((h * REP + j) * D + d)[None, :]
            tl.store(ok + off, kt, mask=m)
            tl.store(ov + off, vt, mask=m)

    @triton.jit
    def scatter_sum(gk, gv, dk, dv, ptr, pos,
                    HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HP)[:, None]
        d = tl.arange(0, DP)[None, :]
        m = (h < HKV) & (d < D)
        acc_k = tl.zeros([HP, DP], dtype=tl.float32)
        acc_v = tl.zeros([HP, DP], dtype=tl.float32)
        i, end = tl.load(ptr + r), tl.load(ptr + r + 1)
        while i < end:
            base = tl.load(pos + i).to(tl.int64) * (HKV * REP * D)
            for j in tl.static_range(REP):
                off = base + (h * REP + j) * D + d
                acc_k += tl.load(gk + off, mask=m, other=0.0).to(tl.float32)
                acc_v += tl.load(gv + off, mask=m, other=0.0).to(tl.float32)
            i += 1
        out = r * (HKV * D) + h * D + d
        tl.store(dk + out, acc_k.to(dk.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)
        tl.store(dv + out, acc_v.to(dv.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)

    return gather, scatter_sum


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_kv(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k[index], v[index])`` with each of the ``Hkv`` heads repeated ``rep = heads / Hkv`` times
    (query head ``h`` reads key head ``h // rep``, as grouped-query attention does): ``k, v [T, Hkv, D]``
    (any row/head strides, e.g. ``v`` sliced out of a fused QKV) → two contiguous ``[K, heads, D]``.
    CUDA: :func:`gather_kv_triton`; elsewhere :func:`gather_kv_torch`."""
    return gather_kv_triton(k, v, index, heads) if k.is_cuda else gather_kv_torch(k, v, index, heads)


def gather_kv_torch(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_kv` in plain torch (``index_select`` + ``repeat_interleave``), on any device."""
    rep = heads // k.shape[1]
    kk, vv = k.index_select(0, index), v.index_select(0, index)
    return (kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)) if rep > 1 else (kk, vv)


def gather_kv_triton(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, heads: int, *,
                     rows_per_program: int = _GATHER_ROWS, num_warps: int = _GATHER_WARPS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_kv` in one Triton launch for both tensors (a plain copy: bitwise equal);
    ``rows_per_program`` (a power of two) and ``num_warps``: the launch shape."""
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    hkv, dim = k.shape[1], k.shape[2]
    k, v = _last_dim_dense(k), _last_dim_dense(v)
    n = index.numel()
    ok = torch.empty(n, heads, dim, dtype=k.dtype, device=k.device)
    ov = torch.empty_like(ok)
    if n and dim:
        _kv_kernels()[0][(-(-n // rows_per_program),)](
            k, v, ok, ov, index, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1), HKV=hkv, REP=heads // hkv,
            D=dim, HP=_p2(hkv), DP=_p2(dim), ROWS=rows_per_program, num_warps=num_warps)
    return ok, ov


def sum_kv_copies(gk: torch.Tensor, gv: torch.Tensor, copy_ptr: torch.Tensor, copy_pos: torch.Tensor,
                  kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose of :func:`gather_kv` (Triton): ``dk[r, h] = Σ_{i ∈ copies(r)} Σ_{j < rep} gk[i, h·rep + j]``
    (copies from the plan's CSR ``copy_ptr``/``copy_pos``), same for ``dv``, in fp32 registers with
    one rounding: one read of each gathered gradient, one write of ``[T, kv_heads, D]``, no
    atomics, the same order every run. Equals :func:`sum_row_copies_reference` up to fp32
    summation order."""
    gk, gv = _rows(gk), _rows(gv)
    num_rows, heads, dim = copy_ptr.numel() - 1, gk.shape[1], gk.shape[2]
    dk = torch.empty(num_rows, kv_heads, dim, dtype=gk.dtype, device=gk.device)
    dv = torch.empty_like(dk)
    if num_rows and dim:  # every row is written (zeros for a row without copies)
        _kv_kernels()[1][(num_rows,)](gk, gv, dk, dv, copy_ptr, copy_pos, HKV=kv_heads, REP=heads // kv_heads,
                                      D=dim, HP=_p2(kv_heads), DP=_p2(dim), num_warps=4)
    return dk, dv


def _sum_copies(gk: torch.Tensor, gv: torch.Tensor, plan: VarlenPlan, rows: int, kv_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    if gk.is_cuda:
        return sum_kv_copies(gk, gv, plan.copy_ptr, plan.copy_pos, kv_heads)
    return sum_row_copies_reference(gk, plan.kv_index, rows, kv_heads), \
        sum_row_copies_reference(gv, plan.kv_index, rows, kv_heads)


class _GatherAttention(torch.autograd.Function):
    """Gather-plan tree attention: :func:`gather_kv` (keys/values along each segment's ancestor
    path), one varlen call, and in the backward the varlen backward on keys/values expanded to the
    query heads followed by :func:`sum_kv_copies` (each shared row's copies and each key head's
    query heads summed in fp32, rounded once). By default the forward gathers grouped keys (the
    kernel reads key head ``h // rep`` itself) and saves the compact ``k, v``; the backward gathers
    again, expanded. ``plan.save_gathered_kv``: the forward gathers expanded and saves that.
    A plan without ``kv_index`` (a forest of chains) is the plain causal THD call: the keys are
    the rows themselves, nothing is gathered or summed."""

    @staticmethod
    def forward(ctx, q, k, v, plan: VarlenPlan, scale: float):
        ctx.plan, ctx.scale, ctx.rows, ctx.kv_heads = plan, scale, k.shape[0], k.shape[1]
        if plan.kv_index is None:
            kk, vv = saved = _rows(k), _rows(v)
        elif plan.save_gathered_kv:
            kk, vv = gather_kv(k, v, plan.kv_index, q.shape[1])
            saved = (kk, vv)
        else:
            k, v = _rows(k), _rows(v)  # saved: a strided v would keep the whole fused QKV tensor alive
            kk, vv = gather_kv(k, v, plan.kv_index, k.shape[1])
            saved = (k, v)
        out, lse, ctx.rng = _attend(q, kk, vv, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, True, scale)
        ctx.save_for_backward(q, *saved, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        q, a, b, out, lse = ctx.saved_tensors
        plan = ctx.plan
        gathered = plan.kv_index is not None
        kk, vv = gather_kv(a, b, plan.kv_index, q.shape[1]) if gathered and not plan.save_gathered_kv else (a, b)
        dq, gk, gv = attention_backward(_rows(do), q, kk, vv, out, lse, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                        causal=True, scale=ctx.scale, rng=ctx.rng)
        dk, dv = _sum_copies(gk, gv, plan, ctx.rows, ctx.kv_heads) if gathered else (gk, gv)
        return dq, dk, dv, None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


class _LevelsAttention(torch.autograd.Function):
    """Cascade tree attention (module docstring, ``"levels"``). Only the non-root rows ``M`` (the
    first level's queries) have more than one partial: their outputs and log-sum-exps are merged
    in an fp32 buffer ``[|M|, Hq, D]`` and written back once; root rows keep the self part as is.
    In the backward a row's partial gradients are summed in fp32 and rounded once: ``dq`` over
    ``M``, ``dk``/``dv`` over each level's key rows (disjoint across levels)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: VarlenPlan, scale: float):
        k, v = _rows(k), _rows(v)
        out, lse = attention_with_lse(q, k, v, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, causal=True, scale=scale)
        m = plan.levels[0].q_index
        acc = out.index_select(0, m).to(torch.promote_types(out.dtype, torch.float32))
        acc_lse = lse.index_select(1, m)
        for lv in plan.levels:
            ol, ll = attention_with_lse(q.index_select(0, lv.q_index), k.index_select(0, lv.k_index),
                                        v.index_select(0, lv.k_index), lv.cu_q, lv.cu_k, lv.max_q, lv.max_k,
                                        causal=False, scale=scale)
            loc = lv.q_local
            old = acc_lse.index_select(1, loc)
            new = torch.logaddexp(old, ll)
            wa, wb = (torch.exp(x - new).transpose(0, 1).unsqueeze(-1) for x in (old, ll))  # [Q, H, 1]
            acc.index_copy_(0, loc, torch.addcmul(ol.to(acc.dtype) * wb, acc.index_select(0, loc), wa))
            acc_lse.index_copy_(1, loc, new)
        out.index_copy_(0, m, acc.to(out.dtype))
        lse.index_copy_(1, m, acc_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        do = _rows(do)
        dq, dk, dv = attention_backward(do, q, k, v, out, lse, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q,
                                        causal=True, scale=scale)
        m = plan.levels[0].q_index
        f32 = torch.promote_types(q.dtype, torch.float32)
        acc_q = dq.index_select(0, m).to(f32)
        for lv in plan.levels:
            qi, ki = lv.q_index, lv.k_index
            gq, gk, gv = attention_backward(do.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ki),
                                            v.index_select(0, ki), out.index_select(0, qi),
                                            lse.index_select(1, qi), lv.cu_q, lv.cu_k, lv.max_q, lv.max_k,
                                            causal=False, scale=scale)
            acc_q.index_add_(0, lv.q_local, gq.to(f32))
            dk.index_copy_(0, ki, (dk.index_select(0, ki).to(f32) + gk.to(f32)).to(dk.dtype))
            dv.index_copy_(0, ki, (dv.index_select(0, ki).to(f32) + gv.to(f32)).to(dv.dtype))
        dq.index_copy_(0, m, acc_q.to(dq.dtype))
        return dq, dk, dv, None, None


def varlen_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: VarlenPlan,
                          scale: float) -> torch.Tensor:
    """Tree attention on a :class:`VarlenPlan`. ``q [T, Hq, D]``, ``k, v [c + T, Hkv, D]`` (``c`` context
    rows first, see ``build_varlen_plan(context_rows=c)``; usually ``c = 0``) → ``[T, Hq, D]``. CUDA
    needs bf16/fp16 (FlashAttention-2); CPU runs the same plan in plain torch."""
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"varlen tree attention on CUDA needs bf16 or fp16 inputs, got {q.dtype}; use backend='flex'")
    if plan.mode == "levels":
        return _LevelsAttention.apply(q, k, v, plan, scale)
    if plan.kv_index is not None or q.is_cuda:  # on CUDA a forest of chains is the same call without the gather
        return _GatherAttention.apply(q, k, v, plan, scale)
    return segment_attention_reference(q, _rows(k), _rows(v), cu_q=plan.cu_q, cu_k=plan.cu_k, scale=scale)
