"""Megatron-Core integration of the tree Gated DeltaNet: :class:`TreeGatedDeltaNet`.

``TreeGatedDeltaNet`` subclasses Megatron-Core's ``GatedDeltaNet``
(``megatron.core.ssm.gated_delta_net``): same parameters (``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``out_norm``, ``out_proj``), same state dict and sharded checkpoint, same forward for
ordinary batches. When it receives :class:`GdnTreeParams` (a ``TreePackedSeqParams`` carrying a
:class:`harts.gdn.GdnPlan`) it runs the compact row of a forest: tree convolution by ancestor
gather and the recurrence in planned rounds with fp32 state handoff. Usage::

    spec = tree_gdn_spec(spec)            # in a layer spec / list of specs, before building
    # or, on a built model:
    apply_tree_gdn(model)                 # swaps GatedDeltaNet instances' class
    apply_harts(model)                    # tree attention + RoPE by depth for attention layers
    params = make_gdn_tree_params(forest, config=GdnTreeConfig(), backend="flex")
    out = tree_forward(model, forest, params=params)

Tensor parallelism works as in the base module (column-parallel ``in_proj`` gives local heads,
row-parallel ``out_proj`` reduces; with sequence parallelism pad the forest to a multiple of TP).
Context parallelism is refused by :func:`harts.megatron.check_tree_compatible`.

On CPU (no Triton) the base forward cannot run (FLA conv / l2norm are Triton kernels); there
ordinary batches run a plain-torch sequence path (sequential ``F.conv1d`` and the token-by-token
recurrence of :mod:`harts.gdn_reference`), which is the per-sequence oracle of the CPU tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

from harts.forest import Forest
from harts.gdn import (
    GdnConfigError,
    GdnPlan,
    GdnShapeError,
    GdnTreeConfig,
    build_gdn_plan,
    resolve_backend,
    tree_causal_conv1d,
    tree_causal_conv1d_fla,
    tree_gated_delta_rule,
)
from harts.gdn_graphs import GraphPool, RoundGraphs
from harts.gdn_reference import (
    causal_conv1d_reference,
    l2norm_reference,
    recurrent_gated_delta_rule_reference,
)
from harts.megatron import TreeIncompatibleError, TreePackedSeqParams, make_tree_params

__all__ = ["GdnTreeParams", "TreeGatedDeltaNet", "make_gdn_tree_params", "tree_gdn_spec", "apply_tree_gdn",
           "gdn_layer_spec", "hybrid_block_spec"]


@dataclass
class GdnTreeParams(TreePackedSeqParams):
    """``TreePackedSeqParams`` plus the Gated DeltaNet plan (built once per microbatch)."""

    gdn_plan: GdnPlan | None = None
    """Rounds, replay rows and ancestor table of the forest."""
    gdn_backend: str = "auto"
    """Recurrence kernel, see :class:`harts.gdn.GdnTreeConfig`."""
    gdn_state_dtype: torch.dtype = torch.float32
    """Dtype of handed-off states."""
    gdn_graphs: RoundGraphs | None = None
    """CUDA graphs of the plan's FLA rounds, shared by the microbatch's GDN layers (``None``: eager);
    see :class:`harts.gdn_graphs.RoundGraphs`. One per microbatch: never share across plans."""


def make_gdn_tree_params(forest: Forest, *, config: GdnTreeConfig | None = None, backend: str = "flex",
                         block_size: int = 128) -> GdnTreeParams:
    """Tree metadata for a hybrid model: attention (``backend``: flex/varlen/dense) and GDN plan."""
    config = config or GdnTreeConfig()
    base = make_tree_params(forest, backend=backend, block_size=block_size)
    plan = build_gdn_plan(forest, chunk_size=config.chunk_size, align=config.align, conv_width=config.conv_width,
                          schedule=config.schedule)
    kw = {f.name: getattr(base, f.name) for f in fields(base)}
    return GdnTreeParams(**kw, gdn_plan=plan, gdn_backend=config.backend,
                         gdn_state_dtype=getattr(torch, config.state_dtype),
                         gdn_graphs=RoundGraphs(plan) if config.cuda_graphs else None)


def _split_qkv(mod: GatedDeltaNet, qkv: torch.Tensor, batch: int, seq_len: int):
    """``qkv [B, S, 2·H·K + HV·V]`` → ``q, k [B, S, H, K]`` (l2-normalized if the layer says so),
    ``v [B, S, HV, V]``.

    The tree path's (and the CPU sequence path's) replacement for ``GatedDeltaNet._prepare_input_for_gated_delta_rule``,
    with the same split, reshape and FLA ``l2norm`` on CUDA (the plain formula on CPU), but:

    * q and k keep their H key heads: FLA's kernels and :func:`harts.gdn.tree_gated_delta_rule` take
      HV > H (grouped value attention: value head j reads key head ``j // (HV/H)``, the head
      ``repeat_interleave`` would have put there), so the rounds gather and copy half the q/k bytes at
      Qwen3-Next widths (H = 16, HV = 32) and the repeat's kernels and their backward are gone;
    * no ``torch.compile`` region: Megatron's breaks its graph around FLA's ``l2norm`` (a host probe
      timed it at 0.87 ms per layer forward; the tree step's wall clock did not move measurably
      without it, docs/benchmarks.md, harts_gdn 2026-12-03).
    """
    qk, value = torch.split(qkv, [2 * mod.qk_dim_local_tp, mod.v_dim_local_tp], dim=-1)
    qk = qk.reshape(batch, seq_len, -1, mod.key_head_dim)
    if mod.use_qk_l2norm:
        if qk.is_cuda:
            from fla.modules.l2norm import l2norm
            qk = l2norm(qk)
        else:
            qk = l2norm_reference(qk)
    n = mod.qk_dim_local_tp // mod.key_head_dim
    query, key = torch.split(qk, [n, n], dim=2)
    return query, key, value.reshape(batch, seq_len, -1, mod.value_head_dim)


def _plain_g_beta(a_log, dt_bias, alpha, beta):
    """``g = −exp(A_log)·softplus(α + dt_bias)`` (at least fp32), ``β = sigmoid(b)``."""
    a = alpha.to(torch.promote_types(alpha.dtype, torch.float32))
    return -a_log.exp() * F.softplus(a + dt_bias), beta.sigmoid()


def _plain_gated_norm(mod: GatedDeltaNet, x, gate):
    dtype = x.dtype
    y = mod.out_norm(x.reshape(-1, x.shape[-1]))
    gate = gate.reshape(-1, gate.shape[-1])
    return (y * mod.act_fn(gate.to(torch.promote_types(gate.dtype, torch.float32)))).to(dtype)


class TreeGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` that also runs tree-packed batches (:class:`GdnTreeParams`)."""

    _harts_tree_gdn = True

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None, **kwargs):
        """``hidden_states [S, B, H]`` → ``(out [S, B, H], bias)``; tree path for :class:`GdnTreeParams`."""
        if isinstance(packed_seq_params, GdnTreeParams):
            if inference_context is not None or inference_params is not None:
                raise TreeIncompatibleError("TreeGatedDeltaNet: inference contexts are not supported on trees")
            return self._mix(hidden_states, packed_seq_params)
        if isinstance(packed_seq_params, TreePackedSeqParams):
            raise TreeIncompatibleError(
                "TreeGatedDeltaNet got TreePackedSeqParams without a GDN plan; build the microbatch metadata with "
                "harts.gdn_megatron.make_gdn_tree_params(forest, ...)")
        if hidden_states.is_cuda or packed_seq_params is not None or inference_context is not None:
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)
        return self._mix(hidden_states, None)

    def _graphs_pool(self, device: torch.device) -> GraphPool:
        """Memory pool for the FLA round graphs of the microbatches this layer is the first GDN layer
        of: kept across microbatches, so each one's captures reuse the blocks of the one before
        (:mod:`harts.gdn_graphs`); it keeps the largest microbatch's graph memory reserved."""
        pool = getattr(self, "_harts_graphs_pool", None)
        if pool is None:
            pool = self._harts_graphs_pool = GraphPool(device)
        return pool

    # -- shared body ---------------------------------------------------------------------------
    def _mix(self, hidden_states: torch.Tensor, psp: GdnTreeParams | None):
        """Base-module math with the conv and recurrence replaced (tree) or plain torch (CPU sequences).

        ``psp`` None: every batch column of ``hidden_states [S, B, H]`` is one sequence.
        """
        if self.cp_size > 1:
            raise TreeIncompatibleError(f"TreeGatedDeltaNet: context_parallel_size={self.cp_size} is not supported")
        if self.recompute_norm_out:
            raise TreeIncompatibleError("TreeGatedDeltaNet: selective recompute 'gdn_norm_out' is not supported; "
                                        "use full-layer recomputation")
        qkvzba, _ = self.in_proj(hidden_states)
        qkvzba = qkvzba.transpose(0, 1)  # [B, S, D]
        batch, seq_len = qkvzba.shape[:2]
        if psp is not None and batch != 1:
            raise GdnShapeError(f"tree GDN expects one packed row (b = 1), got b={batch}")
        if psp is not None and seq_len != psp.gdn_plan.num_nodes:
            raise GdnShapeError(f"tree GDN: {seq_len} rows after in_proj but the plan has T={psp.gdn_plan.num_nodes}")
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
        weight = self.conv1d.weight.squeeze(1)  # [D, W]
        bias = self.conv1d.bias if self.conv_bias else None
        if psp is not None:
            # deterministic_mode: the base module swaps FLA for torch kernels; so does the tree path
            backend = "torch" if psp.gdn_backend == "auto" and self.config.deterministic_mode else psp.gdn_backend
            anc = psp.gdn_plan.anc
            if anc.shape[1] < weight.shape[1]:
                raise GdnConfigError(f"GdnTreeConfig.conv_width={anc.shape[1]} is smaller than the layer's "
                                     f"linear_conv_kernel_dim={weight.shape[1]}")
            if resolve_backend(backend, qkv.device) == "fla":  # FLA's conv kernels, trie context as state
                qkv = tree_causal_conv1d_fla(qkv[0], weight, bias, plan=psp.gdn_plan, activation=self.activation)[None]
            else:
                qkv = tree_causal_conv1d(qkv[0], weight, bias, anc=anc, activation=self.activation)[None]
        else:
            qkv = causal_conv1d_reference(qkv, weight, bias, activation=self.activation)
        fast = qkv.is_cuda
        query, key, value = _split_qkv(self, qkv, batch, seq_len)
        g_beta = self._compute_g_and_beta if fast else _plain_g_beta
        g, beta = g_beta(self.A_log, self.dt_bias, alpha, beta)
        if psp is not None:
            if psp.gdn_graphs is not None and psp.gdn_graphs.pool is None and qkv.is_cuda:
                psp.gdn_graphs.pool = self._graphs_pool(qkv.device)
            o = tree_gated_delta_rule(query[0], key[0], value[0], g[0], beta[0], plan=psp.gdn_plan,
                                      backend=backend, state_dtype=psp.gdn_state_dtype,
                                      graphs=psp.gdn_graphs)[None]
        else:
            o, _ = recurrent_gated_delta_rule_reference(query, key, value, g, beta)
            o = o.to(value.dtype)
        if fast:
            norm = self._apply_gated_norm(o, gate)
        else:
            norm = _plain_gated_norm(self, o, gate)
        norm = norm.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        return self.out_proj(norm)


