"""Prefix forest of token sequences, serialized in DFS pre-order ("compact row").

Built by lexicographic sort + longest common prefix (LCP) of sorted neighbours, never by a
Python dict trie. For sequences ``s_0..s_{N-1}`` (lengths ``L_i``) sorted lexicographically,
sorted sequence ``j`` contributes the new nodes ``s_j[lcp_j:]`` where
``lcp_j = LCP(s_{j-1}, s_j)``; appending them in sorted order yields the pre-order of the trie,
so ``T = Σ L_i − Σ lcp_j`` and every shared prefix token appears once.

Per compact node ``v`` (``0 <= v < T``):

* ``tokens[v]``: token id; ``depth[v]``: position in every sequence through ``v`` (used as the
  RoPE position); ``parent[v]``: previous node on the path (``-1`` at roots);
* ``last[v]``: end of ``v``'s contiguous subtree, so ``k`` is an ancestor-or-self of ``q`` iff
  ``k <= q <= last[k]`` (the whole tree-attention mask in O(T) integers);
* ``multiplicity[v]``: number of sequences through ``v``;
* segments: maximal single-child chains (compressed-trie nodes), contiguous slices
  ``seg_offsets[s]:seg_offsets[s+1]`` whose first node's parent is the last node of
  ``seg_parent[s]`` (``-1`` for roots). Linear-attention kernels run one recurrence per segment
  and hand its final state to child segments.

Sequence ``i`` is recovered by the CSR map ``index[seq_offsets[i]:seq_offsets[i+1]]`` (compact
node of each position). Duplicates, a sequence that is a prefix of another, single-token
sequences and forests without any sharing are ordinary cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.errors import EmptySequenceError, TokenOutOfRangeError  # noqa: F401 (re-exported)
from harts.upload import upload

__all__ = ["Forest", "build_forest", "build_chain_forest", "as_token_lists", "EmptySequenceError",
           "TokenOutOfRangeError", "lexicographic_order"]




def as_token_lists(seqs: Sequence, *, vocab_size: int | None = None) -> list[np.ndarray]:
    """Validate ``seqs`` (lists of ints or 1-D integer tensors/arrays) into int64 numpy arrays."""
    if len(seqs) == 0:
        raise EmptySequenceError("seqs is empty: need at least one sequence")
    out = []
    for i, s in enumerate(seqs):
        a = s.detach().cpu().numpy() if isinstance(s, torch.Tensor) else np.asarray(s)
        if a.ndim != 1:
            raise ValueError(f"seqs[{i}] must be 1-D, got shape {tuple(a.shape)}")
        if a.size == 0:
            raise EmptySequenceError(f"seqs[{i}] is empty (length 0)")
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"seqs[{i}] must hold integer token ids, got dtype {a.dtype}")
        a = a.astype(np.int64, copy=False)
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            bad = lo if lo < 0 else hi
            raise TokenOutOfRangeError(f"seqs[{i}] holds token id {bad} outside [0, {vocab_size})")
        out.append(a)
    return out


@dataclass(frozen=True, eq=False)
class Forest:
    """A prefix forest in DFS pre-order. All tensors are int64 on one device.

    Shapes: ``T`` compact nodes (including ``num_pad`` padding roots at the end), ``N``
    sequences, ``S`` segments, ``ΣL`` total original tokens.
    """

    tokens: torch.Tensor
    """[T] token id per compact node (0 for padding)."""
    parent: torch.Tensor
    """[T] parent node, -1 for roots and padding."""
    depth: torch.Tensor
    """[T] depth (0 at roots) = position of the node in each of its sequences."""
    last: torch.Tensor
    """[T] last node of the node's subtree (pre-order interval ``[v, last[v]]``)."""
    multiplicity: torch.Tensor
    """[T] number of sequences through the node (0 for padding)."""
    seg_offsets: torch.Tensor
    """[S+1] segment boundaries in the compact row."""
    seg_parent: torch.Tensor
    """[S] parent segment (-1 for root and padding segments)."""
    node_seg: torch.Tensor
    """[T] segment of every node."""
    index: torch.Tensor
    """[ΣL] CSR values: compact node of every (sequence, position)."""
    seq_offsets: torch.Tensor
    """[N+1] CSR offsets of each sequence into ``index``."""
    num_pad: int = 0
    """Padding roots appended at the end (attend only to themselves, never referenced)."""
    host: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """Host (numpy) copies of the tensors above, by field name, when the forest was built on the
    host (:func:`build_forest`): planners read these instead of copying from the device."""

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """T, padding included."""
        return int(self.tokens.numel())

    @property
    def num_real(self) -> int:
        """Compact nodes excluding padding."""
        return self.num_nodes - self.num_pad

    @property
    def num_seqs(self) -> int:
        return int(self.seq_offsets.numel()) - 1

    @property
    def lengths(self) -> torch.Tensor:
        """[N] original sequence lengths."""
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def total_tokens(self) -> int:
        """Σ L_i."""
        return int(self.index.numel())

    @property
    def compression(self) -> float:
        """C = Σ L_i / T (padding excluded)."""
        return self.total_tokens / max(self.num_real, 1)

    # ---- per-sequence views ------------------------------------------------------------
    def pred_offsets(self) -> torch.Tensor:
        """[N+1] offsets of the per-sequence prediction vectors (length ``L_i - 1`` each)."""
        n = (self.lengths - 1).cumsum(0)
        return torch.cat([n.new_zeros(1), n])

    def _pred_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CSR position ``j + seq(j)`` of the row of prediction ``j`` and ``seq(j)``, without a
        device-to-host synchronization (all sizes are known on the host); computed once per forest
        (the loss of every step reads them: no kernels for them after the first call)."""
        cached = self.__dict__.get("_pred")
        if cached is None:
            m = self.total_tokens - self.num_seqs
            j = torch.arange(m, device=self.index.device)
            sid = torch.searchsorted(self.pred_offsets()[1:], j, right=True)
            pos = j + sid
            cached = (pos, sid, self.index.index_select(0, pos + 1), self.index.index_select(0, pos))
            object.__setattr__(self, "_pred", cached)  # frozen dataclass: a private cache, not a field
        return cached

    def label_index(self) -> torch.Tensor:
        """[Σ(L_i-1)] compact node of positions ``1..L_i-1``: the edge whose log-prob is
        ``log p(x_t | x_<t)``, read from the parent's logits row."""
        return self._pred_positions()[2]

    def row_index(self) -> torch.Tensor:
        """[Σ(L_i-1)] compact node of positions ``0..L_i-2``: the row predicting position t+1."""
        return self._pred_positions()[3]


    def pred_seq_ids(self) -> torch.Tensor:
        """[Σ(L_i-1)] sequence id of every prediction position."""
        return self._pred_positions()[1]

    def sequence(self, i: int) -> torch.Tensor:
        """[L_i] tokens of sequence ``i`` rebuilt from the forest."""
        return self.tokens[self.index[self.seq_offsets[i]:self.seq_offsets[i + 1]]]

    def num_children(self) -> torch.Tensor:
        """[T] children per node."""
        p = self.parent[self.parent >= 0]
        return torch.bincount(p, minlength=self.num_nodes)

    def padded(self, multiple: int) -> Forest:
        """Append padding roots so that T is a multiple of ``multiple`` (kernel alignment)."""
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        t = self.num_nodes
        extra = (-t) % multiple
        if extra == 0:
            return self
        s = int(self.seg_parent.numel())
        if self.host is not None:  # on the host, then one upload: no device work, no synchronization
            h = self.host
            ar, z = np.arange(t, t + extra), np.zeros(extra, dtype=np.int64)
            new = dict(tokens=np.concatenate([h["tokens"], z]), parent=np.concatenate([h["parent"], z - 1]),
                       depth=np.concatenate([h["depth"], z]), last=np.concatenate([h["last"], ar]),
                       multiplicity=np.concatenate([h["multiplicity"], z]),
                       seg_offsets=np.concatenate([h["seg_offsets"], ar + 1]),
                       seg_parent=np.concatenate([h["seg_parent"], z - 1]),
                       node_seg=np.concatenate([h["node_seg"], np.arange(s, s + extra)]))
            dev = dict(zip(new, upload(list(new.values()), self.tokens.device)))
            return Forest(**dev, index=self.index, seq_offsets=self.seq_offsets, num_pad=self.num_pad + extra,
                          host={**h, **new})
        dev = self.tokens.device
        ar = torch.arange(t, t + extra, device=dev)
        z = torch.zeros(extra, dtype=torch.int64, device=dev)
        return Forest(
            tokens=torch.cat([self.tokens, z]), parent=torch.cat([self.parent, z - 1]),
            depth=torch.cat([self.depth, z]), last=torch.cat([self.last, ar]),
            multiplicity=torch.cat([self.multiplicity, z]),
            seg_offsets=torch.cat([self.seg_offsets, ar + 1]), seg_parent=torch.cat([self.seg_parent, z - 1]),
            node_seg=torch.cat([self.node_seg, torch.arange(s, s + extra, device=dev)]),
            index=self.index, seq_offsets=self.seq_offsets, num_pad=self.num_pad + extra,
        )

    def shift_depth(self, offset: int) -> Forest:
        """The same forest with every depth (RoPE position) increased by ``offset``: the rows below
        a prefix of ``offset`` tokens held elsewhere (:mod:`harts.prefix`)."""
        host = None if self.host is None else {**self.host, "depth": self.host["depth"] + offset}
        return dataclasses.replace(self, depth=self.depth + offset, host=host)

    def to(self, device) -> Forest:
        """Copy every tensor to ``device`` (one non-blocking transfer when host copies exist)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # not the private caches
        if self.host is not None:
            names = [k for k, v in fields.items() if isinstance(v, torch.Tensor)]
            moved = dict(zip(names, upload([self.host[k] for k in names], device)))
            return dataclasses.replace(self, **moved)
        return Forest(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})


def lexicographic_order(arrs: list[np.ndarray]) -> list[int]:
    """Indices sorting non-negative int64 sequences lexicographically (a prefix sorts first).

    Big-endian bytes compare like the integer sequences, so the sort runs on ``memcmp``.
    """
    keys = [a.astype(">i8").tobytes() for a in arrs]
    return sorted(range(len(arrs)), key=keys.__getitem__)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    if m == 0:
        return 0
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


def _finish(tokens: np.ndarray, parent: np.ndarray, depth: np.ndarray, paths: list[np.ndarray],
            device) -> Forest:
    """Segments, ``last`` and multiplicity from parent/depth in pre-order."""
    t = tokens.size
    ar = np.arange(t)
    nchild = np.bincount(parent[parent >= 0], minlength=t)
    pp = np.where(parent >= 0, parent, 0)
    seg_start = (parent < 0) | (parent != ar - 1) | (nchild[pp] > 1)
    node_seg = np.cumsum(seg_start) - 1
    starts = np.flatnonzero(seg_start)
    seg_offsets = np.append(starts, t)
    seg_parent = np.where(parent[starts] >= 0, node_seg[pp[starts]], -1)
    # subtree size per segment: own length + child segments (children follow parents in pre-order)
    total = np.diff(seg_offsets).astype(np.int64)
    for s in range(starts.size - 1, -1, -1):
        ps = seg_parent[s]
        if ps >= 0:
            total[ps] += total[s]
    last = np.repeat(starts + total - 1, np.diff(seg_offsets))
    index = np.concatenate(paths)
    seq_offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    seq_offsets[1:] = np.cumsum([p.size for p in paths])
    mult = np.bincount(index, minlength=t)

    host = {k: np.ascontiguousarray(v, dtype=np.int64) for k, v in dict(
        tokens=tokens, parent=parent, depth=depth, last=last, multiplicity=mult, seg_offsets=seg_offsets,
        seg_parent=seg_parent, node_seg=node_seg, index=index, seq_offsets=seq_offsets).items()}
    return Forest(**dict(zip(host, upload(list(host.values()), device))), host=host)


def build_forest(seqs: Sequence, *, vocab_size: int | None = None, device=None) -> Forest:
    """Prefix forest of ``seqs`` (each a non-empty 1-D sequence of token ids).

    Sort + LCP, O(ΣL log N) comparisons plus O(ΣL) copies. Roots are ordered by token id, so
    two sequences with different first tokens form two trees of one forest (fork at position 0).
    Raises :class:`EmptySequenceError` and :class:`TokenOutOfRangeError` (with ``vocab_size``).
    """
    arrs = as_token_lists(seqs, vocab_size=vocab_size)
    order = lexicographic_order(arrs)
    tok_parts, par_parts, dep_parts = [], [], []
    paths: list[np.ndarray | None] = [None] * len(arrs)
    prev: np.ndarray | None = None
    prev_path = np.zeros(0, dtype=np.int64)
    cursor = 0
    for i in order:
        a = arrs[i]
        lcp = _lcp(prev, a) if prev is not None else 0
        new = a.size - lcp
        ids = np.arange(cursor, cursor + new, dtype=np.int64)
        path = np.concatenate([prev_path[:lcp], ids])
        if new:
            tok_parts.append(a[lcp:])
            dep_parts.append(np.arange(lcp, a.size, dtype=np.int64))
            par = path[lcp - 1:a.size - 1].copy() if lcp > 0 else np.concatenate([[-1], path[:a.size - 1]])
            par_parts.append(par)
        cursor += new
        paths[i] = path
        prev, prev_path = a, path
    tokens = np.concatenate(tok_parts)
    return _finish(tokens, np.concatenate(par_parts), np.concatenate(dep_parts), paths, device)


def build_chain_forest(seqs: Sequence, *, vocab_size: int | None = None, device=None) -> Forest:
    """Forest without sharing: each sequence is its own chain, in input order.

    This is plain THD sequence packing expressed as a forest (``last`` = end of each sequence,
    i.e. block-diagonal causal attention); used for the fallback and as the benchmark baseline.
    """
    arrs = as_token_lists(seqs, vocab_size=vocab_size)
    lens = np.array([a.size for a in arrs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    t = int(lens.sum())
    ar = np.arange(t, dtype=np.int64)
    seq_start = np.repeat(starts, lens)
    depth = ar - seq_start
    parent = np.where(depth > 0, ar - 1, -1)
    paths = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lens)]
    return _finish(np.concatenate(arrs), parent, depth, paths, device)
