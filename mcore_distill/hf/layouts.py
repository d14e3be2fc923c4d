"""Tensor layouts between Megatron-Core and Hugging Face Qwen3-family checkpoints (pure torch).

Every layout converts one Megatron parameter to its HF tensor(s) and back, and knows how
Megatron shards it under tensor parallelism:

* ``to_hf(t, d)``: the whole (TP-merged) Megatron tensor → the HF tensors (views where possible).
* ``from_hf(srcs, d, rank=r, size=n, rows=)``: the HF sources → TP rank r's local Megatron shard.
  ``srcs`` are anything sliceable with ``src[a:b]`` / ``src[:, a:b]``: tensors, or safetensors
  ``get_slice`` handles, so a rank reads only the rows and columns it holds.
* ``merge(shards, d)``: the per-rank shards (rank order) → the whole Megatron tensor.

``d`` is a :class:`Dims` (the model's sizes). Layouts:

* ``linear_qkv`` [G·(Q/G + 2)·D, H] is grouped per KV head: for each group g the Q/G query
  heads, then one key head, then one value head; HF keeps ``q_proj`` [Q·D, H], ``k_proj`` and
  ``v_proj`` [G·D, H]. TP rank r holds groups [r·G/n, (r+1)·G/n): rows block r of each HF tensor.
* Gated attention (Qwen3-Next/3.5, ``attention_output_gate``): per group ``[q; gate; k; v]``;
  HF ``q_proj`` [Q·2D, H] holds ``[q_h; gate_h]`` per head.
* ``linear_fc1`` [2F, H] = [gate; up]; TP rank r holds [gate_r; up_r].
* GDN ``in_proj`` = ``[q; k; v; z; β; α]`` (head order); HF Qwen3-Next groups it per key head
  (``in_proj_qkvz`` [q_g; k_g; v_g; z_g], ``in_proj_ba`` [β_g; α_g]), Qwen3.5 splits it
  (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). TP rank r holds each section's
  block r, stacked: ``[q_r; k_r; v_r; z_r; β_r; α_r]`` (``conv1d``: ``[q_r; k_r; v_r]``).
* Norms: HF Qwen3-Next/3.5 decoder and q/k norms are zero-centred (``x·(1 + w)``), everything
  else (and Megatron without ``layernorm_zero_centered_gamma``) stores γ; the shift is ±1.
* Vocabulary rows: Megatron pads the vocabulary; HF holds the first V rows. Padded rows load
  as zeros and are dropped on the way to HF.

Tensors that ``to_hf`` must create (strided q/k/v parts, regroupings, norm shifts, casts) are
fresh, or written into an ``arena`` (anything with ``take_for(like, shape, dtype, name=)`` and
``wrote(op, *reads)``, e.g. :class:`colocate.convert.ConversionArena`) so that every output is a
view of the input's storage or of the arena's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from mcore_distill.hf.errors import ConversionError

__all__ = [
    "Dims",
    "Arena",
    "Layout",
    "split_qkv",
    "merge_qkv",
    "split_qkv_gated",
    "merge_qkv_gated",
    "hf_gated_q_proj",
    "gdn_in_proj_to_hf",
    "gdn_in_proj_from_hf",
    "gdn_in_proj_split",
    "merge_tp_sections",
    "gdn_sections",
    "ROUTER_DTYPES",
    "REPLICATED",
    "COL",
    "ROW",
    "VOCAB",
    "NORM",
    "CENTERED_NORM",
    "QKV",
    "GATED_QKV",
    "GLU",
    "GDN_IN_PROJ",
    "GDN_CONV",
    "ROUTER",
    "FP32",
]

ROUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Dims:
    """The sizes the layouts need (symbols of the shape expressions in the mapping tables)."""

    L: int
    """Layers."""
    H: int
    """Hidden size."""
    Q: int
    """Query heads."""
    G: int
    """KV heads (query groups)."""
    D: int
    """Head dim."""
    F: int
    """Dense MLP intermediate size."""
    V: int
    """HF vocabulary rows."""
    E: int = 0
    """Routed experts (0: dense)."""
    Fe: int = 0
    """Expert intermediate size."""
    Fs: int = 0
    """Shared-expert intermediate size (0: none)."""
    Nk: int = 0
    """GDN key heads."""
    Nv: int = 0
    """GDN value heads."""
    Dk: int = 0
    """GDN key head dim."""
    Dv: int = 0
    """GDN value head dim."""
    W: int = 0
    """GDN convolution width."""
    layer_types: tuple[str, ...] | None = None
    """Hybrids: ``linear_attention`` / ``full_attention`` per layer; None: all attention."""
    tied: bool = False
    """LM head tied to the embedding."""
    zero_centered: bool = False
    """Megatron norms store γ − 1 (``layernorm_zero_centered_gamma``)."""
    router_dtype: str | None = None
    """Publication only: dtype the router is sent in (None: unchanged)."""
    expert_bias: bool = False
    """The router carries an aux-loss-free ``expert_bias``."""
    gdn_layout: str = "qwen3_next"
    """HF layout of the GDN input projection: ``qwen3_next`` or ``qwen3_5``."""
    qkv_bias: bool = False
    """q/k/v projections carry biases."""

    @classmethod
    def of(cls, spec: Any) -> Dims:
        """Dims of a model description with the usual field names (``num_layers``,
        ``hidden_size``, ``num_attention_heads``, … as in :class:`mcore_distill.hf.HFArch` and
        :class:`colocate.HFModelSpec`); ``serve_vocab_size`` wins over ``vocab_size``."""
        g = partial(getattr, spec)
        types = g("layer_types", None)
        return cls(
            L=spec.num_layers, H=spec.hidden_size, Q=spec.num_attention_heads, G=spec.num_query_groups,
            D=spec.head_dim, F=spec.ffn_hidden_size, V=g("serve_vocab_size", None) or spec.vocab_size,
            E=g("num_experts", None) or 0, Fe=g("moe_ffn_hidden_size", None) or 0,
            Fs=g("shared_expert_ffn_hidden_size", None) or 0, Nk=g("linear_num_key_heads", 0),
            Nv=g("linear_num_value_heads", 0), Dk=g("linear_key_head_dim", 0), Dv=g("linear_value_head_dim", 0),
            W=g("linear_conv_kernel_dim", 0), layer_types=tuple(types) if types else None,
            tied=bool(g("tie_embeddings", False)), zero_centered=bool(g("megatron_zero_centered_gamma", False)),
            router_dtype=g("router_dtype", None), expert_bias=bool(g("has_expert_bias", False)),
            gdn_layout=g("gdn_layout", "qwen3_next"), qkv_bias=bool(g("attention_bias", False)))


class Arena(Protocol):
    """Where ``to_hf`` writes the tensors it must create (see the module docstring)."""

    def take_for(self, like: torch.Tensor, shape, dtype: torch.dtype, *, name: str) -> torch.Tensor: ...

    def wrote(self, op, *reads: torch.Tensor) -> None: ...


# ----- creating tensors, fresh or in an arena ---------------------------------------------------
def _materialize(src: torch.Tensor, shape, arena: Arena | None, name: str) -> torch.Tensor:
    """``src.reshape(shape)``; where that would copy (``src`` not contiguous) and an arena is
    given, the copy goes into the arena instead of a fresh allocation."""
    if arena is None or src.is_contiguous():
        return src.reshape(shape)
    out = arena.take_for(src, src.shape, src.dtype, name=name)
    out.copy_(src)
    arena.wrote(partial(out.copy_, src), src)
    return out.view(shape)


def _cast(t: torch.Tensor, dtype: torch.dtype, arena: Arena | None, name: str) -> torch.Tensor:
    """``t.to(dtype)`` (``t`` itself when the dtype already matches), into the arena if given."""
    if arena is None or t.dtype == dtype:
        return t.to(dtype)
    out = arena.take_for(t, t.shape, dtype, name=name)
    out.copy_(t)
    arena.wrote(partial(out.copy_, t), t)
    return out


def _shifted(t: torch.Tensor, delta: int, arena: Arena | None, name: str) -> torch.Tensor:
    """``t + delta`` (a new tensor; ``t`` itself for 0), written into ``arena`` if given."""
    if delta == 0:
        return t
    if arena is None:
        return t + delta
    out = arena.take_for(t, t.shape, t.dtype, name=name)
    torch.add(t, delta, out=out)
    arena.wrote(partial(torch.add, t, delta, out=out), t)
    return out


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def _stack_groups(parts: list[torch.Tensor], arena: Arena | None, name: str, dim: int = 1) -> torch.Tensor:
    """``torch.cat(parts, dim).reshape(-1, *tail)`` for parts [*lead, w_i, *tail] (``lead`` has
    ``dim`` dims); with an arena the parts are copied into an arena view of the result instead."""
    if arena is None:
        return torch.cat(parts, dim=dim).reshape(-1, *parts[0].shape[dim + 1:])
    lead, tail = parts[0].shape[:dim], parts[0].shape[dim + 1:]
    width = sum(p.shape[dim] for p in parts)
    out = arena.take_for(parts[0], (math.prod(lead) * width, *tail), parts[0].dtype, name=name)
    grouped, o = out.view(*lead, width, *tail), 0
    dsts = []
    for p in parts:
        dsts.append(grouped.narrow(dim, o, p.shape[dim]))
        o += p.shape[dim]
    _copy_all(dsts, parts)
    arena.wrote(partial(_copy_all, dsts, parts), *parts)
    return out


# ----- the layout functions ----------------------------------------------------------------------
def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int,
              arena: Arena | None = None, names: tuple[str, str, str] = ("q", "k", "v")
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's grouped ``linear_qkv`` weight [G·(Q/G+2)·D, H] (or bias [G·(Q/G+2)·D])
    into q [Q·D, ...], k [G·D, ...], v [G·D, ...]. With G > 1 the parts are strided, so each is
    a copy: fresh, or in ``arena`` (``names`` label them in its errors); with G = 1 they are views."""
    per = num_heads // num_groups
    rows = num_groups * (per + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ConversionError(f"linear_qkv has {qkv.shape[0]} rows, expected G·(Q/G+2)·D = {rows} "
                              f"(Q={num_heads}, G={num_groups}, D={head_dim})")
    tail = qkv.shape[1:]
    g = qkv.reshape(num_groups, (per + 2) * head_dim, *tail)
    q = _materialize(g[:, : per * head_dim], (num_heads * head_dim, *tail), arena, names[0])
    k = _materialize(g[:, per * head_dim: (per + 1) * head_dim], (num_groups * head_dim, *tail), arena, names[1])
    v = _materialize(g[:, (per + 1) * head_dim:], (num_groups * head_dim, *tail), arena, names[2])
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_groups: int,
              head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: HF q/k/v → Megatron grouped ``linear_qkv``."""
    per = num_heads // num_groups
    tail = q.shape[1:]
    parts = (q.reshape(num_groups, per * head_dim, *tail), k.reshape(num_groups, head_dim, *tail),
             v.reshape(num_groups, head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _check_gated_rows(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> None:
    rows = num_groups * (2 * (num_heads // num_groups) + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ConversionError(f"gated linear_qkv has {qkv.shape[0]} rows, expected G·(2Q/G+2)·D = {rows} "
                              f"(Q={num_heads}, G={num_groups}, D={head_dim})")


def split_qkv_gated(qkv: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's gated ``linear_qkv`` (``attention_output_gate``) [G·(2Q/G+2)·D, H], per KV
    group ``[q (Q/G·D); gate (Q/G·D); k (D); v (D)]``, into q, gate [Q·D, H] and k, v [G·D, H]."""
    _check_gated_rows(qkv, num_heads, num_groups, head_dim)
    per = num_heads // num_groups
    tail = qkv.shape[1:]
    g = qkv.reshape(num_groups, (2 * per + 2) * head_dim, *tail)
    s = per * head_dim
    q = g[:, :s].reshape(num_heads * head_dim, *tail)
    gate = g[:, s:2 * s].reshape(num_heads * head_dim, *tail)
    k = g[:, 2 * s:2 * s + head_dim].reshape(num_groups * head_dim, *tail)
    v = g[:, 2 * s + head_dim:].reshape(num_groups * head_dim, *tail)
    return q, gate, k, v


def hf_gated_q_proj(q: torch.Tensor, gate: torch.Tensor, *, num_heads: int, head_dim: int) -> torch.Tensor:
    """HF Qwen3-Next ``q_proj`` [Q·2D, H]: per head ``[q_h (D); gate_h (D)]``."""
    tail = q.shape[1:]
    return torch.cat([q.reshape(num_heads, head_dim, *tail), gate.reshape(num_heads, head_dim, *tail)],
                     dim=1).reshape(2 * num_heads * head_dim, *tail)


def merge_qkv_gated(q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_groups: int,
                    head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv_gated` + :func:`hf_gated_q_proj`: HF ``q_proj`` (per head
    ``[q_h; gate_h]``), ``k_proj``, ``v_proj`` → Megatron gated ``linear_qkv``."""
    per, tail = num_heads // num_groups, q_proj.shape[1:]
    qg = q_proj.reshape(num_groups, per, 2, head_dim, *tail)
    parts = (qg[:, :, 0].reshape(num_groups, per * head_dim, *tail), qg[:, :, 1].reshape(num_groups, per * head_dim, *tail),
             k.reshape(num_groups, head_dim, *tail), v.reshape(num_groups, head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _gdn_rows(w: torch.Tensor, nk: int, nv: int, dk: int, dv: int) -> None:
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    if w.shape[0] != rows:
        raise ConversionError(f"GDN in_proj has {w.shape[0]} rows, expected 2·Nk·Dk + 2·Nv·Dv + 2·Nv = {rows} "
                              f"(Nk={nk}, Nv={nv}, Dk={dk}, Dv={dv})")


def gdn_in_proj_to_hf(w: torch.Tensor, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, arena: Arena | None = None,
                      names: tuple[str, str] = ("in_proj_qkvz", "in_proj_ba")) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron GDN ``in_proj`` [2·Nk·Dk + 2·Nv·Dv + 2·Nv, H] = ``[q; k; v; z; β; α]`` (each in head
    order) → HF ``in_proj_qkvz`` [2·Nk·Dk + 2·Nv·Dv, H] and ``in_proj_ba`` [2·Nv, H], both grouped
    per key head g (r = Nv/Nk value heads per group): ``[q_g; k_g; v_g (r·Dv); z_g (r·Dv)]`` and
    ``[β_g (r); α_g (r)]``. Both are new tensors: fresh, or in ``arena``."""
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    _gdn_rows(w, nk, nv, dk, dv)
    r, tail = nv // nk, w.shape[1:]
    q, k, v, z, b, a = torch.split(w, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], dim=0)
    qkvz = _stack_groups([q.reshape(nk, dk, *tail), k.reshape(nk, dk, *tail), v.reshape(nk, r * dv, *tail),
                          z.reshape(nk, r * dv, *tail)], arena, names[0])
    ba = _stack_groups([b.reshape(nk, r, *tail), a.reshape(nk, r, *tail)], arena, names[1])
    return qkvz, ba


def gdn_in_proj_from_hf(qkvz: torch.Tensor, ba: torch.Tensor, *, num_key_heads: int, num_value_heads: int,
                        key_head_dim: int, value_head_dim: int) -> torch.Tensor:
    """Inverse of :func:`gdn_in_proj_to_hf`: HF ``in_proj_qkvz``, ``in_proj_ba`` → Megatron
    ``in_proj`` ``[q; k; v; z; β; α]``."""
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    r, tail = nv // nk, qkvz.shape[1:]
    g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, *tail)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba.reshape(nk, 2 * r, *tail), [r, r], dim=1)
    return torch.cat([x.reshape(-1, *tail) for x in (q, k, v, z, b, a)], dim=0)


def gdn_in_proj_split(w: torch.Tensor, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron GDN ``in_proj`` ``[q; k; v; z; β; α]`` → HF Qwen3.5 ``in_proj_qkv`` [2·Nk·Dk + Nv·Dv, H],
    ``in_proj_z`` [Nv·Dv, H], ``in_proj_b`` [Nv, H], ``in_proj_a`` [Nv, H] (views, head order kept)."""
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    _gdn_rows(w, nk, nv, dk, dv)
    qkv, z, b, a = torch.split(w, [2 * nk * dk + nv * dv, nv * dv, nv, nv], dim=0)
    return qkv, z, b, a


def merge_tp_sections(shards: list[torch.Tensor], sections: list[int]) -> torch.Tensor:
    """Merge column-parallel shards whose rows are several tensors stacked (``sections``: the
    per-shard row counts, e.g. the GDN ``in_proj`` ``[q_r; k_r; v_r; z_r; β_r; α_r]`` or
    ``conv1d`` ``[q_r; k_r; v_r]``): section i of every rank in rank order, then section i+1."""
    if any(s.shape[0] != sum(sections) for s in shards):
        raise ConversionError(f"merge_tp_sections: shard rows {[s.shape[0] for s in shards]} != sum({sections})")
    parts = [torch.split(s, sections, dim=0) for s in shards]
    return torch.cat([p[i] for i in range(len(sections)) for p in parts], dim=0)


def gdn_sections(d: Dims, tp: int, *, which: str) -> list[int]:
    """Per-TP-rank row sections of the GDN ``in_proj`` (``which="in_proj"``) or ``conv1d``."""
    qk, v, nv = d.Nk * d.Dk // tp, d.Nv * d.Dv // tp, d.Nv // tp
    if which == "in_proj":
        return [qk, qk, v, v, nv, nv]
    if which == "conv1d":
        return [qk, qk, v]
    raise ConversionError(f"gdn_tp_sections: which must be 'in_proj' or 'conv1d', got {which!r}")


# ----- reading TP shards from HF sources ---------------------------------------------------------
def _shape(src: Any) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def _block(src: Any, rank: int, size: int, *, dim: int = 0, start: int = 0, length: int | None = None,
           what: str = "tensor") -> torch.Tensor:
    """Rows (``dim=0``) or columns (``dim=1``) block ``rank`` of ``size`` of ``src[start:start+length]``;
    reads only that block from a safetensors slice."""
    n = _shape(src)[dim] - start if length is None else length
    if n % size:
        raise ConversionError(f"{what}: {n} {'rows' if dim == 0 else 'columns'} do not split into "
                              f"{size} tensor-parallel shards")
    a = start + rank * (n // size)
    b = a + n // size
    if size == 1 and start == 0 and length is None:
        return src[:]
    return src[a:b] if dim == 0 else src[:, a:b]


class Layout:
    """One Megatron ↔ HF tensor layout (see the module docstring); stateless."""

    tp = "replicated"
    """How Megatron shards the parameter: ``replicated``, ``col`` (dim 0) or ``row`` (dim 1)."""

    def to_hf(self, t: torch.Tensor, d: Dims, *, arena: Arena | None = None, names: tuple[str, ...] = ()
              ) -> tuple[torch.Tensor, ...]:
        return (t,)

    def from_hf(self, srcs: list[Any], d: Dims, *, rank: int = 0, size: int = 1, rows: int | None = None
                ) -> torch.Tensor:
        if self.tp == "replicated":
            return srcs[0][:]
        return _block(srcs[0], rank, size, dim=0 if self.tp == "col" else 1)

    def merge(self, shards: list[torch.Tensor], d: Dims) -> torch.Tensor:
        if self.tp == "replicated" or len(shards) == 1:
            return shards[0]
        return torch.cat(shards, dim=0 if self.tp == "col" else 1)

    def creates(self, d: Dims, k: int, *, cast: bool) -> bool:
        """Whether output ``k`` of :meth:`to_hf` is a new tensor (arena sizing); ``cast``: the
        HF dtype differs from the training dtype."""
        return False

    def hf_dtype(self, d: Dims, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`to_hf` produces for a model trained in ``dtype``."""
        return dtype

    def __repr__(self) -> str:
        return type(self).__name__


class _Direct(Layout):
    def __init__(self, tp: str):
        self.tp = tp

    def __repr__(self) -> str:
        return f"Direct({self.tp})"


class _Vocab(Layout):
    """Embedding / LM head rows: HF holds V rows, Megatron a padded count split in TP blocks."""

    tp = "col"

    def to_hf(self, t, d, *, arena=None, names=()):
        return (t[:d.V],)

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        src = srcs[0]
        total, width = _shape(src)
        if rows is None:
            if total % size:
                raise ConversionError(f"vocabulary: {total} rows do not split into {size} tensor-parallel shards")
            rows = total // size
        start, stop = rank * rows, min((rank + 1) * rows, total)
        got = src[start:stop] if stop > start else torch.empty(0, width)
        if got.shape[0] == rows:
            return got
        pad = torch.zeros(rows - got.shape[0], width, dtype=got.dtype, device=got.device)
        return torch.cat([got, pad]) if got.shape[0] else pad


class _Norm(Layout):
    """A norm weight; ``centered``: HF stores γ − 1 (``x·(1 + w)``), else γ. The shift to HF is
    −1 / +1 / 0 depending on which side is zero-centred."""

    def __init__(self, centered: bool):
        self.centered = centered

    def delta(self, d: Dims) -> int:
        return int(d.zero_centered) - int(self.centered)

    def to_hf(self, t, d, *, arena=None, names=("norm",)):
        return (_shifted(t, self.delta(d), arena, names[0] if names else "norm"),)

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        t = srcs[0][:]
        return t - self.delta(d) if self.delta(d) else t

    def creates(self, d, k, *, cast):
        return self.delta(d) != 0

    def __repr__(self) -> str:
        return "CenteredNorm" if self.centered else "Norm"


class _QKV(Layout):
    tp = "col"

    def to_hf(self, t, d, *, arena=None, names=("q", "k", "v")):
        return split_qkv(t, num_heads=d.Q, num_groups=d.G, head_dim=d.D, arena=arena, names=tuple(names) or ("q", "k", "v"))

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        if d.G % size:
            raise ConversionError(f"linear_qkv: {d.G} KV heads do not split into {size} tensor-parallel shards")
        q, k, v = (_block(s, rank, size, what=w) for s, w in zip(srcs, ("q_proj", "k_proj", "v_proj")))
        return merge_qkv(q, k, v, num_heads=d.Q // size, num_groups=d.G // size, head_dim=d.D)

    def creates(self, d, k, *, cast):
        return d.G > 1


class _GatedQKV(Layout):
    tp = "col"

    def to_hf(self, t, d, *, arena=None, names=("q", "k", "v")):
        Q, G, D = d.Q, d.G, d.D
        if arena is None:
            q, gate, k, v = split_qkv_gated(t, num_heads=Q, num_groups=G, head_dim=D)
            return hf_gated_q_proj(q, gate, num_heads=Q, head_dim=D), k, v
        _check_gated_rows(t, Q, G, D)  # q and gate go straight into the arena's q_proj (one copy)
        per, tail = Q // G, t.shape[1:]
        s = per * D
        g = t.reshape(G, (2 * per + 2) * D, *tail)
        qp = _stack_groups([g[:, :s].view(G, per, D, *tail), g[:, s:2 * s].view(G, per, D, *tail)], arena, names[0],
                           dim=2)
        k = _materialize(g[:, 2 * s:2 * s + D], (G * D, *tail), arena, names[1])
        v = _materialize(g[:, 2 * s + D:], (G * D, *tail), arena, names[2])
        return qp, k, v

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        if d.G % size:
            raise ConversionError(f"linear_qkv: {d.G} KV heads do not split into {size} tensor-parallel shards")
        qp, k, v = (_block(s, rank, size, what=w) for s, w in zip(srcs, ("q_proj", "k_proj", "v_proj")))
        return merge_qkv_gated(qp, k, v, num_heads=d.Q // size, num_groups=d.G // size, head_dim=d.D)

    def creates(self, d, k, *, cast):
        return k == 0 or d.G > 1  # the gated q_proj interleaves q and gate: always new


class _GLU(Layout):
    tp = "col"

    def to_hf(self, t, d, *, arena=None, names=()):
        return tuple(t.chunk(2, dim=0))

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        return torch.cat([_block(s, rank, size, what=w) for s, w in zip(srcs, ("gate_proj", "up_proj"))])

    def merge(self, shards, d):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


class _GdnInProj(Layout):
    """GDN ``in_proj``: Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``) or Qwen3.5 (``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), chosen by ``Dims.gdn_layout``."""

    tp = "col"

    def to_hf(self, t, d, *, arena=None, names=("in_proj_qkvz", "in_proj_ba")):
        kw = dict(num_key_heads=d.Nk, num_value_heads=d.Nv, key_head_dim=d.Dk, value_head_dim=d.Dv)
        if d.gdn_layout == "qwen3_5":
            return gdn_in_proj_split(t, **kw)
        return gdn_in_proj_to_hf(t, **kw, arena=arena, names=tuple(names) or ("in_proj_qkvz", "in_proj_ba"))

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        if d.Nk % size or d.Nv % size:
            raise ConversionError(f"GDN in_proj: {d.Nk} key / {d.Nv} value heads do not split into {size} "
                                  "tensor-parallel shards")
        if d.gdn_layout == "qwen3_5":
            qkv, z, b, a = srcs
            qk, v = d.Nk * d.Dk, d.Nv * d.Dv
            q_ = _block(qkv, rank, size, start=0, length=qk, what="in_proj_qkv")
            k_ = _block(qkv, rank, size, start=qk, length=qk, what="in_proj_qkv")
            v_ = _block(qkv, rank, size, start=2 * qk, length=v, what="in_proj_qkv")
            return torch.cat([q_, k_, v_] + [_block(s, rank, size) for s in (z, b, a)])
        qkvz, ba = (_block(s, rank, size, what=w) for s, w in zip(srcs, ("in_proj_qkvz", "in_proj_ba")))
        return gdn_in_proj_from_hf(qkvz, ba, num_key_heads=d.Nk // size, num_value_heads=d.Nv // size,
                                   key_head_dim=d.Dk, value_head_dim=d.Dv)

    def merge(self, shards, d):
        return shards[0] if len(shards) == 1 else merge_tp_sections(shards, gdn_sections(d, len(shards),
                                                                                         which="in_proj"))

    def creates(self, d, k, *, cast):
        return d.gdn_layout != "qwen3_5"


class _GdnConv(Layout):
    """GDN ``conv1d`` [2·Nk·Dk + Nv·Dv, 1, W]: channels ``[q; k; v]``, sharded section by section."""

    tp = "col"

    def from_hf(self, srcs, d, *, rank=0, size=1, rows=None):
        qk, v = d.Nk * d.Dk, d.Nv * d.Dv
        return torch.cat([_block(srcs[0], rank, size, start=s, length=n, what="conv1d")
                          for s, n in ((0, qk), (qk, qk), (2 * qk, v))])

    def merge(self, shards, d):
        return shards[0] if len(shards) == 1 else merge_tp_sections(shards, gdn_sections(d, len(shards),
                                                                                         which="conv1d"))


class _Router(Layout):
    """MoE router [E, H], replicated; published in ``Dims.router_dtype`` when set."""

    def to_hf(self, t, d, *, arena=None, names=("router",)):
        if d.router_dtype is None:
            return (t,)
        return (_cast(t, ROUTER_DTYPES[d.router_dtype], arena, names[0] if names else "router"),)

    def creates(self, d, k, *, cast):
        return cast

    def hf_dtype(self, d, dtype):
        return dtype if d.router_dtype is None else ROUTER_DTYPES[d.router_dtype]


class _Fp32(Layout):
    """Kept in fp32 on the HF side (the router's ``e_score_correction_bias``)."""

    def to_hf(self, t, d, *, arena=None, names=("bias",)):
        return (_cast(t, torch.float32, arena, names[0] if names else "bias"),)

    def creates(self, d, k, *, cast):
        return True  # counted even when the input is fp32 already: an upper bound of a few KiB

    def hf_dtype(self, d, dtype):
        return torch.float32


REPLICATED = _Direct("replicated")
COL = _Direct("col")
ROW = _Direct("row")
VOCAB = _Vocab()
NORM = _Norm(centered=False)
CENTERED_NORM = _Norm(centered=True)
QKV = _QKV()
GATED_QKV = _GatedQKV()
GLU = _GLU()
GDN_IN_PROJ = _GdnInProj()
GDN_CONV = _GdnConv()
ROUTER = _Router()
FP32 = _Fp32()
