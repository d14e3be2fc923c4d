"""Megatron-Core → HF (Qwen3 / Qwen3-MoE) names and layouts, as pure tensor functions.

Input names are *global* Megatron names: layer ids counted over the whole model (all pipeline
stages) and expert ids counted over all expert-parallel ranks (see :func:`globalize_name`);
tensors are whole (TP shards already merged by :func:`merge_tp_shards`). Output names are the
HF checkpoint names that ``transformers`` and SGLang's ``load_weights`` take.

Layouts:

* ``linear_qkv`` [G·(Q/G + 2)·D, H] is grouped per KV head: for each group g the Q/G query
  heads, then one key head, then one value head. It splits by GQA groups into
  ``q_proj`` [Q·D, H], ``k_proj`` [G·D, H], ``v_proj`` [G·D, H] — never into equal thirds.
* ``linear_fc1`` [2F, H] = [gate; up]; each TP shard is [gate_r; up_r], so shards are merged
  half by half (:func:`merge_tp_shards` with ``kind="glu"``).
* Router ``mlp.router.weight`` → ``mlp.gate.weight`` (cast to ``router_dtype``);
  ``expert_bias`` → ``mlp.gate.e_score_correction_bias`` in fp32.
* Local (``pre_mlp_layernorm``) and TE-fused (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``) norm names both map to the HF norms.
* Tied embeddings: ``output_layer.weight`` is dropped; the receiver ties ``lm_head``.
* Padded vocab: with ``serve_vocab_size`` only the first rows of embedding / LM head are sent.

Qwen3-Next / Qwen3.5 hybrids (:class:`Qwen3HybridSpec`): Gated DeltaNet ``in_proj``
``[q; k; v; z; β; α]`` is regrouped per key head (Qwen3-Next ``in_proj_qkvz``/``in_proj_ba``) or
split (Qwen3.5 ``in_proj_qkv``/``z``/``b``/``a``); gated attention ``linear_qkv`` (per group
``[q; gate; k; v]``) becomes ``q_proj`` with ``[q_h; gate_h]`` per head; HF's decoder and q/k
norms are zero-centered (``x·(1 + w)``), its GDN gated norm is not. Under TP the GDN ``in_proj``
and ``conv1d`` shards hold several stacked tensors and merge with :func:`merge_tp_sections`.

Copies: most outputs are views of the input (norms, ``o_proj``/``down_proj``, gate/up halves,
embeddings). The GQA q/k/v split, the hybrid's gated ``q_proj``/GDN regrouping, the hybrid's
norm shifts and dtype casts must create tensors. By default each is a fresh allocation; with a
:class:`ConversionArena` (``arena=``) they are written into one persistent buffer instead, so
every output is a view of either the input's storage or the arena's, and a publisher can hand
both storages over in place (no packing copy, and with a fixed arena no new IPC handle).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import partial

import torch

from colocate.buckets import align, nbytes
from colocate.config import ConfigError, HFModelSpec

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

ROUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConversionError(ValueError):
    """A Megatron name or tensor that the converter cannot map; names the parameter."""


class ParamMismatchError(ValueError):
    """Sender and receiver disagree on names, shapes or dtypes (first 10 listed with both sides)."""

    def __init__(self, problems: list[str], total: int):
        self.problems = problems
        self.total = total
        super().__init__(f"{total} parameter mismatch(es); first {len(problems)}:\n  " + "\n  ".join(problems))


class ArenaCapacityError(ConversionError):
    """A conversion pass needs more bytes than its :class:`ConversionArena` holds."""

    def __init__(self, name: str, requested: int, used: int, capacity: int):
        self.name, self.requested, self.used, self.capacity = name, requested, used, capacity
        super().__init__(f"ConversionArena: {name} needs {requested} bytes at offset {used}, but capacity is "
                         f"{capacity} bytes (size it with ConversionArena.for_spec(spec, dtype=...), call reset() "
                         "at the start of each pass)")


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




def _materialize(src: torch.Tensor, shape, arena: ConversionArena | None, name: str) -> torch.Tensor:
    """``src.reshape(shape)``; where that would copy (``src`` not contiguous) and an arena is
    given, the copy goes into the arena instead of a fresh allocation."""
    if arena is None or src.is_contiguous():
        return src.reshape(shape)
    out = arena.take_for(src, src.shape, src.dtype, name=name)
    out.copy_(src)
    arena.wrote(partial(out.copy_, src), src)
    return out.view(shape)


def _cast(t: torch.Tensor, dtype: torch.dtype, arena: ConversionArena | None, name: str) -> torch.Tensor:
    """``t.to(dtype)`` (``t`` itself when the dtype already matches), into the arena if given."""
    if arena is None or t.dtype == dtype:
        return t.to(dtype)
    out = arena.take_for(t, t.shape, dtype, name=name)
    out.copy_(t)
    arena.wrote(partial(out.copy_, t), t)
    return out


def _stack_groups(parts: list[torch.Tensor], arena: ConversionArena | None, name: str, dim: int = 1
                  ) -> torch.Tensor:
    """``torch.cat(parts, dim).reshape(-1, *tail)`` for parts [*lead, w_i, *tail] (``lead`` has
    ``dim`` dims); with an arena the parts are copied into an arena view of the result instead
    (same bytes, no intermediate)."""
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


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int,
              arena: ConversionArena | None = None, names: tuple[str, str, str] = ("q", "k", "v")
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


def merge_tp_shards(shards: list[torch.Tensor], *, kind: str) -> torch.Tensor:
    """Merge per-rank shards (rank order) of one parameter.

    ``kind``: ``"col"`` concatenates dim 0, ``"row"`` dim 1, ``"glu"`` splits each shard
    [gate_r; up_r] in halves and returns [gate_0..gate_n; up_0..up_n], ``"replicated"``
    returns shard 0.
    """
    if kind == "replicated" or len(shards) == 1 and kind != "glu":
        return shards[0]
    if kind == "col":
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ConversionError(f"merge_tp_shards: unknown kind {kind!r}")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")
_EXPERT_GROUPED = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")


def globalize_name(name: str, *, layer_id: int | None = None, expert_offset: int = 0) -> str:
    """Rewrite a local Megatron name to global ids: ``decoder.layers.{j}`` → ``{layer_id}``
    and expert ``e`` → ``e + expert_offset`` (``local_experts.{e}`` and TE ``weight{e}``)."""
    for prefix in ("module.",):
        while name.startswith(prefix):
            name = name[len(prefix):]
    if layer_id is not None:
        name = _LAYER.sub(f"decoder.layers.{layer_id}.", name, count=1)
    if expert_offset:
        name = _EXPERT_LOCAL.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)
        name = _EXPERT_GROUPED.sub(lambda m: f".experts.{m.group(1)}.weight{int(m.group(2)) + expert_offset}", name)
    return name


_DIRECT_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def megatron_to_hf(name: str, tensor: torch.Tensor, *, spec: HFModelSpec, arena: ConversionArena | None = None
                   ) -> list[tuple[str, torch.Tensor]]:
    """Map one global, TP-merged Megatron parameter to its HF name(s) and layout(s).

    Returns views where possible (no copy); ``[]`` for parameters the receiver does not take
    (``output_layer.weight`` under tied embeddings). Tensors that must be created (q/k/v split,
    casts; see the module docstring) are fresh, or written into ``arena`` (same values, bit for
    bit; valid until its next :meth:`~ConversionArena.reset`). Raises :class:`ConversionError`
    on an unknown name, :class:`ArenaCapacityError` when the arena is too small.
    """
    if isinstance(spec, Qwen3HybridSpec):
        return _hybrid_to_hf(name, tensor, spec, arena)
    rows = spec.serve_vocab_size or spec.vocab_size
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[:rows])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    if name == "output_layer.weight":
        return [] if spec.tie_embeddings else [("lm_head.weight", tensor[:rows])]
    m = _LAYER.match(name)
    if m is None:
        raise ConversionError(f"no HF mapping for Megatron parameter {name!r}")
    layer, rest = int(m.group(1)), name[m.end():]
    if not 0 <= layer < spec.num_layers:
        raise ConversionError(f"{name!r}: layer {layer} outside num_layers={spec.num_layers}")
    pre = f"model.layers.{layer}."
    if rest in _DIRECT_LAYER:
        return [(pre + _DIRECT_LAYER[rest], tensor)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        names = tuple(f"{pre}self_attn.{p}_proj.{kind}" for p in "qkv")
        return list(zip(names, split_qkv(tensor, num_heads=spec.num_attention_heads, num_groups=spec.num_query_groups,
                                         head_dim=spec.head_dim, arena=arena, names=names)))
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(pre + "mlp.gate_proj.weight", gate), (pre + "mlp.up_proj.weight", up)]
    if rest == "mlp.router.weight":
        out = tensor if spec.router_dtype is None else _cast(tensor, ROUTER_DTYPES[spec.router_dtype], arena,
                                                             pre + "mlp.gate.weight")
        return [(pre + "mlp.gate.weight", out)]
    if rest == "mlp.router.expert_bias":
        n = pre + "mlp.gate.e_score_correction_bias"
        return [(n, _cast(tensor, torch.float32, arena, n))]
    e = _EXPERT.match(rest)
    if e is not None:
        expert = int(e.group(1) if e.group(1) is not None else e.group(4))
        fc = e.group(2) or e.group(3)
        if spec.num_experts is None or not 0 <= expert < spec.num_experts:
            raise ConversionError(f"{name!r}: expert {expert} outside num_experts={spec.num_experts}")
        epre = f"{pre}mlp.experts.{expert}."
        if fc == "linear_fc1":
            gate, up = tensor.chunk(2, dim=0)
            return [(epre + "gate_proj.weight", gate), (epre + "up_proj.weight", up)]
        return [(epre + "down_proj.weight", tensor)]
    raise ConversionError(f"no HF mapping for Megatron parameter {name!r}")


def hf_param_specs(spec: HFModelSpec, *, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF name the receiver expects with its (shape, dtype), for a model trained in ``dtype``."""
    if isinstance(spec, Qwen3HybridSpec):
        return _hybrid_specs(spec, dtype)
    H, D, Q, G = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_query_groups
    V = spec.serve_vocab_size or spec.vocab_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((V, H), dtype),
                                                           "model.norm.weight": ((H,), dtype)}
    if not spec.tie_embeddings:
        out["lm_head.weight"] = ((V, H), dtype)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": ((H,), dtype),
            p + "post_attention_layernorm.weight": ((H,), dtype),
            p + "self_attn.q_proj.weight": ((Q * D, H), dtype),
            p + "self_attn.k_proj.weight": ((G * D, H), dtype),
            p + "self_attn.v_proj.weight": ((G * D, H), dtype),
            p + "self_attn.o_proj.weight": ((H, Q * D), dtype),
            p + "self_attn.q_norm.weight": ((D,), dtype),
            p + "self_attn.k_norm.weight": ((D,), dtype),
        })
        if spec.num_experts:
            F = spec.moe_ffn_hidden_size
            rdt = dtype if spec.router_dtype is None else ROUTER_DTYPES[spec.router_dtype]
            out[p + "mlp.gate.weight"] = ((spec.num_experts, H), rdt)
            if spec.has_expert_bias:
                out[p + "mlp.gate.e_score_correction_bias"] = ((spec.num_experts,), torch.float32)
            for e in range(spec.num_experts):
                ep = f"{p}mlp.experts.{e}."
                out.update({ep + "gate_proj.weight": ((F, H), dtype), ep + "up_proj.weight": ((F, H), dtype),
                            ep + "down_proj.weight": ((H, F), dtype)})
        else:
            F = spec.ffn_hidden_size
            out.update({p + "mlp.gate_proj.weight": ((F, H), dtype), p + "mlp.up_proj.weight": ((F, H), dtype),
                        p + "mlp.down_proj.weight": ((H, F), dtype)})
    return out


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