def tree_gdn_spec(spec):
    """Copy of a layer spec (or list of specs / block submodules) with ``GatedDeltaNet`` mixers
    replaced by :class:`TreeGatedDeltaNet`. Other modules are untouched."""
    spec = copy.deepcopy(spec)

    def visit(s):
        sa = getattr(getattr(s, "submodules", None), "self_attention", None)
        if sa is not None and getattr(sa, "module", None) is GatedDeltaNet:
            sa.module = TreeGatedDeltaNet

    items = spec if isinstance(spec, list) else getattr(spec, "layer_specs", None) or [spec]
    for s in items:
        visit(s)
    return spec


def apply_tree_gdn(model: torch.nn.Module) -> int:
    """Swap the class of every ``GatedDeltaNet`` inside ``model`` to :class:`TreeGatedDeltaNet`
    (state dicts unchanged). Returns the number of modules swapped."""
    n = 0
    for m in model.modules():
        if type(m) is GatedDeltaNet:
            m.__class__ = TreeGatedDeltaNet
            n += 1
    return n


def gdn_layer_spec(*, normalization: str = "RMSNorm", tree: bool = True, num_experts: int | None = None):
    """A ``TransformerLayer`` spec with a (Tree)GatedDeltaNet mixer from local (non-TE) modules:
    separate input RMSNorm, column-parallel ``in_proj``, row-parallel ``out_proj``, SwiGLU MLP
    (dense, or ``num_experts`` routed experts). Megatron's own GDN spec needs Transformer Engine;
    this one runs on CPU and GPU alike."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization=normalization)
    norm = spec.submodules.input_layernorm
    spec.submodules.self_attention = ModuleSpec(
        module=TreeGatedDeltaNet if tree else GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))
    return spec


def hybrid_block_spec(pattern: str, *, normalization: str = "RMSNorm", num_experts: int | None = None):
    """``TransformerBlockSubmodules`` for a hybrid stack: ``pattern`` has one letter per layer,
    ``G`` = (Tree)GatedDeltaNet layer, ``A`` = softmax-attention layer (local modules), e.g.
    ``"GGGA"`` for Qwen3-Next's 3:1 interleave; ``num_experts``: routed-expert MLPs in every layer.
    Pass it as ``GPTModel(transformer_layer_spec=...)``; under pipeline parallelism pass only
    this stage's letters."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    bad = sorted(set(pattern) - {"G", "A"})
    if not pattern or bad:
        raise GdnConfigError(f"pattern must be a non-empty string of 'G'/'A', got {pattern!r}")
    attn = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization=normalization)
    layers = [gdn_layer_spec(normalization=normalization, num_experts=num_experts) if c == "G" else copy.deepcopy(attn)
              for c in pattern]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=attn.submodules.input_layernorm)
