"""Microbatch planning: pack rollouts into prefix forests under a row cap, fall back to plain THD
packing when a microbatch barely compresses, and balance data-parallel ranks by a cost model.

Packing cuts the lexicographically sorted sequences (= DFS order of the global forest) into
contiguous runs, so each microbatch is a subtree-contiguous slice and prefixes are duplicated
only where a cut crosses a shared prefix. For sorted neighbours with ``lcp_j`` shared tokens a
run's rows are ``L_first + Σ (L_j − lcp_j)`` and its attention pairs
``Σ_j (L_j(L_j+1) − lcp_j(lcp_j+1)) / 2``, both O(1) per added sequence.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch

from harts.config import CostModelConfig, PlannerConfig
from harts.errors import CapacityError, PlanError  # noqa: F401 (re-exported)
from harts.forest import Forest, _lcp, as_token_lists, build_chain_forest, build_forest, lexicographic_order
from harts.prefix import SharedPrefixBatch, build_shared_prefix

__all__ = ["CapacityError", "PlanError", "SharingStats", "sharing_stats", "Microbatch", "StepPlan", "plan_step",
           "fit_cost_model"]




@dataclass(frozen=True, slots=True)
class SharingStats:
    """Model-free sharing statistics of a batch of sequences."""

    num_seqs: int
    total_tokens: int
    """Σ L_i."""
    tree_tokens: int
    """T, compact nodes."""
    compression: float
    """C = Σ L_i / T."""
    sharing_ratio: float
    """ρ = 1 − T / Σ L_i."""
    attention_ratio: float
    """Σ_i L_i(L_i+1)/2 / Σ_v (depth_v + 1): softmax-attention work saved."""
    fork_edges: int
    """Edges leaving nodes with ≥ 2 children."""
    max_depth: int
    num_segments: int
    """Compressed-trie nodes."""

    def as_dict(self) -> dict:
        return asdict(self)


def sharing_stats(seqs_or_forest) -> SharingStats:
    """:class:`SharingStats` of a list of sequences (or of a built :class:`Forest`)."""
    f = seqs_or_forest if isinstance(seqs_or_forest, Forest) else build_forest(seqs_or_forest)
    real = f.num_real
    depth = f.depth[:real]
    lens = f.lengths.double()
    nch = f.num_children()[:real]
    dense_pairs = float((lens * (lens + 1) / 2).sum())
    return SharingStats(
        num_seqs=f.num_seqs, total_tokens=f.total_tokens, tree_tokens=real, compression=f.total_tokens / real,
        sharing_ratio=1.0 - real / f.total_tokens, attention_ratio=dense_pairs / float((depth + 1).sum()),
        fork_edges=int(nch[nch >= 2].sum()), max_depth=int(depth.max()),
        num_segments=int(f.seg_parent.numel()) - f.num_pad,
    )


@dataclass(slots=True)
class Microbatch:
    """One packed row: sequences ``seq_ids`` (indices into the step's list) run as a tree or THD; or
    (``mode="shared"``) one tree larger than the cap, run as a shared-prefix group (:mod:`harts.prefix`):
    a prefix microbatch of ``prefix_len`` shared tokens and ``parts`` below it."""

    seq_ids: list[int]
    mode: Literal["tree", "thd", "shared"]
    real_rows: int
    """Compact nodes (tree, shared: all microbatches of the group) or tokens (THD) before alignment padding."""
    rows: int
    """Rows after padding to ``align`` (shared: the sum over the group's microbatches)."""
    total_tokens: int
    """Σ L_i of the microbatch."""
    attn_pairs: int
    """Attended (query, key) pairs."""
    cost: float = 0.0
    prefix_len: int = 0
    """Shared: tokens of the prefix every sequence of the group starts with, run once."""
    parts: list[list[int]] = field(default_factory=list)
    """Shared: the sequences of each part (a microbatch below the prefix), in order."""
    align: int = 1
    """Shared: row alignment of the group's microbatches."""

    @property
    def compression(self) -> float:
        return self.total_tokens / self.real_rows

    def build(self, seqs, *, vocab_size: int | None = None, device=None) -> Forest:
        """Padded :class:`Forest` of this microbatch (a chain forest in THD mode); sequence ``k``
        of the forest is ``seqs[seq_ids[k]]``. Shared-prefix groups: :meth:`build_shared`."""
        if self.mode == "shared":
            raise PlanError("a shared-prefix group has no single forest: use Microbatch.build_shared() and "
                            "harts.megatron.tree_shared_step()")
        sub = [seqs[i] for i in self.seq_ids]
        builder = build_forest if self.mode == "tree" else build_chain_forest
        f = builder(sub, vocab_size=vocab_size, device=device)
        return f.padded(self.rows)  # num_nodes <= rows, so this pads to exactly rows

    def build_shared(self, seqs, *, vocab_size: int | None = None, device=None) -> SharedPrefixBatch:
        """The :class:`~harts.prefix.SharedPrefixBatch` of a ``mode="shared"`` microbatch."""
        if self.mode != "shared":
            raise PlanError(f"build_shared() needs a shared-prefix group, this microbatch is mode={self.mode!r}")
        return build_shared_prefix(seqs, self.parts, prefix_len=self.prefix_len, align=self.align,
                                   vocab_size=vocab_size, device=device)


@dataclass(slots=True)
class StepPlan:
    """Microbatches per DP rank (same count on every rank), with batch statistics."""

    ranks: list[list[Microbatch]]
    stats: SharingStats
    planner_seconds: float
    config: PlannerConfig = field(repr=False)

    @property
    def microbatches(self) -> list[Microbatch]:
        return [mb for r in self.ranks for mb in r]

    def rank_costs(self) -> list[float]:
        return [sum(mb.cost for mb in r) for r in self.ranks]

    def summary(self) -> dict:
        """Per-step numbers to log: compression, pad fraction, fallback rate, imbalance."""
        mbs = self.microbatches
        rows = sum(mb.rows for mb in mbs)
        costs = self.rank_costs()
        return {
            **self.stats.as_dict(),
            "num_microbatches": len(mbs),
            "packed_compression": sum(mb.total_tokens for mb in mbs) / max(sum(mb.real_rows for mb in mbs), 1),
            "pad_fraction": 1.0 - sum(mb.real_rows for mb in mbs) / max(rows, 1),
            "fallback_rate": sum(mb.mode == "thd" for mb in mbs) / max(len(mbs), 1),
            "dp_imbalance": max(costs) / max(sum(costs) / len(costs), 1e-30) - 1.0,
            "planner_seconds": self.planner_seconds,
        }


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _cost(c: CostModelConfig, rows: int, pairs: int) -> float:
    return c.c0 + c.c_token * rows + c.c_attn * pairs


def _thd_mbs(ids: list[int], lens: np.ndarray, cfg: PlannerConfig) -> list[Microbatch]:
    """First-fit-decreasing packing of whole sequences (plain THD) under the aligned cap."""
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(ids, key=lambda i: -int(lens[i])):
        n = int(lens[i])
        k = next((k for k, t in enumerate(fill) if _align(t + n, cfg.align) <= cfg.token_cap), None)
        if k is None:
            bins.append([])
            fill.append(0)
            k = len(bins) - 1
        bins[k].append(i)
        fill[k] += n
    mbs = []
    for run in bins:
        t = int(lens[run].sum())
        pairs = int((lens[run] * (lens[run] + 1) // 2).sum())
        mbs.append(Microbatch(seq_ids=sorted(run), mode="thd", real_rows=t, rows=_align(t, cfg.align),
                              total_tokens=t, attn_pairs=pairs, cost=_cost(cfg.cost, _align(t, cfg.align), pairs)))
    return mbs


def _tree_mb(run: list[int], arrs: list[np.ndarray], cfg: PlannerConfig, base: int = 0) -> Microbatch:
    """Rows and attention pairs of a sorted run as one tree (``base``: depth of its first row, the
    prefix held by another microbatch)."""
    rows, pairs, total = 0, 0, 0
    prev = None
    for i in run:
        a = arrs[i]
        lcp = _lcp(prev, a) if prev is not None else base
        rows += a.size - lcp
        pairs += (a.size * (a.size + 1) - lcp * (lcp + 1)) // 2
        total += a.size
        prev = a
    r = _align(rows, cfg.align)
    return Microbatch(seq_ids=list(run), mode="tree", real_rows=rows, rows=r, total_tokens=total, attn_pairs=pairs,
                      cost=_cost(cfg.cost, r, pairs))


def _trees(order: list[int], arrs: list[np.ndarray]) -> list[list[int]]:
    """The sorted order cut into trees (maximal runs of neighbours sharing their first token)."""
    out: list[list[int]] = []
    for i in order:
        if out and arrs[out[-1][-1]][0] == arrs[i][0]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _runs(ids: list[int], arrs: list[np.ndarray], base: int, cap: int, align: int) -> list[list[int]]:
    """Greedy contiguous runs of sorted sequences whose rows below depth ``base`` fit ``cap``."""
    runs: list[list[int]] = []
    rows, prev = 0, None
    for i in ids:
        a = arrs[i]
        add = a.size - _lcp(prev, a) if runs else 0
        if runs and _align(rows + add, align) <= cap:
            runs[-1].append(i)
            rows += add
        else:
            runs.append([i])
            rows = a.size - base
        prev = a
    return runs


def _shared_mb(tree: list[int], arrs: list[np.ndarray], cfg: PlannerConfig) -> Microbatch | None:
    """A shared-prefix group (:mod:`harts.prefix`) for a sorted tree whose rows exceed the cap, or
    None (the tree fits, its common prefix is shorter than ``align``, or a part cannot fit)."""
    mb = _tree_mb(tree, arrs, cfg)
    if mb.rows <= cfg.token_cap:
        return None
    p = min(min(arrs[i].size for i in tree), _lcp(arrs[tree[0]], arrs[tree[-1]]))  # sorted: first vs last
    longer = [i for i in tree if arrs[i].size > p]
    kids = len({int(arrs[i][p]) for i in longer})
    prefix_rows = _align(p + kids, cfg.align)
    room = cfg.token_cap - prefix_rows
    if p < cfg.align or not longer or any(_align(arrs[i].size - p, cfg.align) > room for i in longer):
        return None
    # the fewest parts, then the smallest largest part: the smallest greedy cap giving as few parts
    n = len(_runs(longer, arrs, p, room, cfg.align))
    longest = max(_align(arrs[i].size - p, cfg.align) for i in longer)
    lo, hi = longest // cfg.align, room // cfg.align
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_runs(longer, arrs, p, mid * cfg.align, cfg.align)) <= n:
            hi = mid
        else:
            lo = mid + 1
    parts = _runs(longer, arrs, p, lo * cfg.align, cfg.align)
    parts[0] = [i for i in tree if arrs[i].size == p] + parts[0]  # sequences that end inside the prefix
    real, rows, pairs = p + kids, prefix_rows, p * (p + 1) // 2 + kids * (p + 1)
    for part in parts:
        sub = _tree_mb([i for i in part if arrs[i].size > p], arrs, cfg, base=p)
        real, rows, pairs = real + sub.real_rows, rows + sub.rows, pairs + sub.attn_pairs
    return Microbatch(seq_ids=[i for part in parts for i in part], mode="shared", real_rows=real, rows=rows,
                      total_tokens=mb.total_tokens, attn_pairs=pairs, cost=_cost(cfg.cost, rows, pairs), prefix_len=p,
                      parts=parts, align=cfg.align)


def plan_step(seqs, config: PlannerConfig, *, vocab_size: int | None = None) -> StepPlan:
    """Plan one training step's microbatches for ``config.dp_size`` ranks.

    Raises :class:`CapacityError` naming a sequence whose aligned length exceeds
    ``token_cap``, and :class:`PlanError` when there are fewer sequences than DP ranks.
    """
    t0 = time.perf_counter()
    cfg = config
    arrs = as_token_lists(seqs, vocab_size=vocab_size)
    lens = np.array([a.size for a in arrs], dtype=np.int64)
    for i, n in enumerate(lens):
        if _align(int(n), cfg.align) > cfg.token_cap:
            raise CapacityError(f"sequence {i} has length {int(n)} ({_align(int(n), cfg.align)} rows after "
                                f"alignment to {cfg.align}), more than token_cap={cfg.token_cap}")
    if len(arrs) < cfg.dp_size:
        raise PlanError(f"{len(arrs)} sequences cannot fill dp_size={cfg.dp_size} ranks")
    order = lexicographic_order(arrs)
    runs, cur, rows, prev = [], [], 0, None
    mbs: list[Microbatch] = []
    for tree in _trees(order, arrs):
        if cfg.prefix_reuse:
            shared = _shared_mb(tree, arrs, cfg)
            if shared is not None:
                mbs.append(shared)
                continue
        for i in tree:
            a = arrs[i]
            add = a.size - (_lcp(prev, a) if cur else 0)
            if cur and _align(rows + add, cfg.align) > cfg.token_cap:
                runs.append(cur)
                cur, rows, add = [], 0, a.size
            cur.append(i)
            rows += add
            prev = a
    if cur:
        runs.append(cur)
    fallback: list[int] = []  # sequences of barely-compressing runs, repacked together as THD
    for run in runs:
        mb = _tree_mb(run, arrs, cfg)
        if mb.compression < cfg.fallback_compression:
            fallback.extend(run)
        else:
            mbs.append(mb)
    if fallback:
        mbs.extend(_thd_mbs(fallback, lens, cfg))
    # every rank gets the same number of microbatches: split the costliest splittable one
    while len(mbs) % cfg.dp_size:
        cand = [k for k, mb in enumerate(mbs) if len(mb.seq_ids) > 1 and mb.mode != "shared"]
        if not cand:
            raise PlanError(f"cannot split {len(mbs)} single-sequence microbatches evenly over dp_size={cfg.dp_size}")
        k = max(cand, key=lambda k: mbs[k].cost)
        mb = mbs.pop(k)
        h = len(mb.seq_ids) // 2
        for part in (mb.seq_ids[:h], mb.seq_ids[h:]):
            mbs.extend([_tree_mb(part, arrs, cfg)] if mb.mode == "tree" else _thd_mbs(part, lens, cfg))
    # longest-processing-time-first with an equal count per rank
    per = len(mbs) // cfg.dp_size
    ranks: list[list[Microbatch]] = [[] for _ in range(cfg.dp_size)]
    load = [0.0] * cfg.dp_size
    for mb in sorted(mbs, key=lambda m: -m.cost):
        r = min((r for r in range(cfg.dp_size) if len(ranks[r]) < per), key=lambda r: load[r])
        ranks[r].append(mb)
        load[r] += mb.cost
    stats = sharing_stats([arrs[i] for i in range(len(arrs))])
    return StepPlan(ranks=ranks, stats=stats, planner_seconds=time.perf_counter() - t0, config=cfg)


def fit_cost_model(rows: list[float], pairs: list[float], seconds: list[float]) -> CostModelConfig:
    """Non-negative least-squares fit of ``seconds ≈ c0 + c_token·rows + c_attn·pairs``."""
    if not (len(rows) == len(pairs) == len(seconds)) or len(rows) < 3:
        raise ValueError(f"need >= 3 equally long samples, got {len(rows)}, {len(pairs)}, {len(seconds)}")
    a = torch.tensor([[1.0, r, p] for r, p in zip(rows, pairs)], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1e-30)
    active = [0, 1, 2]
    while True:
        sol = torch.linalg.lstsq(a[:, active] / scale[active], y[:, None]).solution[:, 0] / scale[active]
        neg = [active[k] for k in range(len(active)) if sol[k] < 0]
        if not neg:
            break
        active = [c for c in active if c not in neg]
        if not active:
            sol = torch.zeros(0, dtype=torch.float64)
            break
    coef = [0.0, 0.0, 0.0]
    for k, c in enumerate(active):
        coef[c] = float(sol[k])
    return CostModelConfig(c0=coef[0], c_token=coef[1], c_attn=coef[2])