def gdn_in_proj_to_hf(w: torch.Tensor, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, arena: ConversionArena | None = None,
                      names: tuple[str, str] = ("in_proj_qkvz", "in_proj_ba")) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron GDN ``in_proj`` [2·Nk·Dk + 2·Nv·Dv + 2·Nv, H] = ``[q; k; v; z; β; α]`` (each in head
    order) → HF ``in_proj_qkvz`` [2·Nk·Dk + 2·Nv·Dv, H] and ``in_proj_ba`` [2·Nv, H], both grouped
    per key head g (r = Nv/Nk value heads per group): ``[q_g; k_g; v_g (r·Dv); z_g (r·Dv)]`` and
    ``[β_g (r); α_g (r)]``. Both are new tensors: fresh, or in ``arena``."""
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    r = nv // nk
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    if w.shape[0] != rows:
        raise ConversionError(f"GDN in_proj has {w.shape[0]} rows, expected 2·Nk·Dk + 2·Nv·Dv + 2·Nv = {rows} "
                              f"(Nk={nk}, Nv={nv}, Dk={dk}, Dv={dv})")
    tail = w.shape[1:]
    q, k, v, z, b, a = torch.split(w, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], dim=0)
    qkvz = _stack_groups([q.reshape(nk, dk, *tail), k.reshape(nk, dk, *tail), v.reshape(nk, r * dv, *tail),
                          z.reshape(nk, r * dv, *tail)], arena, names[0])
    ba = _stack_groups([b.reshape(nk, r, *tail), a.reshape(nk, r, *tail)], arena, names[1])
    return qkvz, ba


def gdn_in_proj_split(w: torch.Tensor, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron GDN ``in_proj`` ``[q; k; v; z; β; α]`` → HF Qwen3.5 ``in_proj_qkv`` [2·Nk·Dk + Nv·Dv, H],
    ``in_proj_z`` [Nv·Dv, H], ``in_proj_b`` [Nv, H], ``in_proj_a`` [Nv, H] (views, head order kept)."""
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    if w.shape[0] != rows:
        raise ConversionError(f"GDN in_proj has {w.shape[0]} rows, expected 2·Nk·Dk + 2·Nv·Dv + 2·Nv = {rows} "
                              f"(Nk={nk}, Nv={nv}, Dk={dk}, Dv={dv})")
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


