"""Shared-prefix groups: one tree larger than the microbatch cap, run without duplicating its prefix.

A GRPO group with a long prompt (P = 4800, n = 16, R = 1000: 20,800 compact rows) does not fit a
16,384-row microbatch. Cutting it into two trees runs the prompt twice (C 4.46 → 3.63). Instead,
the group's root chain ``P`` (its first ``p`` tokens, shared by every sequence) runs once, in a
*prefix microbatch*, and the subtrees below it run in *parts* whose attention reads ``P``'s keys
and values from the prefix microbatch (:func:`harts.megatron.tree_shared_step`):

* prefix microbatch: the forest of the sequences cut to ``p + 1`` tokens, i.e. ``P`` plus one
  *lookahead* row per child of ``P``'s last node, whose log-probs are the edges from ``P`` into
  the parts (a part cannot compute them: the logits of ``P``'s last row live here);
* part ``k``: the forest of its sequences' suffixes ``s[p:]``, at depths ``p, p+1, ...``; its
  attention sees ``P``'s keys/values as ``p`` context rows in front of its own.

Forward the prefix microbatch and keep its graph; for every part run forward and backward, with
``P``'s keys/values and the prefix log-probs/entropies entering as leaves whose gradients
accumulate; finally run the prefix backward from those gradients. Every row is computed once
(plus the lookahead rows, one per child), and the chain rule makes values and gradients equal to
per-sequence execution. Peak memory is that of the prefix microbatch plus one part: the planner
(``PlannerConfig.prefix_reuse``) keeps both under ``token_cap`` together.

Each sequence's per-position vectors (log-probs of positions ``1..L−1``, entropies of rows
``0..L−2``) are assembled in the part that holds its suffix, from the concatenation
``[prefix values ; part values]`` by one gather (``label_src`` / ``row_src``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from harts.forest import Forest, as_token_lists, build_forest

__all__ = ["SharedPart", "SharedPrefixBatch", "build_shared_prefix"]


@dataclass(frozen=True, eq=False)
class SharedPart:
    """One part of a shared-prefix group: a forest of suffixes and how its sequences' per-position
    vectors are gathered from ``[prefix values ; part values]``."""

    forest: Forest
    """Suffixes ``s[p:]`` of the part's sequences with ``depth`` offset by ``p`` (padded);
    sequences of length ``p`` (entirely inside the prefix) have no suffix here."""
    seq_ids: list[int]
    """Sequences of this part (indices into the step's list), in the order of its vectors."""
    label_src: torch.Tensor
    """[Σ(L_i−1)] index into ``cat([prefix logp, part logp])`` of each position's log-prob."""
    row_src: torch.Tensor
    """[Σ(L_i−1)] index into ``cat([prefix entropy, part entropy])`` of the row predicting it."""
    pred_offsets: torch.Tensor
    """[N_k + 1] offsets of each sequence's vector (length ``L_i − 1``)."""
    pred_seq_ids: torch.Tensor
    """[Σ(L_i−1)] position of each entry's sequence in ``seq_ids``."""


@dataclass(frozen=True, eq=False)
class SharedPrefixBatch:
    """A shared-prefix group ready to run (:func:`harts.megatron.tree_shared_step`)."""

    prefix: Forest
    """Forest of the sequences cut to ``prefix_len + 1`` tokens (padded): rows ``0..p−1`` are the
    prefix ``P``, then one lookahead row per child of ``P``'s last node."""
    prefix_len: int
    """``p``: the context rows every part attends to."""
    parts: tuple[SharedPart, ...]


def _common_prefix(arrs: list[np.ndarray]) -> int:
    p = min(a.size for a in arrs)
    first = arrs[0]
    for a in arrs[1:]:
        neq = np.flatnonzero(a[:p] != first[:p])
        if neq.size:
            p = int(neq[0])
    return p


def build_shared_prefix(seqs: Sequence, parts: Sequence[Sequence[int]], *, prefix_len: int | None = None,
                        align: int = 1, vocab_size: int | None = None, device=None) -> SharedPrefixBatch:
    """:class:`SharedPrefixBatch` of ``seqs[i]`` for ``i`` in the ``parts`` (lists of sequence indices;
    together one tree). ``prefix_len`` defaults to the longest prefix common to all of them and
    must be ≥ 1 and at most that. Forests are padded to a multiple of ``align``."""
    ids = [int(i) for part in parts for i in part]
    if not ids or any(len(part) == 0 for part in parts) or len(set(ids)) != len(ids):
        raise ValueError(f"parts must be non-empty, disjoint lists of sequence indices, got {parts}")
    arrs = as_token_lists([seqs[i] for i in ids], vocab_size=vocab_size)
    arr_of = dict(zip(ids, arrs))
    common = _common_prefix(arrs)
    p = common if prefix_len is None else int(prefix_len)
    if not 1 <= p <= common:
        raise ValueError(f"prefix_len={prefix_len} must be in [1, {common}] (the prefix all sequences share)")
    prefix = build_forest([arr_of[i][:p + 1] for i in ids], device=device)
    pre_idx = prefix.index.cpu().numpy()
    pre_off = prefix.seq_offsets.cpu().numpy()
    pos_in_prefix = {i: j for j, i in enumerate(ids)}
    t_pre = _align(prefix.num_nodes, align)
    out = []
    for part in parts:
        part = [int(i) for i in part]
        longer = [i for i in part if arr_of[i].size > p]
        forest = build_forest([arr_of[i][p:] for i in longer], device=device) if longer else None
        if forest is None:  # every sequence of the part lies inside the prefix: an empty-row part is invalid
            raise ValueError(f"part {part} has no sequence longer than the prefix ({p} tokens)")
        f_idx = forest.index.cpu().numpy()
        f_off = forest.seq_offsets.cpu().numpy()
        pos_in_part = {i: m for m, i in enumerate(longer)}
        labels, rows, lens = [], [], []
        for i in part:
            n = arr_of[i].size
            j = pre_off[pos_in_prefix[i]]
            pre = pre_idx[j:j + min(n, p + 1)]  # prefix nodes of positions 0..min(n, p+1)-1
            suf = np.zeros(0, dtype=np.int64)
            if i in pos_in_part:
                m = f_off[pos_in_part[i]]
                suf = t_pre + f_idx[m:m + n - p]  # part nodes of positions p..n-1
            labels.append(np.concatenate([pre[1:], suf[1:]]))  # positions 1..n-1: p+1 from the lookahead row
            rows.append(np.concatenate([pre[:min(n, p)], suf])[:n - 1])  # rows of positions 0..n-2
            lens.append(n - 1)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        forest = forest.padded(align).shift_depth(p)

        def dev(x):
            return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.int64, device=device)

        out.append(SharedPart(forest=forest, seq_ids=part, label_src=dev(np.concatenate(labels)),
                              row_src=dev(np.concatenate(rows)), pred_offsets=dev(off),
                              pred_seq_ids=dev(np.repeat(np.arange(len(part)), lens))))
    return SharedPrefixBatch(prefix=prefix.padded(align), prefix_len=p, parts=tuple(out))


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
