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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from colocate.config import HFModelSpec

__all__ = [
    "ConversionError",
    "ParamMismatchError",
    "split_qkv",
    "merge_qkv",
    "merge_tp_shards",
    "globalize_name",
    "megatron_to_hf",
    "hf_param_specs",
    "check_params",
    "ROUTER_DTYPES",
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


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's grouped ``linear_qkv`` weight [G·(Q/G+2)·D, H] (or bias [G·(Q/G+2)·D])
    into q [Q·D, ...], k [G·D, ...], v [G·D, ...]."""
    per = num_heads // num_groups
    rows = num_groups * (per + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ConversionError(f"linear_qkv has {qkv.shape[0]} rows, expected G·(Q/G+2)·D = {rows} "
                              f"(Q={num_heads}, G={num_groups}, D={head_dim})")
    tail = qkv.shape[1:]
    g = qkv.reshape(num_groups, (per + 2) * head_dim, *tail)
    q = g[:, : per * head_dim].reshape(num_heads * head_dim, *tail)
    k = g[:, per * head_dim: (per + 1) * head_dim].reshape(num_groups * head_dim, *tail)
    v = g[:, (per + 1) * head_dim:].reshape(num_groups * head_dim, *tail)
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


def megatron_to_hf(name: str, tensor: torch.Tensor, *, spec: HFModelSpec) -> list[tuple[str, torch.Tensor]]:
    """Map one global, TP-merged Megatron parameter to its HF name(s) and layout(s).

    Returns views where possible (no copy); ``[]`` for parameters the receiver does not take
    (``output_layer.weight`` under tied embeddings). Raises :class:`ConversionError` on an
    unknown name.
    """
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
        q, k, v = split_qkv(tensor, num_heads=spec.num_attention_heads, num_groups=spec.num_query_groups,
                            head_dim=spec.head_dim)
        return [(f"{pre}self_attn.{p}_proj.{kind}", t) for p, t in (("q", q), ("k", k), ("v", v))]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(pre + "mlp.gate_proj.weight", gate), (pre + "mlp.up_proj.weight", up)]
    if rest == "mlp.router.weight":
        out = tensor if spec.router_dtype is None else tensor.to(ROUTER_DTYPES[spec.router_dtype])
        return [(pre + "mlp.gate.weight", out)]
    if rest == "mlp.router.expert_bias":
        return [(pre + "mlp.gate.e_score_correction_bias", tensor.to(torch.float32))]
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
