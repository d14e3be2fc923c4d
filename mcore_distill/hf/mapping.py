"""One mapping table per architecture: Megatron-Core parameter names ↔ HF checkpoint tensors.

A :class:`Rule` maps one Megatron parameter (its local-spec name first, then the aliases a
Transformer Engine or grouped-GEMM spec uses for the same tensor) to the HF tensors it becomes,
with their shapes as expressions in the :class:`~mcore_distill.hf.layouts.Dims` symbols, and the
:class:`~mcore_distill.hf.layouts.Layout` that converts between them. Load
(:mod:`mcore_distill.hf.megatron`), save, and publication (:mod:`colocate.convert`) all read
these two tables:

* :data:`QWEN3` — ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` (dense or routed-expert MLP,
  optional tied embeddings).
* :data:`QWEN3_HYBRID` — ``Qwen3NextForCausalLM`` and ``Qwen3_5ForCausalLM``: Gated DeltaNet
  layers (``linear_attention``) and gated full-attention layers, dense MLP or routed experts
  with a gated shared expert.

Names are global: ``decoder.layers.{i}`` counts layers over all pipeline stages and experts
are counted over all expert-parallel ranks (``{e}`` in the tables).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

from mcore_distill.hf.errors import ConversionError
from mcore_distill.hf.layouts import (
    CENTERED_NORM,
    COL,
    FP32,
    GATED_QKV,
    GDN_CONV,
    GDN_IN_PROJ,
    GLU,
    NORM,
    QKV,
    REPLICATED,
    ROUTER,
    ROW,
    VOCAB,
    Dims,
    Layout,
)

__all__ = ["Rule", "Match", "Table", "QWEN3", "QWEN3_HYBRID", "table_for", "shape_of", "globalize_name"]


@dataclass(frozen=True)
class Rule:
    """Megatron parameter ``megatron[0]`` (aliases after it) ↔ HF tensors ``hf`` (name, shape)."""

    megatron: tuple[str, ...]
    hf: tuple[tuple[str, str], ...]
    layout: Layout
    layer: str | None = None
    """Hybrids: the layer type the parameter belongs to (None: every layer)."""
    when: Callable[[Dims], bool] | None = None
    """The rule applies to models for which this holds (None: always)."""
    listed: Callable[[Dims], bool] | None = None
    """A parameter only some models have (q/k/v biases): converted whenever it is met, listed
    among a model's tensors (:meth:`Table.entries`) only when this holds."""

    def applies(self, d: Dims) -> bool:
        return self.when is None or self.when(d)


@dataclass(frozen=True)
class Match:
    """A resolved global Megatron name: its rule and the full HF names and shapes."""

    rule: Rule
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    layer: int | None = None
    expert: int | None = None
    save: bool = True
    """False for a tied ``output_layer.weight``: loaded from the embedding, never saved."""

    @property
    def layout(self) -> Layout:
        return self.rule.layout


@cache
def _parse(expr: str) -> tuple[tuple[tuple[str, ...], ...], ...]:
    return tuple(tuple(tuple(f.strip() for f in term.split("*")) for term in dim.split("+"))
                 for dim in expr.split(","))


def shape_of(expr: str, d: Dims) -> tuple[int, ...]:
    """Evaluate a shape expression such as ``"2*Nk*Dk+Nv*Dv,1,W"`` with the sizes in ``d``."""
    out = []
    for dim in _parse(expr):
        total = 0
        for term in dim:
            prod = 1
            for f in term:
                prod *= int(f) if f.isdigit() else getattr(d, f)
            total += prod
        out.append(total)
    return tuple(out)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


_EXPERT_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")
_EXPERT_GROUPED = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")


