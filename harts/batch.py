"""``[B, L]`` token rows ↔ tree micro-batches: plan the rows (:func:`harts.plan_step`), build each
micro-batch's forest, and write per-sequence values back to the rows.

Token layout of the results (Megatron's label layout, the one ``mopd`` teachers and
``TokenBatch`` use): for rows ``input_ids [B, L]`` with ``lengths [B]``,

    logp[b, t]    = log p(input_ids[b, t+1] | input_ids[b, :t+1])
    entropy[b, t] = H(p(· | input_ids[b, :t+1]))                     for t < lengths[b] − 1,

and 0 elsewhere (right padding and the last position of every row). A forest holds sequence
``k`` of micro-batch ``mb`` at row ``mb.rows[k]`` of the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harts.config import PlannerConfig
from harts.forest import Forest
from harts.loss import sequence_entropy, sequence_logprobs
from harts.planner import StepPlan, plan_step
from mcore_distill.errors import ConfigTypeError
from mcore_distill.validate import check_type

__all__ = ["TreeMicrobatch", "TreeBatch", "plan_tree_batch"]


@dataclass(frozen=True, eq=False)
class TreeMicrobatch:
    """One packed row (a prefix forest, or plain THD packing for a micro-batch that barely shares)
    and the batch rows it holds."""

    forest: Forest
    """The micro-batch's forest (alignment padding included)."""
    rows: torch.Tensor
    """``[n]`` int64: forest sequence ``k`` is batch row ``rows[k]``."""
    width: int
    """L, the batch's row width."""
    mode: str
    """``tree`` or ``thd`` (the planner's fallback)."""

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` label-layout rows from a per-sequence vector ``flat [Σ(L_k − 1)]``
        (:func:`harts.sequence_logprobs` layout); differentiable, zeros where no value exists."""
        f = self.forest
        n = f.lengths - 1
        row = torch.repeat_interleave(torch.arange(f.num_seqs, device=flat.device), n.to(flat.device))
        col = torch.arange(flat.numel(), device=flat.device) - torch.repeat_interleave(
            f.pred_offsets()[:-1].to(flat.device), n.to(flat.device))
        return flat.new_zeros(f.num_seqs, self.width).index_put((row, col), flat)

    def logprob_rows(self, node_logp: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` label-layout log-probs from the tree LM head's ``node_logp [T]``."""
        return self.to_rows(sequence_logprobs(node_logp, self.forest))

    def entropy_rows(self, node_entropy: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` label-layout entropies from the tree LM head's ``node_entropy [T]``."""
        return self.to_rows(sequence_entropy(node_entropy, self.forest))


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """A ``[B, L]`` batch planned into tree micro-batches (one data-parallel rank's share)."""

    microbatches: list[TreeMicrobatch]
    shape: tuple[int, int]
    """(B, L) of the batch."""
    plan: StepPlan
    """The planner's result (sharing statistics, padding, fallback rate: ``plan.summary()``)."""

    @property
    def compression(self) -> float:
        """C = Σ L_b / T over the batch's distinct prefixes (1.0: nothing shared)."""
        return self.plan.stats.compression

    @property
    def rows(self) -> int:
        """Compact rows over all micro-batches, alignment padding included."""
        return sum(mb.forest.num_nodes for mb in self.microbatches)

    def padded(self, rows: int | None = None) -> TreeBatch:
        """Every forest padded to exactly ``rows`` compact rows (default: the largest micro-batch's),
        for pipeline schedules without ``variable_seq_lengths``, which need one shape."""
        longest = max(mb.forest.num_nodes for mb in self.microbatches)
        rows = longest if rows is None else rows
        if rows < longest:
            raise ValueError(f"rows={rows} is smaller than a micro-batch of {longest} rows")
        mbs = [dataclasses.replace(mb, forest=mb.forest.padded(rows)) for mb in self.microbatches]
        return dataclasses.replace(self, microbatches=mbs)

    def gather(self, per_microbatch: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[B, *]`` from each micro-batch's ``[n, *]`` rows (``[n, L]`` from
        :meth:`TreeMicrobatch.to_rows`); differentiable; rows of no micro-batch stay 0."""
        if len(per_microbatch) != len(self.microbatches):
            raise ValueError(f"{len(per_microbatch)} results for {len(self.microbatches)} micro-batches")
        first = per_microbatch[0]
        rows = torch.cat([mb.rows.to(first.device) for mb in self.microbatches])
        out = first.new_zeros((self.shape[0], *first.shape[1:]))
        return out.index_put((rows,), torch.cat(list(per_microbatch)))


def plan_tree_batch(input_ids: torch.Tensor, lengths: torch.Tensor | None = None, *,
                    config: PlannerConfig | None = None, device: torch.device | str | None = None,
                    vocab_size: int | None = None) -> TreeBatch:
    """Plan ``input_ids [B, L]`` (row ``b`` is ``input_ids[b, :lengths[b]]``; default: full rows)
    into tree micro-batches of at most ``config.token_cap`` compact rows (:func:`harts.plan_step`:
    shared prefixes once, THD fallback for micro-batches that barely compress).

    ``config.dp_size`` must be 1 (plan each rank's own rows).
    """
    check_type("input_ids", input_ids, torch.Tensor)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer [B, L] tensor, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    b, width = input_ids.shape
    if lengths is None:
        lengths = torch.full((b,), width, dtype=torch.int64)
    check_type("lengths", lengths, torch.Tensor)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]={b}, got shape {tuple(lengths.shape)}")
    config = PlannerConfig(align=1, token_cap=max(1, b * width)) if config is None else config
    if not isinstance(config, PlannerConfig):
        raise ConfigTypeError(f"config must be a harts.PlannerConfig, got {type(config).__name__}")
    if config.dp_size != 1:
        raise ValueError(f"plan_tree_batch plans one rank's rows: config.dp_size must be 1, got {config.dp_size}")
    ids, lens = input_ids.detach().cpu(), lengths.detach().cpu().tolist()
    seqs = [ids[r, : lens[r]] for r in range(b)]
    plan = plan_step(seqs, config, vocab_size=vocab_size)
    mbs = []
    for m in plan.ranks[0]:
        forest = m.build(seqs, vocab_size=vocab_size, device=device)
        mbs.append(TreeMicrobatch(forest=forest, rows=torch.as_tensor(m.seq_ids, dtype=torch.int64, device=device),
                                  width=width, mode=m.mode))
    return TreeBatch(microbatches=mbs, shape=(b, width), plan=plan)
