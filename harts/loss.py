"""Fork labels → per-sequence vectors, PPO-style token loss, and loss normalization over the
original per-sequence token counts.

Per-sequence vectors are gathered from compact node values by index (``index_select``), so the
backward is an ``index_add``: the gradients of every sequence through a fork sum into the shared
row, which by the chain rule equals per-sequence training for any nonlinear per-sequence loss.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from harts.forest import Forest

__all__ = ["LossAggregation", "sequence_logprobs", "sequence_entropy", "ppo_clip_token_loss",
           "aggregate_loss", "global_normalizers"]

LossAggregation = Literal["token_mean", "seq_mean", "seq_mean_token_sum"]


def sequence_logprobs(node_logp: torch.Tensor, forest: Forest) -> torch.Tensor:
    """[Σ(L_i-1)] ``log p(x_t | x_<t)`` for t = 1..L_i-1 of every sequence, concatenated in
    input order (offsets :meth:`Forest.pred_offsets`), from ``node_logp [T]``."""
    return node_logp.index_select(0, forest.label_index())


def sequence_entropy(node_entropy: torch.Tensor, forest: Forest) -> torch.Tensor:
    """[Σ(L_i-1)] entropy of the rows predicting positions 1..L_i-1, from ``node_entropy [T]``."""
    return node_entropy.index_select(0, forest.row_index())


def ppo_clip_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                        clip_low: float = 0.2, clip_high: float = 0.2) -> torch.Tensor:
    """Per-token clipped surrogate ``-min(r A, clip(r, 1-ε_lo, 1+ε_hi) A)``, ``r = exp(logp - old)``.

    All inputs ``[M]``; returns ``[M]``.
    """
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages)


def global_normalizers(mask: torch.Tensor, seq_ids: torch.Tensor, *, num_seqs: int, group=None) -> tuple[float, float]:
    """(Σ mask, number of sequences with a nonzero mask) summed over ``group`` (e.g. DP).

    Call on the concatenation of all microbatches of this rank's step so every microbatch
    divides by the same global counts.
    """
    per_seq = torch.zeros(num_seqs, dtype=torch.float64, device=mask.device).index_add_(0, seq_ids, mask.double())
    t = torch.stack([per_seq.sum(), (per_seq > 0).double().sum()])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return float(t[0]), float(t[1])


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, *, num_seqs: int,
                   mode: LossAggregation = "token_mean", num_tokens: float | None = None,
                   num_sequences: float | None = None) -> torch.Tensor:
    """Scalar loss over original per-sequence tokens (never over compact tokens).

    ``token_loss, mask, seq_ids [M]`` with ``M = Σ(L_i - 1)``; ``n_i = Σ_{t∈i} mask``.

    * ``token_mean``: ``Σ_i Σ_t m ℓ / N_tok``
    * ``seq_mean``: ``Σ_i (Σ_t m ℓ / n_i) / N_seq``
    * ``seq_mean_token_sum``: ``Σ_i Σ_t m ℓ / N_seq``

    ``num_tokens`` / ``num_sequences`` are the global denominators (all microbatches and DP
    ranks, from :func:`global_normalizers`); default: this call's own counts. Sequences with
    ``n_i = 0`` contribute nothing.
    """
    if mode not in ("token_mean", "seq_mean", "seq_mean_token_sum"):
        raise ValueError(f"mode must be token_mean, seq_mean or seq_mean_token_sum, got {mode!r}")
    if not (token_loss.shape == mask.shape == seq_ids.shape):
        raise ValueError(f"token_loss {tuple(token_loss.shape)}, mask {tuple(mask.shape)} and seq_ids "
                         f"{tuple(seq_ids.shape)} must have one shape")
    m = mask.to(token_loss.dtype)
    per_seq = torch.zeros(num_seqs, dtype=token_loss.dtype, device=token_loss.device).index_add(0, seq_ids, token_loss * m)
    cnt = torch.zeros(num_seqs, dtype=token_loss.dtype, device=token_loss.device).index_add(0, seq_ids, m)
    if mode == "token_mean":
        denom = num_tokens if num_tokens is not None else cnt.sum().clamp_min(1.0)
        return per_seq.sum() / denom
    denom = num_sequences if num_sequences is not None else (cnt > 0).sum().clamp_min(1)
    if mode == "seq_mean":
        return (per_seq / cnt.clamp_min(1.0)).sum() / denom
    return per_seq.sum() / denom
