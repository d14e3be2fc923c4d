"""Gated DeltaNet over a prefix forest: tree short convolution and recurrent-state handoff.

Two pieces make a linear-attention layer exact on the compact row of a
:class:`harts.forest.Forest`:

* **Tree convolution.** The causal depthwise conv of width ``W`` reads, for compact node ``v``,
  its ancestors ``anc_j(v)`` (``anc_0 = v``, ``anc_{j+1} = parent(anc_j)``, zero past the root):
  ``y_v = act(b + Σ_{j<W} w_{W−1−j} ⊙ x_{anc_j(v)})``. One gather of ``x`` by the ancestor table
  ``anc [T, W]`` and one weighted sum; the backward is a scatter-add into the ancestor rows.
* **State handoff.** The recurrence runs on *pieces* (contiguous runs of compact rows, at most a
  compressed-trie segment) in rounds: every piece of round ``r`` starts from the fp32 final state
  of its parent piece (round ``r − 1``) and all pieces of a round go into one varlen kernel call
  (FLA ``chunk_gated_delta_rule(..., initial_state, output_final_state=True, cu_seqlens)`` on
  CUDA, :func:`harts.gdn_reference.chunk_gated_delta_rule_reference` per piece on CPU).
  Gradients flow through the handoff (``dh_T → dh_0``). The number of rounds is the depth of
  the piece tree: one per level of segments (``schedule='level'``), or, with ``'chain'``, one
  child continues each chain and fork states inside a chain come from state-only pieces that
  recompute the chain's prefix in the same round (fewer rounds, more recurrence rows);
  ``'auto'`` (default) takes the chain schedule when it has fewer rounds.

**Chunk alignment** (``align=True``). Chunked kernels split each varlen sequence at offsets
``0, C, 2C, ...``; per-sequence execution therefore has chunk boundaries at depths that are
multiples of ``C``. With alignment every piece starts at such a depth: a child forking at depth
``d`` with ``d mod C ≠ 0`` starts from the state at ``b = ⌊d/C⌋·C`` (the piece holding depth
``b − 1`` is cut there so its final state is that state) and replays the ``d − b ≤ C − 1``
ancestor tokens through the recurrence only (their outputs are discarded; their k, v, g, β
receive gradient through the child, as in per-sequence execution). Then every chunk the kernel
computes is a chunk of per-sequence execution with the same start state, so tree and
per-sequence results agree to the kernel's own noise. Cost: at most ``C − 1`` replayed tokens per
fork and one more piece per cut, hence possibly more rounds. Without alignment results agree
only up to float reassociation across different chunk boundaries (exact in exact arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.errors import GdnConfigError, GdnShapeError, HartsConfigTypeError
from harts.forest import Forest
from harts.gdn_rounds import check_graphs_plan, torch_pieces, tree_recurrence
from harts.upload import upload
from mcore_distill.validate import validate_fields

__all__ = ["GdnConfigError", "GdnShapeError", "GdnTreeConfig", "GdnRound", "GdnPlan", "ancestor_table",
           "build_gdn_plan", "resolve_backend", "tree_causal_conv1d", "tree_causal_conv1d_fla", "tree_gated_delta_rule", "chain_rounds"]




_CHUNK_SIZES = (16, 32, 64)
_BACKENDS = ("auto", "fla", "torch")
_STATE_DTYPES = ("float32", "float64")
_SCHEDULES = ("auto", "level", "chain")


@dataclass(kw_only=True, slots=True)
class GdnTreeConfig:
    """Options of the tree Gated DeltaNet path (a Hydra structured config)."""

    chunk_size: int = 64
    """Chunk length ``C`` of the chunked kernel (FLA accepts 16, 32, 64); alignment uses it."""
    align: bool = True
    """Replay ``≤ C − 1`` shared tokens per fork so chunk boundaries sit where per-sequence
    execution puts them (results match to kernel noise). False: no replay, fewer pieces, results
    differ by float reassociation."""
    backend: str = "auto"
    """Recurrence kernel: ``fla`` (Triton ``chunk_gated_delta_rule``, CUDA), ``torch`` (plain
    chunked reference, any device, fp64-capable) or ``auto`` (``fla`` on CUDA, else ``torch``)."""
    state_dtype: str = "float32"
    """Dtype of handed-off states: ``float32`` (what FLA exports), or ``float64`` (torch backend with
    fp64 inputs only, for exactness tests)."""
    conv_width: int = 4
    """Short-convolution width ``W`` (``linear_conv_kernel_dim``; the ancestor table has W columns)."""
    schedule: str = "auto"
    """``level``: one round per trie level of pieces. ``chain``: one child continues each chain
    (fewer rounds on deep trees), fork states inside a chain are recomputed by state-only pieces.
    ``auto``: ``chain`` when it needs fewer rounds than ``level``, else ``level``. Every round is
    one more FLA call per GDN layer, forward and backward, and on an H200 host each costs about as
    much host time as the GPU spends on a 16k-token round, so rounds, not recomputed tokens, set
    the wall clock (a 9-round caterpillar: 314 ms level vs 158 ms chain, docs/harts_gdn.md)."""
    cuda_graphs: bool = True
    """FLA backend: capture the layer's recurrence (the forward over all rounds, and the backward) in a
    CUDA graph at its second use in a microbatch and replay it for the remaining GDN layers
    (:mod:`harts.gdn_graphs`; bitwise equal results; the host cost is paid twice per direction instead
    of once per layer, plus each replay's input and output copies: at Qwen3-Next widths 76.2 vs
    80.7 ms per tree step, docs/benchmarks.md). No effect on the torch backend."""

    def __post_init__(self) -> None:
        validate_fields(self, error=GdnConfigError, type_error=HartsConfigTypeError)
        if self.chunk_size not in _CHUNK_SIZES:
            raise GdnConfigError(f"GdnTreeConfig.chunk_size must be one of {_CHUNK_SIZES}, got {self.chunk_size}")
        if self.backend not in _BACKENDS:
            raise GdnConfigError(f"GdnTreeConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.state_dtype not in _STATE_DTYPES:
            raise GdnConfigError(
                f"GdnTreeConfig.state_dtype must be 'float32' (or 'float64' for fp64 tests), got {self.state_dtype!r}")
        if self.conv_width < 1:
            raise GdnConfigError(f"GdnTreeConfig.conv_width must be >= 1, got {self.conv_width}")
        if self.schedule not in _SCHEDULES:
            raise GdnConfigError(f"GdnTreeConfig.schedule must be one of {_SCHEDULES}, got {self.schedule!r}")


@dataclass(frozen=True, eq=False)
class GdnRound:
    """One varlen kernel call. ``n`` packed rows (replayed rows included), ``N`` pieces."""

    rows: torch.Tensor
    """[n] compact row gathered into each packed position."""
    cu_seqlens: torch.Tensor
    """[N+1] piece boundaries in the packed rows."""
    cu_seqlens_cpu: torch.Tensor
    """The same on the host (FLA then needs no device-to-host sync per call)."""
    chunk_indices: torch.Tensor
    """[NT, 2] (piece, chunk within the piece) of every ``chunk_size`` chunk: FLA's
    ``prepare_chunk_indices`` computed at planning time, so the kernels never rebuild it (each
    rebuild is a host computation and a synchronizing host-to-device copy)."""
    keep: torch.Tensor
    """[n_keep] packed positions whose outputs are kept (not replayed)."""
    init_sources: tuple
    """``(src_round, src_idx [m], dst_idx [m])`` triples: piece ``dst_idx`` of this round starts from
    the final state of piece ``src_idx`` of round ``src_round``; other pieces start from zeros."""
    grad_rows: torch.Tensor | None = None
    """[n] compact row whose output each packed position is (``T`` for replayed and state-only
    positions, whose outputs are discarded): the backward of :mod:`harts.gdn_rounds` reads the
    output gradient of position ``j`` from row ``grad_rows[j]`` of ``dout`` extended by a zero row."""


@dataclass(frozen=True, eq=False)
class GdnPlan:
    """Execution plan of the recurrence over one forest (built once per microbatch)."""

    num_nodes: int
    """T, compact rows (padding included)."""
    chunk_size: int
    align: bool
    anc: torch.Tensor
    """[T, W] ancestor table (``-1`` past the root) for the tree convolution."""
    rounds: tuple
    """:class:`GdnRound` per sequential kernel call."""
    inverse: torch.Tensor
    """[T] position of each compact row in the concatenation of all rounds' kept outputs."""
    replay_tokens: int
    """Rows recomputed for chunk alignment (ancestors replayed before fork children)."""
    num_pieces: int
    identity: bool = False
    """One round whose packed rows are ``0..T-1`` in order (no gather or permutation needed)."""
    export_tokens: int = 0
    """Rows recomputed by state-only pieces (chain schedule)."""
    schedule: str = "level"
    conv_cu_seqlens: torch.Tensor | None = None
    """[S+1] trie segment offsets: the varlen sequences of the FLA tree convolution."""
    conv_cu_seqlens_cpu: torch.Tensor | None = None
    """The same on the host."""
    conv_chunk_indices: torch.Tensor | None = None
    """[NT, 2] chunk indices of the convolution's segments (FLA's 64-row conv chunks)."""
    conv_history: torch.Tensor | None = None
    """[S, W−1] rows of each segment's ancestors at distance ``W−1 … 1`` (``T`` = a zero row past a
    root): the FLA convolution's initial state per segment (:func:`tree_causal_conv1d_fla`)."""

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def to(self, device) -> GdnPlan:
        def mv(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        rounds = tuple(GdnRound(rows=mv(r.rows), cu_seqlens=mv(r.cu_seqlens), cu_seqlens_cpu=r.cu_seqlens_cpu,
                                chunk_indices=mv(r.chunk_indices), keep=mv(r.keep),
                                init_sources=tuple((a, mv(b), mv(c)) for a, b, c in r.init_sources),
                                grad_rows=mv(r.grad_rows))
                       for r in self.rounds)
        return GdnPlan(num_nodes=self.num_nodes, chunk_size=self.chunk_size, align=self.align, anc=mv(self.anc),
                       rounds=rounds, inverse=mv(self.inverse), replay_tokens=self.replay_tokens,
                       num_pieces=self.num_pieces, identity=self.identity, export_tokens=self.export_tokens,
                       schedule=self.schedule, conv_cu_seqlens=mv(self.conv_cu_seqlens),
                       conv_cu_seqlens_cpu=self.conv_cu_seqlens_cpu, conv_chunk_indices=mv(self.conv_chunk_indices),
                       conv_history=mv(self.conv_history))


def ancestor_table(parent: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] int64: column ``j`` is the ``j``-th ancestor (column 0 = the node), ``-1`` past a root."""
    if width < 1:
        raise GdnConfigError(f"conv width must be >= 1, got {width}")
    cols = [torch.arange(parent.numel(), device=parent.device)]
    ext = torch.cat([parent, parent.new_full((1,), -1)])  # ext[-1] = parent of "-1" = -1
    for _ in range(width - 1):
        cols.append(ext[cols[-1]])
    return torch.stack(cols, 1)


def _conv_pre(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, anc: torch.Tensor,
              acc: torch.dtype) -> torch.Tensor:
    """Pre-activation ``b + Σ_j weight[:, W−1−j] ⊙ xp[anc[:, j]]`` in ``acc`` (``xp`` has a zero last row)."""
    w = weight.shape[1]
    pre = xp.index_select(0, anc[:, 0]).to(acc) * weight[:, w - 1].to(acc)
    for j in range(1, w):
        pre = pre + xp.index_select(0, anc[:, j]).to(acc) * weight[:, w - 1 - j].to(acc)
    return pre if bias is None else pre + bias.to(acc)


class _TreeConv(torch.autograd.Function):
    """Saves only ``x`` and the ancestor table; backward recomputes the pre-activation and
    scatter-adds ``dpre ⊙ w_j`` into each tap's ancestor rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, anc, silu):
        acc = torch.promote_types(x.dtype, torch.float32)
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T (= index -1) is the zero row
        a = torch.where(anc >= 0, anc, x.shape[0])
        pre = _conv_pre(xp, weight, bias, a, acc)
        ctx.save_for_backward(x, weight, bias, a)
        ctx.silu = silu
        return (torch.nn.functional.silu(pre) if silu else pre).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, a = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])])
        dpre = dy.to(acc)
        if ctx.silu:
            pre = _conv_pre(xp, weight, bias, a, acc)
            sg = torch.sigmoid(pre)
            dpre = dpre * (sg * (1 + pre * (1 - sg)))
        w = weight.shape[1]
        dx = torch.zeros(xp.shape, dtype=acc, device=x.device)
        dw = torch.empty(weight.shape, dtype=acc, device=x.device)
        for j in range(w):
            # index_put_ with accumulate has a deterministic CUDA path (torch.use_deterministic_algorithms)
            dx.index_put_((a[:, j],), dpre * weight[:, w - 1 - j].to(acc), accumulate=True)
            dw[:, w - 1 - j] = (dpre * xp.index_select(0, a[:, j]).to(acc)).sum(0)
        db = dpre.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx[:-1].to(x.dtype), dw.to(weight.dtype), db, None, None