def gdn_tp_sections(spec: Qwen3HybridSpec, tp: int, *, which: str) -> list[int]:
    """Per-TP-rank row sections of the GDN ``in_proj`` (``which="in_proj"``) or ``conv1d``."""
    qk = spec.linear_num_key_heads * spec.linear_key_head_dim // tp
    v = spec.linear_num_value_heads * spec.linear_value_head_dim // tp
    nv = spec.linear_num_value_heads // tp
    if which == "in_proj":
        return [qk, qk, v, v, nv, nv]
    if which == "conv1d":
        return [qk, qk, v]
    raise ConversionError(f"gdn_tp_sections: which must be 'in_proj' or 'conv1d', got {which!r}")


def merge_named_tp_shards(name: str, shards: list[torch.Tensor], *, kind: str, spec: HFModelSpec) -> torch.Tensor:
    """:func:`merge_tp_shards` that also knows the stacked GDN shards of a hybrid: for a
    :class:`Qwen3HybridSpec`, ``self_attention.in_proj.weight`` and ``self_attention.conv1d.weight``
    (column-parallel, several tensors per shard) merge section by section."""
    if isinstance(spec, Qwen3HybridSpec) and len(shards) > 1 and kind == "col":
        for suffix, which in (("self_attention.in_proj.weight", "in_proj"), ("self_attention.conv1d.weight", "conv1d")):
            if name.endswith(suffix):
                return merge_tp_sections(shards, gdn_tp_sections(spec, len(shards), which=which))
    return merge_tp_shards(shards, kind=kind)


