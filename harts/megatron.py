"""Megatron-Core integration: tree attention by module substitution, RoPE by trie depth, and a
forward driver returning edge log-probs / entropies through the tree-aware chunked LM head.

The only module of ``harts`` importing ``megatron.core``. Usage::

    model = model_provider()            # any GPTModel (local or TE layer spec)
    apply_harts(model)                  # swap core attention classes, hook RoPE-by-depth
    out = tree_forward(model, forest)   # (logp [T], entropy [T]) on the last pipeline stage

What is substituted:

* every ``core_attention`` module (``DotProductAttention``, ``TEDotProductAttention``...) gets a
  subclass whose ``forward`` runs :func:`harts.attention.tree_attention` when it receives
  :class:`TreePackedSeqParams`, and the original code otherwise (state dicts are unchanged);
* a forward pre-hook on ``model.decoder`` replaces the rotary table ``[S, 1, 1, d]`` that
  ``GPTModel._preprocess`` builds for positions ``0..S-1`` (ignoring ``position_ids``) by
  ``table[depth]``. For ``mrope`` the model honours ``position_ids``; :func:`tree_forward`
  passes depth repeated over the three sections.

Tree metadata travels inside ``packed_seq_params`` (only O(T) tensors plus the BlockMask built
once per microbatch), which Megatron forwards unchanged to every layer, also under full
activation recomputation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from harts.attention import build_block_mask, build_varlen_plan, tree_attention
from harts.batch import TreeBatch, plan_tree_batch
from harts.config import AttentionBackend, HeadConfig, PlannerConfig
from harts.errors import TreeIncompatibleError  # noqa: F401 (re-exported)
from harts.forest import Forest, TokenOutOfRangeError
from harts.gdn import GdnTreeConfig
from harts.lm_head import HeadEdges, TreeHeadOutput, head_edges, tree_lm_head
from harts.prefix import SharedPrefixBatch
from harts.upload import upload
from harts.varlen import VarlenMode
from mcore_distill.errors import ConfigTypeError
from mcore_distill.validate import check_choice

__all__ = ["TreePackedSeqParams", "TreeIncompatibleError", "check_tree_compatible", "tree_core_attention_class",
           "tree_layer_spec", "apply_harts", "HartsHandle", "make_tree_params", "tree_forward", "PrefixContext",
           "SharedParams", "make_shared_params", "tree_shared_step", "TreeScores", "tree_logprobs"]



@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` carrying tree metadata (``qkv_format`` stays ``'sbhd'``: one row, b = 1)."""

    tree_last: torch.Tensor | None = None
    """[T] end of each node's pre-order subtree."""
    tree_depth: torch.Tensor | None = None
    """[T] trie depth = RoPE position."""
    tree_backend: str = "flex"
    """An :class:`~harts.config.AttentionBackend` name: 'flex', 'varlen' or 'dense' (tests)."""
    block_mask: object = None
    """FlexAttention BlockMask, built once per microbatch."""
    varlen_plan: object = None
    """:class:`harts.attention.VarlenPlan` (varlen backend), built once per microbatch."""
    head_edges: HeadEdges | None = None
    """Out-edges for the tree LM head (:func:`harts.lm_head.head_edges`), built once per microbatch."""
    max_token: int | None = None
    """Largest token id of the microbatch (host int; checked against the vocabulary without a sync)."""
    prefix_context: PrefixContext | None = None
    """Shared-prefix groups (:func:`tree_shared_step`): records the prefix microbatch's keys/values,
    or feeds them to a part's attention as ``context_rows`` leading key rows."""
    context_rows: int = 0
    """Key rows in front of this microbatch's own (a part of a shared-prefix group: the prefix length)."""

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format == "thd":
            raise ValueError("TreePackedSeqParams uses qkv_format='sbhd' (one packed row), got 'thd'")
        super().__post_init__()


