"""Megatron-Core → HF (Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5) for publication, as pure tensor functions.

Input names are *global* Megatron names: layer ids counted over the whole model (all pipeline
stages) and expert ids counted over all expert-parallel ranks (see :func:`globalize_name`);
tensors are whole (TP shards already merged by :func:`merge_tp_shards`). Output names are the
HF checkpoint names that ``transformers`` and SGLang's ``load_weights`` take.

The names and layouts are not defined here: :func:`megatron_to_hf` and :func:`hf_param_specs`
read the per-architecture tables of :mod:`mcore_distill.hf.mapping` (the same tables the HF
checkpoint loader and saver use), and the layout functions (:func:`split_qkv`,
:func:`gdn_in_proj_to_hf`, …) are :mod:`mcore_distill.hf.layouts`'s, re-exported. In short:

* ``linear_qkv`` [G·(Q/G + 2)·D, H] is grouped per KV head and splits by GQA groups into
  ``q_proj``/``k_proj``/``v_proj`` — never into equal thirds; ``linear_fc1`` = [gate; up].
* Router ``mlp.router.weight`` → ``mlp.gate.weight`` (cast to ``router_dtype``);
  ``expert_bias`` → ``mlp.gate.e_score_correction_bias`` in fp32.
* Local and TE-fused norm names both map to the HF norms; tied embeddings send no ``lm_head``;
  with ``serve_vocab_size`` only the first rows of embedding / LM head are sent.
* Hybrids (:class:`Qwen3HybridSpec`): the GDN ``in_proj`` regrouped per key head (Qwen3-Next) or
  split (Qwen3.5), gated-attention ``q_proj`` with ``[q_h; gate_h]`` per head, zero-centred HF
  norms; under TP the GDN ``in_proj``/``conv1d`` shards merge with :func:`merge_tp_sections`.

Copies: most outputs are views of the input (norms, ``o_proj``/``down_proj``, gate/up halves,
embeddings). The GQA q/k/v split, the hybrid's gated ``q_proj``/GDN regrouping, the hybrid's
norm shifts and dtype casts must create tensors. By default each is a fresh allocation; with a
:class:`ConversionArena` (``arena=``) they are written into one persistent buffer instead, so
every output is a view of either the input's storage or the arena's, and a publisher can hand
both storages over in place (no packing copy, and with a fixed arena no new IPC handle).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from colocate.buckets import align, nbytes
from colocate.config import ConfigError, HFModelSpec
from colocate.errors import ArenaCapacityError, ParamMismatchError
from mcore_distill.hf.errors import ConversionError
from mcore_distill.hf.layouts import (
    COL,
    GLU,
    REPLICATED,
    ROUTER_DTYPES,
    ROW,
    Dims,
    gdn_in_proj_split,
    gdn_in_proj_to_hf,
    gdn_sections,
    hf_gated_q_proj,
    merge_qkv,
    merge_tp_sections,
    split_qkv,
    split_qkv_gated,
)
from mcore_distill.hf.mapping import globalize_name, table_for

__all__ = [
    "ConversionError",
    "ConversionArena",
    "ArenaCapacityError",
    "arena_nbytes",
    "ParamMismatchError",
    "split_qkv",
    "merge_qkv",
    "merge_tp_shards",
    "globalize_name",
    "megatron_to_hf",
    "hf_param_specs",
    "check_params",
    "ROUTER_DTYPES",
    "Qwen3HybridSpec",
    "split_qkv_gated",
    "hf_gated_q_proj",
    "gdn_in_proj_to_hf",
    "gdn_in_proj_split",
    "merge_tp_sections",
    "merge_named_tp_shards",
    "gdn_tp_sections",
]


class ConversionArena:
    """One persistent ``uint8`` buffer that the converter writes the tensors it must create into.

    Why: without it, the q/k/v split (and the hybrid's regroupings, norm shifts and casts)
    allocates fresh tensors on every conversion pass; a publisher then copies them again into
    staging buckets, and the receiver copies them a third time. With an arena every converter
    output is a view of either the trainer's storage or this buffer, both of which the publisher
    can share in place; since the buffer never changes, ``keep_shared=True`` keeps it mapped (no
    new IPC handle after the first publish).

    Bump allocation: :meth:`take` hands out views at 256-byte aligned offsets in call order;
    :meth:`reset` (called by :func:`colocate.megatron.iter_hf_weights` at the start of each
    pass) starts over, so a pass in the same order gets the same offsets, and the tensors of the
    previous pass are overwritten: they are valid until the next reset. The capacity is fixed at
    construction (no growth: a reallocation would change the storage under a kept mapping); a
    pass that needs more raises :class:`ArenaCapacityError` naming both numbers.
    :meth:`for_spec` sizes it from the model spec (:func:`arena_nbytes`). Memory cost: those
    bytes, held for the arena's lifetime (Qwen3-8B in bf16: 1.8 GB).

    ``device``: where the converted tensors live (the trainer's device). ``share_memory``: put a
    CPU buffer in shared memory so the ``shm`` transport can send it in place (CUDA buffers are
    shared through IPC without it).

    Recording (for :class:`colocate.publish.Publisher`'s replay): between :meth:`record` and
    :meth:`recorded`, every writer notes how it filled the view it took and what it read
    (:meth:`wrote`, e.g. the strided copy of q out of ``linear_qkv``); :meth:`recorded` returns
    those only if every :meth:`take` of the pass was noted, so a pass that also wrote through
    something that cannot be re-run alone (a TP/EP all-gather) is never replayed. The publisher
    also refuses ops that read a tensor outside the trainer's parameters and this arena (a
    temporary would be stale).
    """

    def __init__(self, nbytes: int, *, device: str | torch.device = "cpu", share_memory: bool = False):
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ConfigError(f"ConversionArena nbytes must be an int >= 0, got {nbytes!r}")
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if share_memory:
            self.buffer.share_memory_()
        self.used = 0
        """Bytes handed out since the last :meth:`reset` (aligned)."""
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed per dtype (take: one as_strided)
        self._ops: list[tuple[Callable[[], object], tuple[torch.Tensor, ...]]] | None = None  # recording
        self._takes = 0

    @classmethod
    def for_spec(cls, spec: HFModelSpec, *, dtype: torch.dtype, device: str | torch.device = "cpu",
                 share_memory: bool = False) -> ConversionArena:
        """An arena of exactly :func:`arena_nbytes` ``(spec, dtype=dtype)`` bytes."""
        return cls(arena_nbytes(spec, dtype=dtype), device=device, share_memory=share_memory)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def reset(self) -> None:
        """Start a new pass at offset 0 (the previous pass's tensors will be overwritten)."""
        self.used = 0
        if self._ops is not None:
            self._ops, self._takes = [], 0

    def record(self) -> None:
        """Record the next pass: each :meth:`take` and the op that filled it (:meth:`wrote`)."""
        self._ops, self._takes = [], 0

    def wrote(self, op: Callable[[], object], *reads: torch.Tensor) -> None:
        """The view of the last :meth:`take` was filled by ``op()`` from ``reads``; while
        recording, kept so it can be re-run (reading its sources again)."""
        if self._ops is not None:
            self._ops.append((op, reads))

    def recorded(self) -> list[tuple[Callable[[], object], tuple[torch.Tensor, ...]]] | None:
        """Stop recording; ``(op, reads)`` that refill this pass's views in order, or ``None``
        when some take was filled by a writer that did not note itself (e.g. a collective)."""
        ops, takes = self._ops, self._takes
        self._ops, self._takes = None, 0
        return ops if ops is not None and len(ops) == takes else None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, *, name: str = "tensor") -> torch.Tensor:
        """An uninitialised contiguous ``(shape, dtype)`` view at the next aligned offset."""
        n = nbytes(shape, dtype)
        start = self.used
        if start + n > self.capacity:
            raise ArenaCapacityError(name, n, start, self.capacity)
        self.used = min(align(start + n), self.capacity)
        self._takes += 1
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.buffer[: self.capacity - self.capacity % dtype.itemsize].view(dtype)
        strides, acc = [], 1
        for x in reversed(shape):
            strides.append(acc)
            acc *= int(x)
        return typed.as_strided(tuple(shape), tuple(reversed(strides)), start // dtype.itemsize)

    def take_for(self, like: torch.Tensor, shape, dtype: torch.dtype, *, name: str) -> torch.Tensor:
        """:meth:`take` for an output computed from ``like``, which must live on the arena's device."""
        if like.device != self.device:
            raise ConversionError(f"{name}: tensor on {like.device}, ConversionArena on {self.device}")
        return self.take(tuple(shape), dtype, name=name)


def merge_tp_shards(shards: list[torch.Tensor], *, kind: str) -> torch.Tensor:
    """Merge per-rank shards (rank order) of one parameter.

    ``kind``: ``"col"`` concatenates dim 0, ``"row"`` dim 1, ``"glu"`` splits each shard
    [gate_r; up_r] in halves and returns [gate_0..gate_n; up_0..up_n], ``"replicated"``
    returns shard 0.
    """
    layout = _KINDS.get(kind)
    if layout is None:
        raise ConversionError(f"merge_tp_shards: unknown kind {kind!r}")
    return layout.merge(shards, None)


_KINDS = {"col": COL, "row": ROW, "glu": GLU, "replicated": REPLICATED}


def megatron_to_hf(name: str, tensor: torch.Tensor, *, spec: HFModelSpec, arena: ConversionArena | None = None
                   ) -> list[tuple[str, torch.Tensor]]:
    """Map one global, TP-merged Megatron parameter to its HF name(s) and layout(s) (the
    :mod:`mcore_distill.hf.mapping` table of ``spec``'s architecture).

    Returns views where possible (no copy); ``[]`` for parameters the receiver does not take
    (``output_layer.weight`` under tied embeddings). Tensors that must be created (q/k/v split,
    casts; see the module docstring) are fresh, or written into ``arena`` (same values, bit for
    bit; valid until its next :meth:`~ConversionArena.reset`). Raises :class:`ConversionError`
    on an unknown name, :class:`ArenaCapacityError` when the arena is too small.
    """
    d = Dims.of(spec)
    m = table_for(d).resolve(name, d)
    if not m.save:
        return []
    return list(zip(m.hf, m.layout.to_hf(tensor, d, arena=arena, names=m.hf)))


def hf_param_specs(spec: HFModelSpec, *, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF name the receiver expects with its (shape, dtype), for a model trained in ``dtype``."""
    d = Dims.of(spec)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for _, m in table_for(d).entries(d):
        dt = m.layout.hf_dtype(d, dtype)
        out.update((n, (s, dt)) for n, s in zip(m.hf, m.shapes))
    return out


def arena_nbytes(spec: HFModelSpec, *, dtype: torch.dtype) -> int:
    """Bytes a :class:`ConversionArena` needs for one pass over a model trained in ``dtype``: the
    aligned sizes of every tensor the converter creates (q/k/v with several KV groups, router
    casts, the hybrid's gated ``q_proj``, GDN ``in_proj_qkvz``/``in_proj_ba`` and shifted norms;
    each layout says which of its outputs are new). Exact, except that an
    ``e_score_correction_bias`` is counted although Megatron's is already fp32 (a few KiB at
    most). TP/EP gathers and later casts (``publish_megatron(dtype=)``) are not converter
    outputs and are not counted: under TP/EP > 1 size the arena with
    :func:`colocate.megatron.megatron_arena_nbytes` (this plus the gathered parameters)."""
    d = Dims.of(spec)
    total = 0
    for _, m in table_for(d).entries(d):
        dt = m.layout.hf_dtype(d, dtype)
        total += sum(align(nbytes(s, dt)) for k, s in enumerate(m.shapes)
                     if m.layout.creates(d, k, cast=dt != dtype))
    return total


def check_params(sent: Mapping[str, tuple[Iterable[int], torch.dtype]],
                 expected: Mapping[str, tuple[Iterable[int], torch.dtype]], *, require_all: bool = True,
                 limit: int = 10) -> None:
    """Raise :class:`ParamMismatchError` unless every sent name exists on the receiver with the
    same shape and dtype (and, with ``require_all``, every expected name is sent)."""
    problems: list[str] = []
    for n, (shape, dt) in sent.items():
        if n not in expected:
            problems.append(f"{n}: sent {tuple(shape)} {dt}, receiver has no such parameter")
            continue
        eshape, edt = expected[n]
        if tuple(shape) != tuple(eshape) or dt != edt:
            problems.append(f"{n}: sent {tuple(shape)} {dt}, receiver expects {tuple(eshape)} {edt}")
    if require_all:
        problems += [f"{n}: not sent, receiver expects {tuple(s)} {d}" for n, (s, d) in expected.items() if n not in sent]
    if problems:
        raise ParamMismatchError(problems[:limit], len(problems))


# ----- Qwen3-Next / Qwen3.5 hybrids (Gated DeltaNet + gated full attention) ------------------------
@dataclass(kw_only=True)
class Qwen3HybridSpec(HFModelSpec):
    """A Qwen3-Next / Qwen3.5 hybrid (HF ``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM``): Gated
    DeltaNet layers and gated full-attention layers. The inherited ``arch`` names the MLP family
    (``qwen3`` dense; ``qwen3_moe`` routed experts with a gated shared expert)."""

    layer_types: list[str] = field(default_factory=list)
    """One entry per layer: ``linear_attention`` (Gated DeltaNet) or ``full_attention``."""
    linear_num_key_heads: int = 16
    """GDN key heads (HF ``linear_num_key_heads``)."""
    linear_num_value_heads: int = 32
    """GDN value heads; a multiple of the key heads."""
    linear_key_head_dim: int = 128
    """GDN key/query head channels."""
    linear_value_head_dim: int = 128
    """GDN value head channels."""
    linear_conv_kernel_dim: int = 4
    """Width of the GDN short convolution."""
    partial_rotary_factor: float = 0.25
    """Fraction of each attention head that gets RoPE (Megatron ``rotary_percent``)."""
    megatron_zero_centered_gamma: bool = False
    """Megatron norms store ``γ − 1`` (``layernorm_zero_centered_gamma``, TE). HF keeps ``γ − 1``
    in its decoder/q/k norms (``x·(1 + w)``) and plain ``γ`` in the GDN gated norm, so one of the
    two gets ±1 depending on this flag."""
    shared_expert_ffn_hidden_size: int | None = None
    """Shared-expert intermediate size (MoE only; None: no shared expert)."""
    gdn_layout: str = "qwen3_next"
    """HF layout of the GDN input projection: ``qwen3_next`` (``in_proj_qkvz`` and ``in_proj_ba``,
    rows grouped per key head) or ``qwen3_5`` (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, each in Megatron's head order)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [t for t in self.layer_types if t not in ("linear_attention", "full_attention")]
        if len(self.layer_types) != self.num_layers or bad:
            raise ConfigError(f"Qwen3HybridSpec.layer_types must list {self.num_layers} of 'linear_attention'/"
                              f"'full_attention', got {self.layer_types!r}")
        for n in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
            v = getattr(self, n)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"Qwen3HybridSpec.{n} must be a positive int, got {v!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"Qwen3HybridSpec.linear_num_value_heads={self.linear_num_value_heads} must be a "
                              f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
        if self.gdn_layout not in ("qwen3_next", "qwen3_5"):
            raise ConfigError(f"Qwen3HybridSpec.gdn_layout must be 'qwen3_next' or 'qwen3_5', got {self.gdn_layout!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"Qwen3HybridSpec.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")


def gdn_tp_sections(spec: Qwen3HybridSpec, tp: int, *, which: str) -> list[int]:
    """Per-TP-rank row sections of the GDN ``in_proj`` (``which="in_proj"``) or ``conv1d``."""
    return gdn_sections(Dims.of(spec), tp, which=which)


def merge_named_tp_shards(name: str, shards: list[torch.Tensor], *, kind: str, spec: HFModelSpec) -> torch.Tensor:
    """:func:`merge_tp_shards` that also knows the stacked GDN shards of a hybrid: for a
    :class:`Qwen3HybridSpec`, ``self_attention.in_proj.weight`` and ``self_attention.conv1d.weight``
    (column-parallel, several tensors per shard) merge section by section."""
    if isinstance(spec, Qwen3HybridSpec) and len(shards) > 1 and kind == "col":
        for suffix, which in (("self_attention.in_proj.weight", "in_proj"), ("self_attention.conv1d.weight", "conv1d")):
            if name.endswith(suffix):
                return merge_tp_sections(shards, gdn_tp_sections(spec, len(shards), which=which))
    return merge_tp_shards(shards, kind=kind)
