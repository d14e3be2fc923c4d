"""Global planning across data-parallel ranks: every rank learns all sequences, computes the same
:class:`~harts.planner.StepPlan`, and per-row tensors (advantages, old/behaviour log-probs,
masks, rewards) travel with their rows via ``all_to_all``; results come back in the original
order with :meth:`RowExchange.from_plan`.

Global row ids are assigned in rank order: rank ``r``'s local row ``i`` is
``g = Σ_{s<r} n_s + i``. A rank's planned rows are the concatenation of its microbatches'
``seq_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from harts.planner import StepPlan

__all__ = ["gather_sequences", "RowExchange"]


def _comm_device(group) -> torch.device:
    """Device of communication buffers: CUDA for NCCL groups, CPU otherwise."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def gather_sequences(local_seqs: Sequence, *, group=None) -> tuple[list[torch.Tensor], list[int]]:
    """All-gather every rank's token sequences. Returns (all sequences in global-id order, on
    CPU, rows per rank)."""
    dev = _comm_device(group)
    ts = [torch.as_tensor(s, dtype=torch.int64).reshape(-1).to(dev) for s in local_seqs]
    lens = torch.tensor([t.numel() for t in ts], dtype=torch.int64, device=dev)
    flat = torch.cat(ts) if ts else torch.zeros(0, dtype=torch.int64, device=dev)
    world = dist.get_world_size(group)
    sizes = torch.tensor([lens.numel(), flat.numel()], dtype=torch.int64, device=dev)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    mr, mt = max(int(s[0]) for s in all_sizes), max(int(s[1]) for s in all_sizes)
    lp = [torch.zeros(mr, dtype=torch.int64, device=dev) for _ in range(world)]
    fp = [torch.zeros(mt, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(lp, torch.nn.functional.pad(lens, (0, mr - lens.numel())), group=group)
    dist.all_gather(fp, torch.nn.functional.pad(flat, (0, mt - flat.numel())), group=group)
    out, counts = [], []
    for s, (ln, fl) in enumerate(zip(lp, fp)):
        ln, fl = ln.cpu(), fl.cpu()
        n = int(all_sizes[s][0])
        counts.append(n)
        out.extend(torch.split(fl[: int(all_sizes[s][1])], ln[:n].tolist()))
    return out, counts


class RowExchange:
    """Move per-row tensors from their owner ranks to the ranks the plan assigns, and back.

    ``counts[r]`` is the number of rows rank ``r`` owns; ``lengths [N]`` (global) are the
    per-row token counts used for per-token tensors (``per_token=True``: a flat tensor whose
    rows are consecutive slices of ``lengths[g]`` elements, e.g. ``L_g − 1`` log-probs).
    """

    def __init__(self, plan: StepPlan, counts: Sequence[int], *, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if len(plan.ranks) != self.world or len(counts) != self.world:
            raise ValueError(f"plan has {len(plan.ranks)} ranks and counts {len(counts)} entries; group size {self.world}")
        self.offsets = [0]
        for c in counts:
            self.offsets.append(self.offsets[-1] + int(c))
        self.want = [[g for mb in r for g in mb.seq_ids] for r in plan.ranks]

    def owner(self, g: int) -> int:
        for r in range(self.world):
            if g < self.offsets[r + 1]:
                return r
        raise IndexError(f"row {g} >= {self.offsets[-1]} rows")

    @property
    def planned_rows(self) -> list[int]:
        """Global ids of this rank's planned rows, in plan order."""
        return self.want[self.rank]

    def _tok(self, rows: list[int], base: int, lengths) -> torch.Tensor:
        if lengths is None:
            return torch.tensor([g - base for g in rows], dtype=torch.int64)
        off = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        parts = [torch.arange(int(off[g] - off[base]), int(off[g + 1] - off[base])) for g in rows]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _a2a(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def _count(self, rows: list[int], lengths) -> int:
        return len(rows) if lengths is None else int(sum(int(lengths[g]) for g in rows))

    def to_plan(self, x: torch.Tensor, *, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's local rows ``x`` → rows of this rank's plan (``planned_rows`` order)."""
        me, base = self.rank, self.offsets[self.rank]
        sends = [[g for g in self.want[d] if self.owner(g) == me] for d in range(self.world)]
        recvs = [[g for g in self.want[me] if self.owner(g) == s] for s in range(self.world)]
        idx = self._tok([g for s in sends for g in s], base, lengths).to(x.device)
        got = self._a2a(x.index_select(0, idx), [self._count(s, lengths) for s in sends],
                        [self._count(r, lengths) for r in recvs])
        # received grouped by source rank; reorder into plan order
        recv_rows = [g for r in recvs for g in r]
        pos = {g: k for k, g in enumerate(self.want[me])}
        order = sorted(range(len(recv_rows)), key=lambda k: pos[recv_rows[k]])
        if lengths is None:
            return got.index_select(0, torch.tensor(order, dtype=torch.int64, device=got.device))
        lens = [int(lengths[g]) for g in recv_rows]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        parts = [torch.arange(starts[k], starts[k + 1]) for k in order]
        sel = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return got.index_select(0, sel.to(got.device))

    def from_plan(self, y: torch.Tensor, *, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Results for this rank's planned rows (plan order) → this rank's own rows, original order."""
        me, base = self.rank, self.offsets[self.rank]
        sends = [[g for g in self.want[me] if self.owner(g) == s] for s in range(self.world)]
        recvs = [[g for g in self.want[d] if self.owner(g) == me] for d in range(self.world)]
        pos_plan = {g: k for k, g in enumerate(self.want[me])}
        plan_base_rows = self.want[me]
        # index of each send row inside y (plan order)
        if lengths is None:
            idx = torch.tensor([pos_plan[g] for s in sends for g in s], dtype=torch.int64)
        else:
            starts = [0]
            for g in plan_base_rows:
                starts.append(starts[-1] + int(lengths[g]))
            parts = [torch.arange(starts[pos_plan[g]], starts[pos_plan[g] + 1]) for s in sends for g in s]
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        got = self._a2a(y.index_select(0, idx.to(y.device)), [self._count(s, lengths) for s in sends],
                        [self._count(r, lengths) for r in recvs])
        recv_rows = [g for r in recvs for g in r]
        n_local = self.offsets[me + 1] - base
        if lengths is None:
            out = got.new_empty((n_local,) + tuple(got.shape[1:]))
            out[torch.tensor([g - base for g in recv_rows], dtype=torch.int64, device=got.device)] = got
            return out
        dst = self._tok(recv_rows, base, lengths).to(got.device)
        out = got.new_empty((int(dst.numel()),) + tuple(got.shape[1:]))
        out[dst] = got
        return out