def globalize_name(name: str, *, layer_id: int | None = None, expert_offset: int = 0) -> str:
    """Rewrite a local Megatron name to global ids: ``decoder.layers.{j}`` → ``{layer_id}``
    and expert ``e`` → ``e + expert_offset`` (``local_experts.{e}`` and TE ``weight{e}``);
    wrapper prefixes (``module.``) are dropped."""
    while name.startswith("module."):
        name = name[len("module."):]
    if layer_id is not None:
        name = _LAYER.sub(f"decoder.layers.{layer_id}.", name, count=1)
    if expert_offset:
        name = _EXPERT_LOCAL.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)
        name = _EXPERT_GROUPED.sub(lambda m: f".experts.{m.group(1)}.weight{int(m.group(2)) + expert_offset}", name)
    return name


def _moe(d: Dims) -> bool:
    return d.E > 0


def _dense(d: Dims) -> bool:
    return d.E == 0


class Table:
    """The rules of one architecture, looked up by Megatron name."""

    def __init__(self, name: str, top: tuple[Rule, ...], layer: tuple[Rule, ...], *, unknown: str):
        self.name, self.top, self.layer, self.unknown = name, top, layer, unknown
        self._top = {m: [r for r in top if m in r.megatron] for r in top for m in r.megatron}
        self._layer = {m: [r for r in layer if m in r.megatron] for r in layer for m in r.megatron}

    def _pick(self, rules: list[Rule], d: Dims, name: str) -> Rule:
        for r in rules:
            if r.applies(d):
                return r
        raise ConversionError(f"{self.unknown} {name!r} (not used by this model's configuration)")

    def resolve(self, name: str, d: Dims) -> Match:
        """The :class:`Match` of global Megatron parameter ``name``; raises
        :class:`~mcore_distill.hf.errors.ConversionError` naming it when it has no mapping, its
        layer or expert id is out of range, or (hybrids) it does not belong to its layer's type."""
        if name == "output_layer.weight" and d.tied:
            return Match(_TIED_OUTPUT, ("model.embed_tokens.weight",), (shape_of("V,H", d),), save=False)
        if name in self._top:
            r = self._pick(self._top[name], d, name)
            return Match(r, tuple(h for h, _ in r.hf), tuple(shape_of(s, d) for _, s in r.hf))
        m = _LAYER.match(name)
        if m is None:
            raise ConversionError(f"{self.unknown} {name!r}")
        layer, rest = int(m.group(1)), name[m.end():]
        if not 0 <= layer < d.L:
            raise ConversionError(f"{name!r}: layer {layer} outside num_layers={d.L}")
        expert, key = None, rest
        e = _LOCAL_EXPERT.match(rest)
        if e is not None:
            expert, key = int(e.group(1)), "mlp.experts.local_experts.{e}." + rest[e.end():]
        else:
            e = _GROUPED_EXPERT.match(rest)
            if e is not None:
                expert, key = int(e.group(2)), f"mlp.experts.{e.group(1)}.weight{{e}}"
        if key not in self._layer:
            raise ConversionError(f"{self.unknown} {name!r}")
        r = self._pick(self._layer[key], d, name)
        if expert is not None and not 0 <= expert < d.E:
            raise ConversionError(f"{name!r}: expert {expert} outside num_experts={d.E or None}")
        if r.layer is not None and d.layer_types is not None and d.layer_types[layer] != r.layer:
            kind = d.layer_types[layer]
            if key in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                raise ConversionError(f"{name!r}: layer {layer} is {kind}, it has no q/k norm")
            raise ConversionError(f"{name!r}: a {r.layer} parameter, but layer_types[{layer}]={kind!r}")
        pre = f"model.layers.{layer}."
        hf = tuple(pre + h.replace("{e}", str(expert)) for h, _ in r.hf)
        return Match(r, hf, tuple(shape_of(s, d) for _, s in r.hf), layer=layer, expert=expert)

    def _layer_rules(self, d: Dims, layer: int) -> Iterator[Rule]:
        kind = d.layer_types[layer] if d.layer_types is not None else None
        for r in self.layer:
            if r.applies(d) and (r.listed is None or r.listed(d)) and (r.layer is None or kind is None or r.layer == kind):
                yield r

    def entries(self, d: Dims) -> Iterator[tuple[str, Match]]:
        """``(megatron name, match)`` for every parameter of the whole model (local-spec names,
        global ids, experts as ``local_experts.{e}``); the tied output layer is left out."""
        for r in self.top:
            if r.applies(d) and not (r.megatron[0] == "output_layer.weight" and d.tied):
                yield r.megatron[0], self.resolve(r.megatron[0], d)
        for i in range(d.L):
            for r in self._layer_rules(d, i):
                base = f"decoder.layers.{i}." + r.megatron[0]
                for e in range(d.E) if "{e}" in base else [None]:
                    name = base if e is None else base.replace("{e}", str(e))
                    yield name, self.resolve(name, d)

    def expected(self, d: Dims) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of the whole model with its shape (what a checkpoint holds)."""
        out: dict[str, tuple[int, ...]] = {}
        for _, m in self.entries(d):
            out.update(zip(m.hf, m.shapes))
        return out


_TIED_OUTPUT = Rule(("output_layer.weight",), (("model.embed_tokens.weight", "V,H"),), VOCAB)

_TOP = (
    Rule(("embedding.word_embeddings.weight",), (("model.embed_tokens.weight", "V,H"),), VOCAB),
    Rule(("output_layer.weight",), (("lm_head.weight", "V,H"),), VOCAB),
)

_INPUT_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
               "self_attention.in_proj.layer_norm_weight")
_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")

_MLP = (
    Rule(("mlp.linear_fc1.weight",), (("mlp.gate_proj.weight", "F,H"), ("mlp.up_proj.weight", "F,H")), GLU,
         when=_dense),
    Rule(("mlp.linear_fc2.weight",), (("mlp.down_proj.weight", "H,F"),), ROW, when=_dense),
    Rule(("mlp.router.weight",), (("mlp.gate.weight", "E,H"),), ROUTER, when=_moe),
    Rule(("mlp.router.expert_bias",), (("mlp.gate.e_score_correction_bias", "E"),), FP32,
         when=lambda d: d.E > 0 and d.expert_bias),
    Rule(("mlp.experts.local_experts.{e}.linear_fc1.weight", "mlp.experts.linear_fc1.weight{e}"),
         (("mlp.experts.{e}.gate_proj.weight", "Fe,H"), ("mlp.experts.{e}.up_proj.weight", "Fe,H")), GLU, when=_moe),
    Rule(("mlp.experts.local_experts.{e}.linear_fc2.weight", "mlp.experts.linear_fc2.weight{e}"),
         (("mlp.experts.{e}.down_proj.weight", "H,Fe"),), ROW, when=_moe),
)

QWEN3 = Table("Qwen3", (Rule(("decoder.final_layernorm.weight",), (("model.norm.weight", "H"),), NORM),) + _TOP, (
    Rule(_INPUT_NORM, (("input_layernorm.weight", "H"),), NORM),
    Rule(("self_attention.linear_qkv.weight",), (("self_attn.q_proj.weight", "Q*D,H"),
                                                  ("self_attn.k_proj.weight", "G*D,H"),
                                                  ("self_attn.v_proj.weight", "G*D,H")), QKV),
    Rule(("self_attention.linear_qkv.bias",), (("self_attn.q_proj.bias", "Q*D"), ("self_attn.k_proj.bias", "G*D"),
                                                ("self_attn.v_proj.bias", "G*D")), QKV, listed=lambda d: d.qkv_bias),
    Rule(("self_attention.linear_proj.weight",), (("self_attn.o_proj.weight", "H,Q*D"),), ROW),
    Rule(("self_attention.q_layernorm.weight",), (("self_attn.q_norm.weight", "D"),), NORM),
    Rule(("self_attention.k_layernorm.weight",), (("self_attn.k_norm.weight", "D"),), NORM),
    Rule(_MLP_NORM, (("post_attention_layernorm.weight", "H"),), NORM),
) + _MLP, unknown="no HF mapping for Megatron parameter")
"""``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``."""

_FULL, _LINEAR = "full_attention", "linear_attention"

QWEN3_HYBRID = Table(
    "Qwen3-Next", (Rule(("decoder.final_layernorm.weight",), (("model.norm.weight", "H"),), CENTERED_NORM),) + _TOP, (
        Rule(_INPUT_NORM, (("input_layernorm.weight", "H"),), CENTERED_NORM),
        Rule(("self_attention.linear_qkv.weight",), (("self_attn.q_proj.weight", "2*Q*D,H"),
                                                      ("self_attn.k_proj.weight", "G*D,H"),
                                                      ("self_attn.v_proj.weight", "G*D,H")), GATED_QKV, layer=_FULL),
        Rule(("self_attention.linear_proj.weight",), (("self_attn.o_proj.weight", "H,Q*D"),), ROW, layer=_FULL),
        Rule(("self_attention.q_layernorm.weight",), (("self_attn.q_norm.weight", "D"),), CENTERED_NORM, layer=_FULL),
        Rule(("self_attention.k_layernorm.weight",), (("self_attn.k_norm.weight", "D"),), CENTERED_NORM, layer=_FULL),
        Rule(("self_attention.in_proj.weight",), (("linear_attn.in_proj_qkvz.weight", "2*Nk*Dk+2*Nv*Dv,H"),
                                                  ("linear_attn.in_proj_ba.weight", "2*Nv,H")), GDN_IN_PROJ,
             layer=_LINEAR, when=lambda d: d.gdn_layout != "qwen3_5"),
        Rule(("self_attention.in_proj.weight",), (("linear_attn.in_proj_qkv.weight", "2*Nk*Dk+Nv*Dv,H"),
                                                  ("linear_attn.in_proj_z.weight", "Nv*Dv,H"),
                                                  ("linear_attn.in_proj_b.weight", "Nv,H"),
                                                  ("linear_attn.in_proj_a.weight", "Nv,H")), GDN_IN_PROJ,
             layer=_LINEAR, when=lambda d: d.gdn_layout == "qwen3_5"),
        Rule(("self_attention.conv1d.weight",), (("linear_attn.conv1d.weight", "2*Nk*Dk+Nv*Dv,1,W"),), GDN_CONV,
             layer=_LINEAR),
        Rule(("self_attention.A_log",), (("linear_attn.A_log", "Nv"),), COL, layer=_LINEAR),
        Rule(("self_attention.dt_bias",), (("linear_attn.dt_bias", "Nv"),), COL, layer=_LINEAR),
        Rule(("self_attention.out_norm.weight",), (("linear_attn.norm.weight", "Dv"),), NORM, layer=_LINEAR),
        Rule(("self_attention.out_proj.weight",), (("linear_attn.out_proj.weight", "H,Nv*Dv"),), ROW, layer=_LINEAR),
        Rule(_MLP_NORM, (("post_attention_layernorm.weight", "H"),), CENTERED_NORM),
    ) + _MLP + (
        Rule(("mlp.shared_experts.linear_fc1.weight",), (("mlp.shared_expert.gate_proj.weight", "Fs,H"),
                                                         ("mlp.shared_expert.up_proj.weight", "Fs,H")), GLU,
             when=lambda d: d.E > 0 and d.Fs > 0),
        Rule(("mlp.shared_experts.linear_fc2.weight",), (("mlp.shared_expert.down_proj.weight", "H,Fs"),), ROW,
             when=lambda d: d.E > 0 and d.Fs > 0),
        Rule(("mlp.shared_experts.gate_weight",), (("mlp.shared_expert_gate.weight", "1,H"),), REPLICATED,
             when=lambda d: d.E > 0 and d.Fs > 0),
    ), unknown="no HF Qwen3-Next mapping for Megatron parameter")
"""``Qwen3NextForCausalLM`` (``gdn_layout="qwen3_next"``) / ``Qwen3_5ForCausalLM`` (``"qwen3_5"``)."""


def table_for(d: Dims) -> Table:
    """:data:`QWEN3_HYBRID` for a model with ``layer_types``, else :data:`QWEN3`."""
    return QWEN3_HYBRID if d.layer_types is not None else QWEN3