def check_tree_compatible(config) -> None:
    """Raise :class:`TreeIncompatibleError` for configs that cannot be tree-executed exactly."""
    cp = getattr(config, "context_parallel_size", 1)
    if cp > 1:
        raise TreeIncompatibleError(f"context_parallel_size={cp}: tree packing does not support context parallelism")
    if getattr(config, "num_moe_experts", None) and getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise TreeIncompatibleError(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor}: token-dropping MoE routes shared "
            "tokens differently from per-sequence execution; use dropless MoE (capacity factor None)")
    if getattr(config, "multi_latent_attention", False):
        raise TreeIncompatibleError("multi_latent_attention=True is not supported by harts tree attention")
    mtp = getattr(config, "mtp_num_layers", None)
    if mtp:
        raise TreeIncompatibleError(f"mtp_num_layers={mtp}: multi-token-prediction labels cross forks in a tree")
    st = getattr(config, "softmax_type", "vanilla")
    if st != "vanilla":
        raise TreeIncompatibleError(f"softmax_type={st!r}: tree attention implements only 'vanilla' softmax")


class PrefixContext:
    """Keys and values of a shared prefix, per attention layer, kept across the parts below it.

    While recording (the prefix microbatch's forward) each tree core attention stores the first
    ``rows`` rows of its keys and values (after RoPE; graph-connected). :meth:`freeze` turns them
    into leaves (detached views, ``requires_grad``) that every part's attention puts in front of
    its own keys, so the parts' key/value gradients accumulate in their ``.grad``;
    :meth:`backward_roots` pairs the recorded tensors with those gradients for the prefix backward.
    """

    def __init__(self, rows: int):
        self.rows = rows
        self._kv: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self._leaves: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._acc: dict[tuple[torch.nn.Module, int], torch.Tensor] = {}

    def record(self, layer: torch.nn.Module, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._leaves is not None:
            raise RuntimeError("PrefixContext is frozen: the prefix microbatch ran twice")
        self._kv[layer] = (k[:self.rows], v[:self.rows])

    def freeze(self) -> None:
        self._leaves = {m: tuple(x.detach().requires_grad_(x.requires_grad) for x in kv) for m, kv in self._kv.items()}

    def context(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if self._leaves is None or layer not in self._leaves:
            raise RuntimeError("no recorded prefix keys/values for this attention layer: run the prefix microbatch "
                               "first (harts.megatron.tree_shared_step)")
        return self._leaves[layer]

    def collect(self) -> None:
        """Move the leaves' gradients (one part's) into fp32 accumulators: the parts' key/value
        gradients of a bf16 model add up in fp32 and are rounded once, as the copies' sum of
        the key gather is within one microbatch."""
        for m, leaves in self._leaves.items():
            for i, leaf in enumerate(leaves):
                if leaf.grad is not None:
                    g = leaf.grad.to(torch.promote_types(leaf.dtype, torch.float32))
                    acc = self._acc.get((m, i))
                    self._acc[(m, i)] = g if acc is None else acc.add_(g)
                    leaf.grad = None

    def backward_roots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The recorded keys/values and their accumulated gradients (after :meth:`collect`)."""
        roots, grads = [], []
        for (m, i), g in self._acc.items():
            x = self._kv[m][i]
            roots.append(x)
            grads.append(g.to(x.dtype))
        return roots, grads


def _tree_forward(self, query, key, value, psp: TreePackedSeqParams):
    """query [T, 1, Hq, D], key/value [T, 1, Hkv, D] → [T, 1, Hq·D]."""
    if query.shape[1] != 1:
        raise ValueError(f"tree attention expects micro-batch size 1 (one packed row), got b={query.shape[1]}")
    scale = getattr(self, "softmax_scale", None)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if isinstance(self, DotProductAttention) and getattr(self.config, "apply_query_key_layer_scaling", False):
        scale = scale * self.layer_number  # the local class divides its scale by the layer number
    k, v = key[:, 0], value[:, 0]
    ctx = psp.prefix_context
    if psp.context_rows:  # a part of a shared-prefix group: the prefix's keys/values come first
        if ctx is None:
            raise ValueError(f"context_rows={psp.context_rows} but no prefix_context: run parts through "
                             "harts.megatron.tree_shared_step")
        kp, vp = ctx.context(self)
        k, v = torch.cat([kp, k]), torch.cat([vp, v])
    elif ctx is not None:  # the prefix microbatch of a shared-prefix group
        ctx.record(self, k, v)
    out = tree_attention(query[:, 0], k, v, last=psp.tree_last, scale=scale, backend=psp.tree_backend,
                         block_mask=psp.block_mask, varlen_plan=psp.varlen_plan, context_rows=psp.context_rows)
    return out.reshape(out.shape[0], 1, -1)


def tree_core_attention_class(base: type) -> type:
    """Subclass of a core-attention class that runs tree attention for :class:`TreePackedSeqParams`."""
    if getattr(base, "_harts_tree", False):
        return base

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if isinstance(packed_seq_params, TreePackedSeqParams):
            if attention_bias is not None:
                raise ValueError("attention_bias is not supported with tree attention")
            return _tree_forward(self, query, key, value, packed_seq_params)
        return base.forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)

    return type(f"Tree{base.__name__}", (base,), {"forward": forward, "_harts_tree": True, "__module__": __name__})


def tree_layer_spec(spec):
    """Copy of a ``TransformerLayer`` ``ModuleSpec`` with a tree-capable core attention."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    sub = getattr(attn, "submodules", None)
    core = getattr(sub, "core_attention", None)
    if core is None:
        raise ValueError("layer spec has no submodules.self_attention.submodules.core_attention")
    if isinstance(core, ModuleSpec):
        core.module = tree_core_attention_class(core.module)
    else:
        sub.core_attention = tree_core_attention_class(core)
    return spec


def _depth_rope_hook(module, args, kwargs):
    psp = kwargs.get("packed_seq_params")
    emb = kwargs.get("rotary_pos_emb")
    if isinstance(psp, TreePackedSeqParams) and emb is not None and psp.tree_depth is not None:
        d = psp.tree_depth
        kwargs["rotary_pos_emb"] = tuple(e.index_select(0, d) for e in emb) if isinstance(emb, tuple) \
            else emb.index_select(0, d)
    return args, kwargs


class HartsHandle:
    """Undo handle returned by :func:`apply_harts`."""

    def __init__(self):
        self._hooks = []
        self._swapped: list[tuple[torch.nn.Module, type]] = []
        self._hooked: list[torch.nn.Module] = []

    def remove(self) -> None:
        """Remove the RoPE hooks and restore the original core-attention classes."""
        for h in self._hooks:
            h.remove()
        for m, cls in self._swapped:
            m.__class__ = cls
        for m in self._hooked:
            del m._harts_hooked
        self._hooks.clear()
        self._swapped.clear()
        self._hooked.clear()


def _gpt_models(model: torch.nn.Module):
    """The GPTModel-like modules inside ``model`` (remembered on ``model``: ``tree_forward`` runs
    once per microbatch and would otherwise walk every module each time)."""
    found = model.__dict__.get("_harts_gpt_models")
    if found is None:
        found = [m for m in model.modules() if hasattr(m, "decoder") and hasattr(m, "position_embedding_type")]
        model.__dict__["_harts_gpt_models"] = found
    return found


def apply_harts(model: torch.nn.Module, *, check: bool = True) -> HartsHandle:
    """Enable tree execution on a built model (GPTModel, possibly wrapped in DDP/Float16Module).

    Swaps every ``core_attention`` module's class for :func:`tree_core_attention_class`, every
    Megatron ``GatedDeltaNet`` for :class:`harts.gdn_megatron.TreeGatedDeltaNet`, and hooks
    RoPE-by-depth into each ``GPTModel.decoder``. Idempotent; non-tree batches run unchanged.
    """
    handle = HartsHandle()
    gpts = _gpt_models(model)
    if not gpts:
        raise ValueError(f"apply_harts: no GPTModel-like module (with .decoder) inside {type(model).__name__}")
    for g in gpts:
        if check:
            check_tree_compatible(g.config)
        if g.position_embedding_type in ("rope", "yarn") and not getattr(g.decoder, "_harts_hooked", False):
            handle._hooks.append(g.decoder.register_forward_pre_hook(_depth_rope_hook, with_kwargs=True))
            g.decoder._harts_hooked = True
            handle._hooked.append(g.decoder)
    for m in model.modules():
        core = getattr(m, "core_attention", None)
        if isinstance(core, torch.nn.Module) and not getattr(type(core), "_harts_tree", False):
            handle._swapped.append((core, type(core)))
            core.__class__ = tree_core_attention_class(type(core))
        if _is_plain_gdn(m):
            from harts.gdn_megatron import TreeGatedDeltaNet

            handle._swapped.append((m, type(m)))
            m.__class__ = TreeGatedDeltaNet
    return handle


def _is_plain_gdn(m: torch.nn.Module) -> bool:
    """Megatron's own ``GatedDeltaNet`` (checked by name: importing it here would pull in FLA)."""
    t = type(m)
    return t.__name__ == "GatedDeltaNet" and t.__module__.startswith("megatron.core.ssm.gated_delta_net")




def make_tree_params(forest: Forest, *, backend: AttentionBackend | str = AttentionBackend.flex,
                     block_size: int = 128, varlen_mode: VarlenMode = "auto", save_gathered_kv: bool = False,
                     context_rows: int = 0, model: torch.nn.Module | None = None,
                     gdn: GdnTreeConfig | None = None) -> TreePackedSeqParams:
    """Per-microbatch tree metadata, built once (ahead of the step, e.g. in the data loader): the
    flex BlockMask or varlen plan (``varlen_mode``, ``save_gathered_kv``, ``context_rows``: see
    :func:`harts.varlen.build_varlen_plan`; ``context_rows`` > 0 for a part of a shared-prefix
    group, which needs ``backend="varlen"``), the LM head's edge list and host-side sizes, so the
    forward/backward parts that harts owns need no device-to-host synchronization.

    With ``model`` given, a model holding tree Gated DeltaNet layers (after :func:`apply_harts`)
    gets :func:`harts.gdn_megatron.make_gdn_tree_params` (the GDN plan too, with ``gdn`` or by
    default the layers' conv width and, for fp64 layers, fp64 states), any other model the
    attention metadata: the caller never picks between the two."""
    backend = check_choice("backend", backend, AttentionBackend, error=ValueError)
    if context_rows and backend != AttentionBackend.varlen:
        raise TreeIncompatibleError(f"context_rows={context_rows} (a shared-prefix part) needs backend='varlen', "
                                    f"got {backend.value!r}")
    mixers = [] if model is None else [m for m in model.modules() if getattr(type(m), "_harts_tree_gdn", False)]
    if mixers:
        if context_rows:
            raise TreeIncompatibleError("context_rows (shared-prefix groups) is not supported with Gated DeltaNet layers")
        from harts.gdn_megatron import make_gdn_tree_params

        if gdn is None:
            fp64 = any(p.dtype == torch.float64 for m in mixers for p in m.parameters())
            gdn = GdnTreeConfig(conv_width=max(int(m.conv1d.weight.shape[-1]) for m in mixers),
                                state_dtype="float64" if fp64 else "float32")
        return make_gdn_tree_params(forest, config=gdn, backend=backend, block_size=block_size)
    h = forest.host
    bm = build_block_mask(forest.last, block_size=block_size) if backend == AttentionBackend.flex else None
    vp = build_varlen_plan(*((h["seg_offsets"], h["seg_parent"]) if h else (forest.seg_offsets, forest.seg_parent)),
                           mode=varlen_mode, save_gathered_kv=save_gathered_kv, context_rows=context_rows,
                           device=forest.tokens.device) if backend == AttentionBackend.varlen else None
    if h is not None:  # host copies: no device-to-host synchronization at all
        top = [int(h["depth"].max()), int(h["tokens"].max())]
        edges = _head_edges_host(forest.tokens, h["parent"])
    else:
        top = torch.stack([forest.depth.max(), forest.tokens.max()]).tolist()  # one device-to-host copy
        edges = head_edges(forest.tokens, forest.parent)
    rope_len = top[0] + 1  # the RoPE table only needs positions 0..max depth
    return TreePackedSeqParams(tree_last=forest.last, tree_depth=forest.depth, tree_backend=backend.value,
                               block_mask=bm, varlen_plan=vp, max_seqlen_q=rope_len, max_seqlen_kv=rope_len,
                               head_edges=edges, max_token=top[1], context_rows=context_rows)


def _head_edges_host(tokens: torch.Tensor, parent: np.ndarray) -> HeadEdges:
    """:func:`harts.lm_head.head_edges` from the host copy of ``parent`` (the same edges, offsets
    and device CSR ``row_ptr``, uploaded in one non-blocking copy; the tokens are gathered on their
    device). Without ``row_ptr`` the head would copy the offsets itself, a pageable copy that waits
    for the GPU once per microbatch."""
    child = np.flatnonzero(parent >= 0)
    child = child[np.argsort(parent[child], kind="stable")]
    e_parent = parent[child]
    off = np.searchsorted(e_parent, np.arange(parent.size + 1))
    child_d, parent_d, off_d = upload([child, e_parent, off], tokens.device)
    return HeadEdges(child=child_d, parent=parent_d, token=tokens.index_select(0, child_d), offsets=tuple(off.tolist()),
                     row_ptr=off_d.to(torch.int32))


def real_vocab_rows(weight: torch.Tensor, vocab_size: int | None, group=None) -> tuple[torch.Tensor, int]:
    """This rank's output rows of the real vocabulary and the first vocab id they hold: a padded
    vocabulary (rows ``≥ vocab_size``, Megatron's padding) is cut from the shard, so those
    entries leave the softmax as in the HF model. ``weight`` is the vocab-parallel shard ``[V/TP, H]``."""
    local = weight.shape[0]
    start = local * (dist.get_rank(group) if group is not None else 0)
    if vocab_size is None or vocab_size >= start + local:
        return weight, start
    keep = vocab_size - start
    if keep <= 0:
        raise TreeIncompatibleError(f"vocab_size={vocab_size}: this tensor-parallel rank's output rows "
                                    f"[{start}, {start + local}) are all padding; the tree LM head needs at least "
                                    "one real row per rank (pad the vocabulary less, or use a smaller TP size)")
    return weight[:keep], start


def _head_processor(forest: Forest, edges: HeadEdges | None, chunk_size: int, temperature: float,
                    entropy_requires_grad: bool, vocab_size: int | None = None):
    def processor(*, hidden_states, output_layer, output_weight, config, **_):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if getattr(config, "use_mup", False):
            raise TreeIncompatibleError("use_mup=True: logit scaling is not applied by the tree LM head")
        weight = output_weight if output_weight is not None else output_layer.weight
        group = getattr(output_layer, "tp_group", None)
        sp = bool(getattr(output_layer, "sequence_parallel", False)) and group is not None and group.size() > 1
        h = hidden_states
        if sp:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
        if h.shape[1] != 1:
            raise ValueError(f"tree forward expects one packed row (b = 1), got hidden {tuple(h.shape)}")
        tp = group if group is not None and group.size() > 1 else None
        weight, start = real_vocab_rows(weight, vocab_size, tp)
        return tree_lm_head(h[:, 0], weight, forest.tokens, forest.parent, chunk_size=chunk_size,
                            temperature=temperature, tp_group=tp, vocab_start=start,
                            entropy_requires_grad=entropy_requires_grad, reduce_grad_input=not sp, edges=edges)

    return processor


def tree_forward(model: torch.nn.Module, forest: Forest, *, params: TreePackedSeqParams | None = None,
                 backend: AttentionBackend | str = AttentionBackend.flex, temperature: float = 1.0,
                 chunk_size: int = 1024, entropy_requires_grad: bool = False, vocab_size: int | None = None,
                 head: HeadConfig | None = None) -> TreeHeadOutput | torch.Tensor:
    """Run ``model`` (after :func:`apply_harts`) on the compact row of ``forest``.

    Returns ``(logp [T], entropy [T])`` on the last pipeline stage (see
    :func:`harts.loss.sequence_logprobs` for per-sequence vectors) and the hidden states on
    other stages. ``params`` defaults to :func:`make_tree_params` for this model (attention or
    Gated DeltaNet metadata; pass it to reuse a BlockMask). A model that is not tree-capable yet
    gets :func:`apply_harts` first (a model run on a packed row without it would attend causally
    across sequences).
    ``vocab_size``: the real vocabulary of a model whose output layer is padded
    (:attr:`~harts.config.HeadConfig.vocab_size`). ``head`` (a :class:`~harts.config.HeadConfig`),
    when given, overrides the five keyword options.
    """
    if head is not None:
        backend, temperature, chunk_size = head.backend, head.temperature, head.chunk_size
        entropy_requires_grad, vocab_size = head.entropy_requires_grad, head.vocab_size
    gpts = _gpt_models(model)
    if not gpts:
        raise ValueError(f"tree_forward: no GPTModel inside {type(model).__name__}")
    if not _tree_capable(model):
        apply_harts(model)
    params = params or make_tree_params(forest, backend=backend, model=model)
    vocab = vocab_size if vocab_size is not None else getattr(gpts[0], "vocab_size", None)
    top = params.max_token if params.max_token is not None else int(forest.tokens.max())
    if vocab is not None and forest.num_nodes and top >= vocab:
        raise TokenOutOfRangeError(f"forest holds token id {top} >= model vocab_size {vocab}")
    depth = forest.depth[None]
    pos = depth.expand(3, 1, -1) if gpts[0].position_embedding_type == "mrope" else depth
    return model(forest.tokens[None], pos, None, packed_seq_params=params,
                 output_processor=_head_processor(forest, params.head_edges, chunk_size, temperature,
                                                  entropy_requires_grad, vocab_size))


@dataclass
class SharedParams:
    """Tree metadata of a shared-prefix group (:func:`make_shared_params`): the prefix microbatch's
    and each part's, built once ahead of the step like :func:`make_tree_params`."""

    prefix: TreePackedSeqParams
    parts: list[TreePackedSeqParams]


def make_shared_params(batch: SharedPrefixBatch, *, backend: AttentionBackend | str = AttentionBackend.varlen,
                       save_gathered_kv: bool = False) -> SharedParams:
    """:class:`SharedParams` of a :class:`~harts.prefix.SharedPrefixBatch` (varlen backend: the parts'
    attention reads the prefix's keys as context rows of the key gather). The prefix microbatch
    runs the cascade plan (``levels``): its lookahead rows are siblings below the whole prefix, and
    the key gather would copy the prefix's keys once per lookahead row (16 × 4,800 rows for a
    16-response group with a 4,800-token prompt) where the cascade reads them once."""
    if backend != AttentionBackend.varlen:
        raise TreeIncompatibleError(f"shared-prefix groups need backend='varlen', got {backend!r}")
    return SharedParams(prefix=make_tree_params(batch.prefix, backend=backend, varlen_mode="levels"),
                        parts=[make_tree_params(p.forest, backend=backend, context_rows=batch.prefix_len,
                                                save_gathered_kv=save_gathered_kv) for p in batch.parts])


def _check_shared(model: torch.nn.Module) -> None:
    for g in _gpt_models(model):
        cfg = g.config
        if getattr(cfg, "recompute_granularity", None) is not None:
            raise TreeIncompatibleError(
                f"recompute_granularity={cfg.recompute_granularity!r}: shared-prefix groups keep the prefix's "
                "autograd graph across the parts and need activation recomputation off")
        if getattr(cfg, "pipeline_model_parallel_size", 1) > 1:
            raise TreeIncompatibleError(f"pipeline_model_parallel_size={cfg.pipeline_model_parallel_size}: "
                                        "shared-prefix groups run on a single pipeline stage")


def tree_shared_step(model: torch.nn.Module, batch: SharedPrefixBatch, loss_fn, *,
                     params: SharedParams | None = None, temperature: float = 1.0, chunk_size: int = 1024,
                     entropy_requires_grad: bool = False, vocab_size: int | None = None) -> list[torch.Tensor]:
    """Forward and backward of a shared-prefix group (:mod:`harts.prefix`); gradients accumulate into
    the parameters' ``.grad`` / ``main_grad`` as for any microbatches. Returns the parts' losses (detached).

    ``loss_fn(part, logp, entropy) -> scalar`` gets a :class:`~harts.prefix.SharedPart` and its
    sequences' per-position vectors (``[Σ(L_i − 1)]`` each, offsets ``part.pred_offsets``, sequence
    of each entry ``part.pred_seq_ids``), as :func:`harts.loss.sequence_logprobs` /
    :func:`harts.loss.sequence_entropy` give them for a forest: any per-sequence objective works.

    Order: the prefix microbatch's forward (its graph is kept; its keys/values are recorded per
    attention layer); per part forward with those keys/values as leading key rows, the prefix's
    log-probs/entropies entering as leaves, the loss and its backward; then one backward of the
    prefix from the gradients collected on the leaves. Values and gradients equal per-sequence
    execution up to float reduction order. Needs the varlen backend, a single pipeline stage and
    activation recomputation off. ``vocab_size``: the real vocabulary of a padded output layer
    (:func:`tree_forward`).
    """
    _check_shared(model)
    params = params or make_shared_params(batch)
    ctx = PrefixContext(batch.prefix_len)
    kw = dict(temperature=temperature, chunk_size=chunk_size, entropy_requires_grad=entropy_requires_grad,
              vocab_size=vocab_size)
    out = tree_forward(model, batch.prefix, params=dataclasses.replace(params.prefix, prefix_context=ctx), **kw)
    ctx.freeze()
    lp_leaf = out.logp.detach().requires_grad_(out.logp.requires_grad)
    ent_leaf = out.entropy.detach().requires_grad_(out.entropy.requires_grad)
    losses = []
    for part, pp in zip(batch.parts, params.parts):
        o = tree_forward(model, part.forest, params=dataclasses.replace(pp, prefix_context=ctx), **kw)
        lp = torch.cat([lp_leaf, o.logp]).index_select(0, part.label_src)
        ent = torch.cat([ent_leaf, o.entropy]).index_select(0, part.row_src)
        loss = loss_fn(part, lp, ent)
        if loss.requires_grad:
            loss.backward()
            ctx.collect()
        losses.append(loss.detach())
    roots, grads = ctx.backward_roots()
    for x, leaf in ((out.logp, lp_leaf), (out.entropy, ent_leaf)):
        if leaf.grad is not None:
            roots.append(x)
            grads.append(leaf.grad)
    if roots:
        torch.autograd.backward(roots, grads)
    return losses


@dataclass(frozen=True, eq=False)
class TreeScores:
    """Result of :func:`tree_logprobs`: ``[B, L]`` tensors in the label layout of
    :mod:`harts.batch` (``logp[b, t]`` scores ``input_ids[b, t+1]``; 0 past ``lengths[b] − 1``)."""

    logp: torch.Tensor
    """[B, L] log-probs at the temperature, on the model's device (differentiable)."""
    entropy: torch.Tensor
    """[B, L] entropies of the predicting rows (differentiable with ``entropy_requires_grad``)."""
    batch: TreeBatch
    """The plan: micro-batches, compression C (``batch.compression``), rows."""


def tree_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, *,
                  temperature: float = 1.0, backend: AttentionBackend | str = AttentionBackend.flex,
                  planner: PlannerConfig | None = None, chunk_size: int = 1024,
                  entropy_requires_grad: bool = False, gdn: GdnTreeConfig | None = None,
                  forward_only: bool = False, pg_collection=None, vocab_size: int | None = None) -> TreeScores:
    """Score ``input_ids [B, L]`` (row ``b`` is ``input_ids[b, :lengths[b]]``) with a Megatron
    model as prefix trees: plan → tree forward → tree LM head → rows.

    1. :func:`harts.batch.plan_tree_batch`: micro-batches of at most ``planner.token_cap`` compact
       rows (default: one micro-batch, no padding), shared prefixes computed once;
    2. :func:`tree_forward` per micro-batch with :func:`make_tree_params` for this model (tree
       attention with ``backend``, Gated DeltaNet plans for hybrid models, ``gdn`` overriding
       their defaults; :func:`apply_harts` is applied first if the model is not tree-capable yet);
    3. :func:`harts.tree_lm_head` at ``temperature`` (chunks of ``chunk_size`` rows);
    4. every sequence's values written back to its row (label layout).

    Equals scoring each row on its own, up to float reduction order. By default the micro-batches
    run one after another through ``model(...)`` on this rank (pipeline size 1) and the result is
    differentiable: call ``backward`` on a loss of ``logp``. ``forward_only=True`` runs them
    through Megatron's forward-only schedule instead (no gradients; any pipeline size, with
    ``pg_collection``'s groups or the global ones; every micro-batch padded to the longest one
    unless the model config has ``variable_seq_lengths``); stages other than the last get zeros.
    ``vocab_size``: the real vocabulary of a padded output layer (:func:`tree_forward`).
    Inside a training ``forward_step_func`` use :func:`~harts.batch.plan_tree_batch`,
    :func:`tree_forward` and :meth:`~harts.batch.TreeMicrobatch.logprob_rows` per micro-batch.
    """
    gpts = _gpt_models(model)
    if not gpts:
        raise ConfigTypeError(f"tree_logprobs: model must be (or wrap) a Megatron GPTModel, got {type(model).__name__}")
    device = next(model.parameters()).device
    batch = plan_tree_batch(input_ids, lengths, config=planner, device=device)
    if forward_only:
        return _scheduled_scores(model, batch, temperature=temperature, backend=backend, chunk_size=chunk_size,
                                 gdn=gdn, pg_collection=pg_collection, vocab_size=vocab_size)
    logp, ent = [], []
    for mb in batch.microbatches:
        params = make_tree_params(mb.forest, backend=backend, model=model, gdn=gdn)
        out = tree_forward(model, mb.forest, params=params, temperature=temperature, chunk_size=chunk_size,
                           entropy_requires_grad=entropy_requires_grad, vocab_size=vocab_size)
        logp.append(mb.logprob_rows(out.logp))
        ent.append(mb.entropy_rows(out.entropy))
    return TreeScores(logp=batch.gather(logp), entropy=batch.gather(ent), batch=batch)


@torch.no_grad()
def _scheduled_scores(model: torch.nn.Module, batch: TreeBatch, *, temperature: float, backend, chunk_size: int,
                      gdn: GdnTreeConfig | None, pg_collection, vocab_size: int | None = None) -> TreeScores:
    """:func:`tree_logprobs` through ``get_forward_backward_func(forward_only=True)``."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(pp) > 1 and not getattr(getattr(model, "config", None),
                                                                 "variable_seq_lengths", False):
        batch = batch.padded()  # one shape for the pipeline's p2p buffers

    def step(data_iterator, model_):
        mb = next(data_iterator)
        params = make_tree_params(mb.forest, backend=backend, model=model_, gdn=gdn)
        output = tree_forward(model_, mb.forest, params=params, temperature=temperature, chunk_size=chunk_size,
                              vocab_size=vocab_size)

        def collect(output_tensor, non_loss_data=True):
            return torch.stack([mb.logprob_rows(output_tensor[0]), mb.entropy_rows(output_tensor[1])], 1)

        return output, collect

    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    res = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(batch.microbatches), model=model,
        num_microbatches=len(batch.microbatches), seq_length=max(mb.forest.num_nodes for mb in batch.microbatches),
        micro_batch_size=1, forward_only=True, collect_non_loss_data=True, **kw)
    if not res:  # not the last pipeline stage
        zeros = torch.zeros(batch.shape, dtype=torch.float32, device=next(model.parameters()).device)
        return TreeScores(logp=zeros, entropy=zeros.clone(), batch=batch)
    both = batch.gather(res)  # [B, 2, L]
    return TreeScores(logp=both[:, 0], entropy=both[:, 1], batch=batch)


def _tree_capable(model: torch.nn.Module) -> bool:
    cores = [getattr(m, "core_attention", None) for m in model.modules()]
    cores = [c for c in cores if isinstance(c, torch.nn.Module)]
    hooked = all(getattr(g.decoder, "_harts_hooked", False) for g in _gpt_models(model)
                 if g.position_embedding_type in ("rope", "yarn"))
    return hooked and all(getattr(type(c), "_harts_tree", False) for c in cores) and not any(
        _is_plain_gdn(m) for m in model.modules())