def _check_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> tuple[int, int]:
    """``(D, W)`` of a depthwise conv ``weight [D, W]`` after checking ``x [T, D]`` and ``activation``."""
    d, w = weight.shape
    if x.dim() != 2 or x.shape[1] != d:
        raise GdnShapeError(f"x must be [T, D={d}] to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if activation not in ("silu", "swish", None):
        raise GdnConfigError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    return d, w


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       anc: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv along trie paths: ``x [T, D]``, ``weight [D, W]``, ``anc [T, W']`` (W' ≥ W).

    ``y_v = act(b + Σ_{j<W} weight[:, W−1−j] ⊙ x_{anc_j(v)})``; rows past a root read zeros.
    Parallel over all rows (one gather per tap, accumulated in at least fp32, output in
    ``x.dtype``); the backward is a scatter-add into ``x`` (``index_put_(accumulate=True)``). Only
    ``x`` and the ancestor table are saved (the pre-activation is recomputed).
    """
    d, w = _check_conv(x, weight, activation)
    if anc.dim() != 2 or anc.shape[0] != x.shape[0] or anc.shape[1] < w:
        raise GdnShapeError(f"ancestor table {tuple(anc.shape)} must be [T={x.shape[0]}, >= W={w}]")
    return _TreeConv.apply(x, weight, bias, anc[:, :w], activation is not None)


def tree_causal_conv1d_fla(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           plan: GdnPlan, activation: str | None = "silu") -> torch.Tensor:
    """:func:`tree_causal_conv1d` as one FLA ``causal_conv1d`` call (CUDA): every trie segment is a
    varlen sequence whose initial state holds its ``W−1`` nearest ancestors, so the first rows of a
    segment read their trie context instead of the previous segment in memory. The ancestor rows
    are gathered from ``x`` (differentiable: FLA's state gradient flows back into them)."""
    from fla.modules.convolution import causal_conv1d

    d, w = _check_conv(x, weight, activation)
    hist = plan.conv_history
    if hist.shape[1] < w - 1:
        raise GdnConfigError(f"GdnTreeConfig.conv_width={hist.shape[1] + 1} is smaller than the layer's "
                             f"conv width {w}")
    state = None
    if w > 1:
        s, t = hist.shape[0], x.shape[0]
        idx = hist[:, hist.shape[1] - (w - 1):]
        # only the S·(W−1) history rows are read; rows past a root (index T) become zeros
        h = x.index_select(0, idx.clamp(max=t - 1).reshape(-1)).view(s, w - 1, d) * (idx < t)[..., None]
        # FLA reads position W−m of the state as the input m steps before the sequence (m = 1 … W−1)
        state = torch.cat([h.new_zeros(s, 1, d), h], 1).transpose(1, 2).contiguous()
    y, _ = causal_conv1d(x[None], weight, bias, initial_state=state, activation=activation,
                         cu_seqlens=plan.conv_cu_seqlens, cu_seqlens_cpu=plan.conv_cu_seqlens_cpu,
                         chunk_indices=plan.conv_chunk_indices)
    return y[0]


# ---------------------------------------------------------------------------------------------
# planning (host side, numpy)
# ---------------------------------------------------------------------------------------------
def _ancestor_at_depth(node: int, target: int, parent: np.ndarray, depth: np.ndarray, seg_start: np.ndarray,
                       node_seg: np.ndarray) -> int:
    """Ancestor-or-self of ``node`` at depth ``target`` (segments are contiguous chains)."""
    while True:
        s = seg_start[node_seg[node]]
        if depth[s] <= target:
            return int(s + (target - depth[s]))
        node = int(parent[s])


def _level_pieces(parent, depth, seg_start, seg_end, node_seg, t, chunk_size, align):
    """Pieces = segments, cut where an aligned fork needs the state at a chunk boundary.

    Returns ``rows_of`` (per piece: replayed rows then own rows), ``skip`` (leading rows whose
    outputs are dropped) and ``src`` (piece whose final state starts it, -1 = zeros).
    """
    starts = set(int(x) for x in seg_start)
    replay_from: dict[int, int] = {}  # piece start -> first replayed depth b
    if align:
        for s0 in seg_start:
            p, d = parent[s0], int(depth[s0])
            if p < 0 or d % chunk_size == 0:
                continue
            b = d - d % chunk_size
            replay_from[int(s0)] = b
            if b > 0:
                a = _ancestor_at_depth(int(p), b - 1, parent, depth, seg_start, node_seg)
                if a + 1 < seg_end[node_seg[a]]:
                    starts.add(a + 1)  # a is mid-segment: cut so that a piece ends at a
    pstart = np.array(sorted(starts), dtype=np.int64)
    pend = np.minimum(np.append(pstart[1:], t), seg_end[node_seg[pstart]])  # next start or segment end
    piece_of = np.repeat(np.arange(pstart.size), pend - pstart)
    rows_of, skip, src = [], [], []
    for s0, e in zip(pstart, pend):
        own = np.arange(s0, e, dtype=np.int64)
        p = int(parent[s0])
        b = replay_from.get(int(s0))
        if p < 0 or b is None:  # a root, or starts from the state after its parent node
            rows_of.append(own)
            skip.append(0)
            src.append(-1 if p < 0 else int(piece_of[p]))
            continue
        rep = _path_rows(p, b, int(depth[s0]), parent, depth, seg_start, node_seg)
        rows_of.append(np.concatenate([rep, own]))
        skip.append(rep.size)
        src.append(int(piece_of[_ancestor_at_depth(p, b - 1, parent, depth, seg_start, node_seg)]) if b > 0 else -1)
    return rows_of, skip, src, int(sum(skip)), 0


def _path_rows(node, lo, hi, parent, depth, seg_start, node_seg) -> np.ndarray:
    """Ancestors-or-self of ``node`` at depths ``lo..hi-1``."""
    return np.array([_ancestor_at_depth(node, dd, parent, depth, seg_start, node_seg) for dd in range(lo, hi)],
                    dtype=np.int64)


def _chain_pieces(parent, depth, seg_start, seg_end, node_seg, seg_parent, chunk_size, align):
    """Pieces = chains (a segment continued by the child segment with the most rounds below it).

    A fork child needs the state after a node ``x`` (its parent, or with alignment the last node
    before its chunk boundary). If ``x`` ends its chain's piece, that piece's final state is used;
    otherwise a *state-only* piece re-runs the chain from its start up to ``x`` in the same round
    (outputs dropped), trading recomputed rows for rounds.
    """
    n = seg_start.size
    kids: list[list[int]] = [[] for _ in range(n)]
    for sg in range(n):
        if seg_parent[sg] >= 0:
            kids[seg_parent[sg]].append(sg)
    r = np.ones(n, dtype=np.int64)
    cont = np.full(n, -1, dtype=np.int64)
    for sg in range(n - 1, -1, -1):  # children follow parents in pre-order
        if kids[sg]:
            vals = [int(r[c]) for c in kids[sg]]
            best = int(np.argmax(vals))
            cont[sg] = kids[sg][best]
            rest = vals[:best] + vals[best + 1:]
            r[sg] = max(vals[best], max(rest) + 1) if rest else vals[best]
    is_cont = np.zeros(n, dtype=bool)
    is_cont[cont[cont >= 0]] = True
    heads = [sg for sg in range(n) if not is_cont[sg]]
    chain_of = np.zeros(seg_end[-1] if n else 0, dtype=np.int64)  # node -> chain
    pos_of = np.zeros_like(chain_of)  # node -> position among the chain's own rows
    own_of = []
    for ci, h in enumerate(heads):
        segs, sg = [], h
        while sg >= 0:
            segs.append(np.arange(seg_start[sg], seg_end[sg], dtype=np.int64))
            sg = cont[sg]
        own = np.concatenate(segs)
        chain_of[own] = ci
        pos_of[own] = np.arange(own.size)
        own_of.append(own)
    rows_of, skip, need = [], [], []  # need: node whose post-state starts the chain (-1 = zeros)
    for ci, h in enumerate(heads):
        c0 = int(seg_start[h])
        p, d = int(parent[c0]), int(depth[c0])
        rep = np.zeros(0, dtype=np.int64)
        x = p
        if p >= 0 and align and d % chunk_size:
            b = d - d % chunk_size
            rep = _path_rows(p, b, d, parent, depth, seg_start, node_seg)
            x = _ancestor_at_depth(p, b - 1, parent, depth, seg_start, node_seg) if b > 0 else -1
        rows_of.append(np.concatenate([rep, own_of[ci]]))
        skip.append(rep.size)
        need.append(x)
    src = [-1] * len(heads)
    exports: dict[tuple[int, int], int] = {}
    replay = int(sum(skip))
    for ci, x in enumerate(need):
        if x < 0:
            continue
        xc = int(chain_of[x])
        if pos_of[x] == own_of[xc].size - 1:  # x ends its chain: use that chain's final state
            src[ci] = xc
            continue
        key = (xc, int(x))
        if key not in exports:  # state-only piece: the chain's rows up to and including x
            exports[key] = len(rows_of)
            rows_of.append(rows_of[xc][:skip[xc] + int(pos_of[x]) + 1])
            skip.append(rows_of[-1].size)
            src.append(-1)  # set below, once every chain's source is known
        src[ci] = exports[key]
    for (xc, _), pi in exports.items():  # a state-only piece starts like its chain
        src[pi] = src[xc]
    return rows_of, skip, src, replay, int(sum(skip)) - replay


def build_gdn_plan(forest: Forest, *, chunk_size: int = 64, align: bool = True, conv_width: int = 4,
                   schedule: str = "auto") -> GdnPlan:
    """Plan the recurrence over ``forest``.

    ``schedule='level'``: pieces are trie segments (cut at chunk boundaries when aligning); rounds
    = depth of the piece tree. ``schedule='chain'``: one child continues each chain (fewer rounds,
    see :func:`chain_rounds`), fork states in the middle of a chain come from state-only pieces
    that recompute the chain's prefix (``export_tokens``). A piece's round is one more than its
    state source's round; pieces without a source run in round 0. ``schedule='auto'``: the chain
    schedule if it has fewer rounds than the level schedule, else the level schedule
    (:attr:`GdnTreeConfig.schedule`); ``GdnPlan.schedule`` names the one used.
    """
    if chunk_size not in _CHUNK_SIZES:
        raise GdnConfigError(f"chunk_size must be one of {_CHUNK_SIZES}, got {chunk_size}")
    if schedule not in _SCHEDULES:
        raise GdnConfigError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    h = forest.host or {k: getattr(forest, k).cpu().numpy() for k in ("parent", "depth", "seg_offsets", "node_seg",
                                                                       "seg_parent")}
    parent, depth, seg_off, node_seg = h["parent"], h["depth"], h["seg_offsets"], h["node_seg"]
    t = parent.size
    seg_start, seg_end = seg_off[:-1], seg_off[1:]  # end exclusive
    if schedule in ("level", "auto"):
        pieces = _level_pieces(parent, depth, seg_start, seg_end, node_seg, t, chunk_size, align)
        rnd = _piece_rounds(pieces[2])
        if schedule == "auto" and rnd.size and rnd.max() > 1:  # a chain schedule can have fewer rounds
            chain = _chain_pieces(parent, depth, seg_start, seg_end, node_seg, h["seg_parent"], chunk_size, align)
            chain_rnd = _piece_rounds(chain[2])
            if chain_rnd.max() < rnd.max():
                pieces, rnd, schedule = chain, chain_rnd, "chain"
        schedule = "level" if schedule == "auto" else schedule
    else:
        pieces = _chain_pieces(parent, depth, seg_start, seg_end, node_seg, h["seg_parent"], chunk_size, align)
        rnd = _piece_rounds(pieces[2])
    rows_of, skip, src, replay, export = pieces
    n_p = len(rows_of)
    src_a = np.asarray(src, dtype=np.int64)
    skip_a = np.asarray(skip, dtype=np.int64)
    rounds, kept_rows, pos_in_round = [], [], np.zeros(n_p, dtype=np.int64)
    host = []  # every index array, uploaded at the end in one non-blocking copy
    for r in range(int(rnd.max()) + 1 if n_p else 0):
        ids = np.flatnonzero(rnd == r)
        pos_in_round[ids] = np.arange(ids.size)
        lens = np.array([rows_of[i].size for i in ids], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)])
        keep = np.concatenate([np.arange(cu[j] + skip_a[i], cu[j + 1]) for j, i in enumerate(ids)])
        kept_rows.append(np.concatenate([rows_of[i][skip_a[i]:] for i in ids]))
        srcs = []
        has = src_a[ids] >= 0
        for sr in (np.unique(rnd[src_a[ids[has]]]) if has.any() else []):
            dst = np.flatnonzero(has & (rnd[np.where(has, src_a[ids], 0)] == sr))
            srcs.append((int(sr), pos_in_round[src_a[ids[dst]]], dst))
        grad_rows = np.full(int(cu[-1]), t, dtype=np.int64)
        grad_rows[keep] = kept_rows[-1]
        host.append((np.concatenate([rows_of[i] for i in ids]), cu, _chunk_indices(cu, chunk_size), keep, srcs,
                     grad_rows))
    order = np.concatenate(kept_rows) if kept_rows else np.zeros(0, dtype=np.int64)
    inverse = np.empty(t, dtype=np.int64)
    inverse[order] = np.arange(t)
    anc = _ancestor_table(parent, conv_width)
    hist = anc[seg_start, 1:][:, ::-1]  # distance W−1 … 1 before each segment
    flat = [inverse, anc, seg_off, _chunk_indices(seg_off, 64), np.where(hist >= 0, hist, t)]
    for rows, cu, ci, keep, srcs, grad_rows in host:
        flat += [rows, cu, ci, keep, grad_rows] + [x for _, si, di in srcs for x in (si, di)]
    dev = iter(upload(flat, forest.parent.device))
    inverse_d, anc_d, seg_cu, conv_ci, hist_d = (next(dev) for _ in range(5))
    for _rows, cu, _ci, _keep, srcs, _grad_rows in host:
        rounds.append(GdnRound(rows=next(dev), cu_seqlens=next(dev), cu_seqlens_cpu=torch.from_numpy(cu),
                               chunk_indices=next(dev), keep=next(dev), grad_rows=next(dev),
                               init_sources=tuple((sr, next(dev), next(dev)) for sr, _, _ in srcs)))
    return GdnPlan(num_nodes=t, chunk_size=chunk_size, align=align, anc=anc_d, rounds=tuple(rounds),
                   inverse=inverse_d, replay_tokens=replay, num_pieces=int(n_p),
                   identity=len(rounds) == 1 and bool(np.array_equal(order, np.arange(t))) and not skip_a.any(),
                   export_tokens=export, schedule=schedule, conv_cu_seqlens=seg_cu,
                   conv_cu_seqlens_cpu=torch.from_numpy(np.ascontiguousarray(seg_off, dtype=np.int64)),
                   conv_chunk_indices=conv_ci, conv_history=hist_d)


