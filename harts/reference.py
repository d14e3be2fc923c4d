"""Plain-torch references (fp64-capable): dense tree mask, dense tree attention, full-logits
tree LM head, and per-sequence execution of a callable model.

These are the oracles the fast paths are tested against; they materialize [T, T] masks and
[T, V] logits and must not be used at scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["tree_mask", "tree_attention_reference", "segment_attention_reference", "tree_head_reference",
           "per_sequence_head_reference"]


def tree_mask(last: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, ``mask[q, k] = k <= q <= last[k]`` (ancestor-or-self)."""
    t = last.numel()
    ar = torch.arange(t, device=last.device)
    return (ar[None, :] <= ar[:, None]) & (ar[:, None] <= last[None, :])


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, last: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Dense tree attention: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` → ``[T, Hq, D]``.

    ``o = softmax(scale · q kᵀ + log mask) v`` with ``mask = tree_mask(last)``; GQA by
    repeating key/value heads.
    """
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * scale  # [H, T, T]
    s = s.masked_fill(~tree_mask(last)[None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vv).transpose(0, 1)


def bottom_right_causal(nq: int, nk: int, device=None) -> torch.Tensor:
    """``[nq, nk]`` bool: query ``i`` of ``nq`` may see key ``j`` of ``nk`` iff ``j <= nk − nq + i``
    (causal mask aligned at the bottom-right, as FlashAttention's varlen kernels do)."""
    return torch.arange(nk, device=device)[None, :] <= (nk - nq + torch.arange(nq, device=device))[:, None]


def segment_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_q: torch.Tensor,
                                cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Varlen attention with bottom-right causal alignment, one segment at a time.

    ``q [Tq, Hq, D]`` split by ``cu_q``; ``k, v [Tk, Hkv, D]`` split by ``cu_k``. Query ``i`` of a
    segment with ``nq`` queries and ``nk`` keys sees keys ``j <= nk − nq + i``.
    """
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        nq, nk = b - a, d - c
        allowed = bottom_right_causal(nq, nk, q.device)
        qs = q[a:b].transpose(0, 1)
        ks = k[c:d].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[c:d].repeat_interleave(rep, 1).transpose(0, 1)
        sc = (qs @ ks.transpose(1, 2)) * scale
        out[a:b] = (torch.softmax(sc.masked_fill(~allowed, float("-inf")), -1) @ vs).transpose(0, 1)
    return out


def tree_head_reference(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor,
                        *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-logits tree head: ``hidden [T, H]``, ``weight [V, H]``, ``tokens, parent [T]``.

    ``z = hidden Wᵀ / τ``; returns ``logp [T]`` with ``logp[v] = log_softmax(z[parent[v]])[tokens[v]]``
    (0 where ``parent[v] < 0``) and ``entropy [T] = -Σ_j p_j log p_j`` of every row.
    """
    z = (hidden @ weight.T) / temperature
    lp = torch.log_softmax(z, dim=-1)
    ent = -(lp.exp() * lp).sum(-1)
    has = parent >= 0
    logp = torch.zeros(hidden.shape[0], dtype=lp.dtype, device=lp.device)
    logp = logp.masked_scatter(has, lp[parent[has], tokens[has]])
    return logp, ent


def per_sequence_head_reference(seqs: Sequence[torch.Tensor], logits_fn: Callable[[torch.Tensor], torch.Tensor],
                                *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked execution: ``logits_fn(seq [L]) -> [L, V]`` run on every sequence alone.

    Returns flat ``logp [Σ(L_i-1)]`` (``log p(x_t | x_<t)``, t = 1..L_i-1) and ``entropy
    [Σ(L_i-1)]`` (of rows t = 0..L_i-2), concatenated in sequence order.
    """
    lps, ents = [], []
    for s in seqs:
        lp = torch.log_softmax(logits_fn(s) / temperature, dim=-1)[:-1]
        lps.append(lp.gather(-1, s[1:, None].to(lp.device)).squeeze(-1))
        ents.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(lps), torch.cat(ents)