_NEXT_NORMS = {  # Megatron layer-relative name → HF name (zero-centered HF norms)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


_GDN_SUBMODULES = ("in_proj", "conv1d", "A_log", "dt_bias", "out_norm", "out_proj")


def _shifted(t: torch.Tensor, delta: int, arena: ConversionArena | None, name: str) -> torch.Tensor:
    """``t + delta`` (a new tensor), written into ``arena`` if given (same kernel, same bits)."""
    if arena is None:
        return t + delta
    out = arena.take_for(t, t.shape, t.dtype, name=name)
    torch.add(t, delta, out=out)
    arena.wrote(partial(torch.add, t, delta, out=out), t)
    return out


def _hf_centered(t: torch.Tensor, spec: Qwen3HybridSpec, arena: ConversionArena | None = None,
                 name: str = "norm") -> torch.Tensor:
    return t if spec.megatron_zero_centered_gamma else _shifted(t, -1, arena, name)


def _gated_qkv_to_hf(qkv: torch.Tensor, spec: Qwen3HybridSpec, arena: ConversionArena | None,
                     names: tuple[str, str, str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated ``linear_qkv`` → HF (``q_proj`` with ``[q_h; gate_h]`` per head, k, v): without an
    arena :func:`split_qkv_gated` + :func:`hf_gated_q_proj`; with one, q and gate are copied
    straight into the arena's ``q_proj`` (one copy instead of two) and k/v like :func:`split_qkv`."""
    Q, G, D = spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    if arena is None:
        q, gate, k, v = split_qkv_gated(qkv, num_heads=Q, num_groups=G, head_dim=D)
        return hf_gated_q_proj(q, gate, num_heads=Q, head_dim=D), k, v
    _check_gated_rows(qkv, Q, G, D)
    per, tail = Q // G, qkv.shape[1:]
    s = per * D
    g = qkv.reshape(G, (2 * per + 2) * D, *tail)
    qp = _stack_groups([g[:, :s].view(G, per, D, *tail), g[:, s:2 * s].view(G, per, D, *tail)], arena, names[0],
                       dim=2)
    k = _materialize(g[:, 2 * s:2 * s + D], (G * D, *tail), arena, names[1])
    v = _materialize(g[:, 2 * s + D:], (G * D, *tail), arena, names[2])
    return qp, k, v


def _hybrid_to_hf(name: str, tensor: torch.Tensor, spec: Qwen3HybridSpec, arena: ConversionArena | None = None
                  ) -> list[tuple[str, torch.Tensor]]:
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", _hf_centered(tensor, spec, arena, "model.norm.weight"))]
    m = _LAYER.match(name)
    if m is None:
        return megatron_to_hf(name, tensor, spec=HFModelSpec(**_base_fields(spec)), arena=arena)
    layer, rest = int(m.group(1)), name[m.end():]
    if not 0 <= layer < spec.num_layers:
        raise ConversionError(f"{name!r}: layer {layer} outside num_layers={spec.num_layers}")
    pre = f"model.layers.{layer}."
    kind = spec.layer_types[layer]
    if rest in _NEXT_NORMS:
        if rest.startswith("self_attention.") and ("q_layernorm" in rest or "k_layernorm" in rest) \
                and kind != "full_attention":
            raise ConversionError(f"{name!r}: layer {layer} is {kind}, it has no q/k norm")
        return [(pre + _NEXT_NORMS[rest], _hf_centered(tensor, spec, arena, pre + _NEXT_NORMS[rest]))]
    sub = rest.split(".")[1] if rest.startswith("self_attention.") else None
    if sub in _GDN_SUBMODULES or sub in ("linear_qkv", "linear_proj"):
        want = "linear_attention" if sub in _GDN_SUBMODULES else "full_attention"
        if want != kind:
            raise ConversionError(f"{name!r}: a {want} parameter, but layer_types[{layer}]={kind!r}")
    if rest == "self_attention.linear_qkv.weight":
        names = tuple(f"{pre}self_attn.{p}_proj.weight" for p in "qkv")
        return list(zip(names, _gated_qkv_to_hf(tensor, spec, arena, names)))
    if rest == "self_attention.linear_proj.weight":
        return [(pre + "self_attn.o_proj.weight", tensor)]
    la = pre + "linear_attn."
    if rest == "self_attention.in_proj.weight" and spec.gdn_layout == "qwen3_5":
        qkv, z, b, a = gdn_in_proj_split(tensor, num_key_heads=spec.linear_num_key_heads,
                                         num_value_heads=spec.linear_num_value_heads,
                                         key_head_dim=spec.linear_key_head_dim,
                                         value_head_dim=spec.linear_value_head_dim)
        return [(la + "in_proj_qkv.weight", qkv), (la + "in_proj_z.weight", z), (la + "in_proj_b.weight", b),
                (la + "in_proj_a.weight", a)]
    if rest == "self_attention.in_proj.weight":
        names = (la + "in_proj_qkvz.weight", la + "in_proj_ba.weight")
        qkvz, ba = gdn_in_proj_to_hf(tensor, num_key_heads=spec.linear_num_key_heads,
                                     num_value_heads=spec.linear_num_value_heads,
                                     key_head_dim=spec.linear_key_head_dim, value_head_dim=spec.linear_value_head_dim,
                                     arena=arena, names=names)
        return list(zip(names, (qkvz, ba)))
    if rest == "self_attention.conv1d.weight":
        return [(la + "conv1d.weight", tensor)]
    if rest in ("self_attention.A_log", "self_attention.dt_bias"):
        return [(la + rest.split(".")[1], tensor)]
    if rest == "self_attention.out_norm.weight":  # HF gated norm is plain γ
        return [(la + "norm.weight",
                 _shifted(tensor, 1, arena, la + "norm.weight") if spec.megatron_zero_centered_gamma else tensor)]
    if rest == "self_attention.out_proj.weight":
        return [(la + "out_proj.weight", tensor)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(pre + "mlp.shared_expert.gate_proj.weight", gate), (pre + "mlp.shared_expert.up_proj.weight", up)]
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return [(pre + "mlp.shared_expert.down_proj.weight", tensor)]
    if rest == "mlp.shared_experts.gate_weight":
        return [(pre + "mlp.shared_expert_gate.weight", tensor)]
    if rest.startswith("mlp."):
        return megatron_to_hf(name, tensor, spec=HFModelSpec(**_base_fields(spec)), arena=arena)
    raise ConversionError(f"no HF Qwen3-Next mapping for Megatron parameter {name!r}")


def _base_fields(spec: HFModelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in fields(HFModelSpec)}


def _hybrid_specs(spec: Qwen3HybridSpec, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    base = hf_param_specs(HFModelSpec(**_base_fields(spec)), dtype=dtype)
    out = {n: v for n, v in base.items() if ".self_attn." not in n}
    H, D, Q, G = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_query_groups
    nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
    dk, dv, W = spec.linear_key_head_dim, spec.linear_value_head_dim, spec.linear_conv_kernel_dim
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            out.update({p + "self_attn.q_proj.weight": ((2 * Q * D, H), dtype),
                        p + "self_attn.k_proj.weight": ((G * D, H), dtype),
                        p + "self_attn.v_proj.weight": ((G * D, H), dtype),
                        p + "self_attn.o_proj.weight": ((H, Q * D), dtype),
                        p + "self_attn.q_norm.weight": ((D,), dtype), p + "self_attn.k_norm.weight": ((D,), dtype)})
        else:
            la = p + "linear_attn."
            if spec.gdn_layout == "qwen3_5":
                out.update({la + "in_proj_qkv.weight": ((2 * nk * dk + nv * dv, H), dtype),
                            la + "in_proj_z.weight": ((nv * dv, H), dtype), la + "in_proj_b.weight": ((nv, H), dtype),
                            la + "in_proj_a.weight": ((nv, H), dtype)})
            else:
                out.update({la + "in_proj_qkvz.weight": ((2 * nk * dk + 2 * nv * dv, H), dtype),
                            la + "in_proj_ba.weight": ((2 * nv, H), dtype)})
            out.update({la + "conv1d.weight": ((2 * nk * dk + nv * dv, 1, W), dtype),
                        la + "dt_bias": ((nv,), dtype), la + "A_log": ((nv,), dtype),
                        la + "norm.weight": ((dv,), dtype), la + "out_proj.weight": ((H, nv * dv), dtype)})
        if spec.num_experts and spec.shared_expert_ffn_hidden_size:
            S = spec.shared_expert_ffn_hidden_size
            out.update({p + "mlp.shared_expert.gate_proj.weight": ((S, H), dtype),
                        p + "mlp.shared_expert.up_proj.weight": ((S, H), dtype),
                        p + "mlp.shared_expert.down_proj.weight": ((H, S), dtype),
                        p + "mlp.shared_expert_gate.weight": ((1, H), dtype)})
    return out


def _arena_needed(name: str, dtype: torch.dtype, out_dtype: torch.dtype, spec: HFModelSpec) -> bool:
    """Whether :func:`megatron_to_hf` with an arena writes HF tensor ``name`` (of ``out_dtype``,
    converted from a model trained in ``dtype``) into the arena; mirrors the converter."""
    hybrid = isinstance(spec, Qwen3HybridSpec)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        return spec.num_query_groups > 1  # strided parts only when there are several groups
    if name.endswith("self_attn.q_proj.weight"):
        return hybrid or spec.num_query_groups > 1  # the gated q_proj interleaves q and gate: always new
    if name.endswith("mlp.gate.weight"):
        return out_dtype != dtype  # router cast
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return True  # cast to fp32 unless it already is (Megatron's is): counted, an upper bound
    if not hybrid:
        return False
    if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
        return True
    if name.endswith("linear_attn.norm.weight"):
        return spec.megatron_zero_centered_gamma  # + 1
    if name == "model.norm.weight" or name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
        return not spec.megatron_zero_centered_gamma  # − 1
    return False


def arena_nbytes(spec: HFModelSpec, *, dtype: torch.dtype) -> int:
    """Bytes a :class:`ConversionArena` needs for one pass over a model trained in ``dtype``: the
    aligned sizes of every tensor the converter creates (q/k/v with several KV groups, router
    casts, the hybrid's gated ``q_proj``, GDN ``in_proj_qkvz``/``in_proj_ba`` and shifted norms).
    Exact, except that an ``e_score_correction_bias`` is counted although Megatron's is already
    fp32 (a few KiB at most). TP/EP gathers and later casts (``publish_megatron(dtype=)``) are
    not converter outputs and are not counted: under TP/EP > 1 size the arena with
    :func:`colocate.megatron.megatron_arena_nbytes` (this plus the gathered parameters)."""
    return sum(align(nbytes(shape, dt)) for n, (shape, dt) in hf_param_specs(spec, dtype=dtype).items()
               if _arena_needed(n, dtype, dt, spec))