def _piece_rounds(src: list[int]) -> np.ndarray:
    """Round of every piece: 0 without a state source, else one more than its source's round."""
    rnd = np.full(len(src), -1, dtype=np.int64)
    for i in range(len(src)):
        chain = []
        while rnd[i] < 0 and src[i] >= 0:
            chain.append(i)
            i = src[i]
        base = rnd[i] if rnd[i] >= 0 else 0
        rnd[i] = base
        for j in reversed(chain):
            base += 1
            rnd[j] = base
    return rnd


def _chunk_indices(cu: np.ndarray, chunk: int) -> np.ndarray:
    """``[NT, 2]`` (sequence, chunk within it) of every ``chunk``-row chunk of the varlen
    sequences ``cu``: what FLA's ``prepare_chunk_indices(cu, chunk)`` returns."""
    counts = -(-np.diff(cu) // chunk)
    seq = np.repeat(np.arange(counts.size), counts)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.stack([seq, np.arange(seq.size) - start[seq]], 1)


def _ancestor_table(parent: np.ndarray, width: int) -> np.ndarray:
    """:func:`ancestor_table` on the host (numpy)."""
    if width < 1:
        raise GdnConfigError(f"conv width must be >= 1, got {width}")
    cols = [np.arange(parent.size)]
    ext = np.append(parent, -1)  # ext[-1] = parent of "-1" = -1
    for _ in range(width - 1):
        cols.append(ext[cols[-1]])
    return np.stack(cols, 1)


def chain_rounds(forest: Forest) -> int:
    """Rounds of the chain schedule without alignment cuts (model-free statistic):
    ``r(leaf segment) = 1``, ``r(u) = max(r_1, r_2 + 1)`` over its two largest child values."""
    seg_parent = forest.host["seg_parent"] if forest.host else forest.seg_parent.cpu().numpy()
    n = seg_parent.size
    best = [[] for _ in range(n)]
    r = np.ones(n, dtype=np.int64)
    for s in range(n - 1, -1, -1):  # children follow parents in pre-order
        c = sorted(best[s], reverse=True)
        if c:
            r[s] = max(c[0], c[1] + 1) if len(c) > 1 else c[0]
        if seg_parent[s] >= 0:
            best[seg_parent[s]].append(int(r[s]))
    roots = r[seg_parent < 0]
    return int(roots.max()) if roots.size else 0


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------
def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` → ``fla`` on CUDA, ``torch`` elsewhere; ``fla`` off CUDA is a :class:`GdnConfigError`."""
    if backend not in _BACKENDS:
        raise GdnConfigError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "fla" if device.type == "cuda" else "torch"
    if backend == "fla" and device.type != "cuda":
        raise GdnConfigError(f"backend='fla' needs CUDA tensors, got device {device}")
    return backend


def _run_round(q, k, v, g, beta, *, cu: torch.Tensor, cu_cpu: torch.Tensor, h0: torch.Tensor, scale: float,
               chunk_size: int, backend: str, chunk_indices: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One varlen call: packed ``[n, ...]`` inputs, ``h0 [N, HV, K, V]`` → ``o [n, HV, V]``, ``ht [N, ...]``."""
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, ht = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                       initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size)
        return o[0], ht
    return torch_pieces(q, k, v, g, beta, h0, cu_cpu, scale, chunk_size)


def tree_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          *, plan: GdnPlan, scale: float | None = None, backend: str = "auto",
                          state_dtype: torch.dtype = torch.float32, graphs=None) -> torch.Tensor:
    """Gated delta rule over the forest of ``plan``: ``q, k [T, H, K]``, ``v [T, HV, V]``,
    ``g, beta [T, HV]`` (g in log space) → ``o [T, HV, V]``.

    Each round gathers its rows (replayed ancestors included), starts every piece from its
    source piece's final state (zeros at roots), runs one varlen call and keeps the non-replayed
    outputs; the kept outputs of all rounds are permuted back to compact order. On the FLA backend
    all rounds run in one autograd function (:func:`harts.gdn_rounds.tree_recurrence`); on the torch
    backend as recorded torch operations (:func:`composed_rounds`).
    ``graphs``: the microbatch's :class:`harts.gdn_graphs.RoundGraphs` (built for ``plan``); the FLA
    recurrence is then captured once per direction and replayed by the other layers.
    """
    t = plan.num_nodes
    if q.dim() != 3 or k.shape != q.shape:
        raise GdnShapeError(f"q and k must both be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise GdnShapeError(f"v must be [T, HV, V] with HV a multiple of H={q.shape[1]}, got {tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise GdnShapeError(f"g and beta must be [T, HV]={tuple(v.shape[:2])}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if q.shape[0] != t:
        raise GdnShapeError(f"inputs have T={q.shape[0]} rows but the plan was built for T={t}")
    if state_dtype not in (torch.float32, torch.float64):
        raise GdnConfigError(f"state_dtype must be torch.float32 (or float64 for fp64 tests), got {state_dtype}")
    check_graphs_plan(graphs, plan)
    backend = resolve_backend(backend, q.device)
    if state_dtype == torch.float64 and (backend != "torch" or q.dtype != torch.float64):
        raise GdnConfigError(f"state_dtype=float64 needs backend 'torch' and fp64 inputs, got {backend!r}, {q.dtype}")
    if backend == "torch" and q.dtype == torch.float64 and state_dtype != torch.float64:
        raise GdnConfigError("fp64 inputs on the torch backend need state_dtype=float64 (an fp32 handoff would "
                             "round the fork states)")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if backend == "fla":
        if torch.is_autocast_enabled(q.device.type):
            graphs = None
        return tree_recurrence(q, k, v, g, beta, plan=plan, kernels="fla", graphs=graphs, scale=scale,
                               state_dtype=state_dtype)
    return composed_rounds(q, k, v, g, beta, plan=plan, scale=scale, backend=backend, state_dtype=state_dtype)


def composed_rounds(q, k, v, g, beta, *, plan: GdnPlan, scale: float, backend: str,
                    state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rounds of ``plan`` as plain autograd-recorded torch operations around one varlen call per round
    (``backend``: ``torch`` or ``fla``, FLA's public ``chunk_gated_delta_rule``): the reference of
    :func:`harts.gdn_rounds.tree_recurrence` and the torch backend of :func:`tree_gated_delta_rule`."""
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    states, kept = [], []
    for rd in plan.rounds:
        n_pieces = rd.cu_seqlens.numel() - 1
        h0 = q.new_zeros(n_pieces, hv, kd, vd, dtype=state_dtype)
        for sr, si, di in rd.init_sources:
            h0 = h0.index_copy(0, di, states[sr].index_select(0, si))
        if plan.identity:  # one round over all rows in order, nothing replayed (e.g. a chain forest)
            return _run_round(q, k, v, g, beta, cu=rd.cu_seqlens, cu_cpu=rd.cu_seqlens_cpu, h0=h0, scale=scale,
                              chunk_indices=rd.chunk_indices, chunk_size=plan.chunk_size, backend=backend)[0]
        gather = [x.index_select(0, rd.rows) for x in (q, k, v, g, beta)]
        o, ht = _run_round(*gather, cu=rd.cu_seqlens, cu_cpu=rd.cu_seqlens_cpu, h0=h0, scale=scale,
                           chunk_indices=rd.chunk_indices, chunk_size=plan.chunk_size, backend=backend)
        states.append(ht.to(state_dtype))
        kept.append(o.index_select(0, rd.keep))
    return torch.cat(kept).index_select(0, plan.inverse)
