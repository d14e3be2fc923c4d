"""Megatron-Core side of colocation: gather TP/EP shards into HF tensors, residency hooks.

The only module of :mod:`colocate` that imports ``megatron.core``. Process groups come from an
explicit ``pg_collection`` (``ProcessGroupCollection``) or, when None, from Megatron's
``parallel_state``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from colocate.buckets import align
from colocate.config import HFModelSpec
from colocate.convert import (
    ConversionArena,
    Qwen3HybridSpec,
    arena_nbytes,
    gdn_tp_sections,
    globalize_name,
    megatron_to_hf,
    merge_named_tp_shards,
)

__all__ = ["unwrap_model", "model_spec_from_megatron", "iter_hf_weights", "publish_megatron",
           "megatron_arena_nbytes", "megatron_arena", "megatron_residency_hooks", "awex_megatron_engine"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / ``Float16Module`` wrappers (``.module`` chains) down to the ``GPTModel``."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def model_spec_from_megatron(model: torch.nn.Module, *, router_dtype: str | None = None) -> HFModelSpec:
    """The :class:`HFModelSpec` of a Megatron ``GPTModel`` (read from its ``TransformerConfig``)."""
    m = unwrap_model(model)
    c = m.config
    has_bias = bool(getattr(c, "moe_router_enable_expert_bias", False))
    return HFModelSpec(
        arch="qwen3_moe" if c.num_moe_experts else "qwen3",
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups or c.num_attention_heads, head_dim=c.kv_channels,
        ffn_hidden_size=c.ffn_hidden_size, vocab_size=m.vocab_size,
        tie_embeddings=bool(m.share_embeddings_and_output_weights), num_experts=c.num_moe_experts,
        moe_ffn_hidden_size=c.moe_ffn_hidden_size, router_dtype=router_dtype, has_expert_bias=has_bias,
        num_experts_per_tok=c.moe_router_topk if c.num_moe_experts else 2,
        rope_theta=float(getattr(m, "rotary_base", 10000)), rms_norm_eps=float(c.layernorm_epsilon),
        max_position_embeddings=int(m.max_sequence_length),
    )


def _groups(pg_collection):
    if pg_collection is not None:
        return pg_collection.tp, getattr(pg_collection, "expt_tp", None), getattr(pg_collection, "ep", None)
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(check_initialized=False),
            ps.get_expert_model_parallel_group(check_initialized=False))


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return out


def _kind(name: str, p: torch.Tensor) -> str:
    if not getattr(p, "tensor_model_parallel", False):
        return "replicated"
    if name.endswith("linear_fc1.weight") or re.search(r"linear_fc1\.weight\d+$", name):
        return "glu"
    return "col" if getattr(p, "partition_dim", 0) == 0 else "row"


def _params(chunks: list[torch.nn.Module], spec: HFModelSpec, groups):
    """The parameters of one pass in iteration order (identical on every rank of a TP/EP group):
    ``(name, p, layer_id, kind, tp_group, ep_gather)``; the tied ``output_layer.weight`` is
    skipped. ``tp_group`` is the ETP group for routed experts, the TP group otherwise."""
    tp, etp, ep = groups
    ep_size = dist.get_world_size(ep) if ep is not None else 1
    for chunk in chunks:
        m = unwrap_model(chunk)
        layers = m.decoder.layers if hasattr(m, "decoder") else []
        named = list(m.named_parameters()) + [(n, b) for n, b in m.named_buffers() if n.endswith("expert_bias")]
        for name, p in named:
            if name == "output_layer.weight" and spec.tie_embeddings:
                continue
            lm = _LAYER.match(name)
            layer_id = layers[int(lm.group(1))].layer_number - 1 if lm else None
            is_expert = ".experts." in name and ".shared_experts." not in name
            yield name, p, layer_id, _kind(name, p), etp if is_expert else tp, is_expert and ep_size > 1


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _sections(name: str, spec: HFModelSpec, n: int) -> list[int] | None:
    """The per-shard row sections that :func:`merge_named_tp_shards` merges section by section
    (hybrid GDN ``in_proj``/``conv1d``), or None for a plain concatenation."""
    if isinstance(spec, Qwen3HybridSpec):
        for suffix, which in (("self_attention.in_proj.weight", "in_proj"), ("self_attention.conv1d.weight", "conv1d")):
            if name.endswith(suffix):
                return gdn_tp_sections(spec, n, which=which)
    return None


def _merged_shape(p: torch.Tensor, kind: str, n: int) -> tuple[int, ...]:
    s = tuple(p.shape)
    return (s[0], n * s[1], *s[2:]) if kind == "row" else (n * s[0], *s[1:])


class _Scratch:
    """A transient gather buffer reused for every parameter of one pass (grown when needed):
    the shards of a row/GLU/sectioned parameter land here before the merge writes the arena."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def shards(self, like: torch.Tensor, n: int) -> list[torch.Tensor]:
        nbytes = n * like.numel() * like.element_size()
        if self.buf is None or self.buf.numel() < nbytes or self.buf.device != like.device:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return list(self.buf[:nbytes].view(like.dtype).view(n, *like.shape).unbind(0))


def _gather_into_arena(name: str, p: torch.Tensor, kind: str, group, spec: HFModelSpec, arena: ConversionArena,
                       scratch: _Scratch) -> torch.Tensor:
    """The TP-merged ``p`` (what ``merge_named_tp_shards(_all_gather(p))`` returns, bit for bit)
    written into an arena view, with the same one ``all_gather`` per parameter (so ranks with
    and without an arena stay in step). Column shards are gathered straight into the arena;
    row, GLU and sectioned shards go through ``scratch`` and one ``torch.cat(out=)``."""
    n = _size(group)
    t = p.detach().contiguous()
    out = arena.take_for(t, _merged_shape(t, kind, n), t.dtype, name=f"{name} (TP-merged)")
    sections = _sections(name, spec, n) if kind == "col" else None
    if kind == "col" and sections is None:
        dist.all_gather(list(out.chunk(n, dim=0)), t, group=group)
        return out
    shards = scratch.shards(t, n)
    dist.all_gather(shards, t, group=group)
    if kind == "row":
        torch.cat(shards, dim=1, out=out)
    elif kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0, out=out)
    else:  # sectioned column shards (hybrid GDN in_proj / conv1d)
        parts = [torch.split(s, sections, dim=0) for s in shards]
        torch.cat([q[i] for i in range(len(sections)) for q in parts], dim=0, out=out)
    return out


def _ep_gather_into_arena(name: str, full: torch.Tensor, ep, arena: ConversionArena) -> list[torch.Tensor]:
    """``_all_gather(full, ep)`` with the outputs as consecutive views of one arena slice."""
    n = _size(ep)
    t = full.detach().contiguous()
    out = arena.take_for(t, (n, *t.shape), t.dtype, name=f"{name} (EP-gathered)")
    parts = list(out.unbind(0))
    dist.all_gather(parts, t, group=ep)
    return parts


def _gathered_nbytes(p: torch.Tensor, kind: str, group, ep_gather: bool, ep) -> int:
    """Arena bytes :func:`iter_hf_weights` takes for the gathers of ``p`` (aligned)."""
    n = 1 if kind == "replicated" else _size(group)
    if ep_gather:
        return align(_size(ep) * n * p.numel() * p.element_size())
    return align(n * p.numel() * p.element_size()) if n > 1 else 0


@torch.no_grad()
def iter_hf_weights(model_chunks: list[torch.nn.Module] | torch.nn.Module, *, spec: HFModelSpec,
                    pg_collection=None, arena: ConversionArena | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every parameter of this pipeline stage, TP/ETP shards
    merged and experts of all EP ranks gathered (collective: every rank of the TP/EP groups
    must iterate in step). Every rank receives the full tensors.

    Expert ``e`` local to EP rank r becomes global ``e + r·E/ep``; layer ``j`` of a chunk
    becomes ``layer.layer_number - 1``; tied ``output_layer.weight`` is skipped.

    ``arena``: the tensors the converter must create (q/k/v split, casts) are written into it
    instead of fresh allocations (see :class:`~colocate.convert.ConversionArena`), and so are
    the TP-merged and EP-gathered parameters (size it with :func:`megatron_arena`): every
    yielded tensor is then a view of a Megatron parameter or of the arena. It is reset when the
    iteration starts, so the previous pass's tensors are overwritten then. The collectives are
    the same with and without it (one ``all_gather`` per gathered parameter and group), so a
    rank that does not publish may pass None. A parameter that is both ETP-merged and
    EP-gathered is merged into a transient tensor; only its EP gather lives in the arena.
    """
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]
    if arena is not None:
        arena.reset()
    groups = _groups(pg_collection)
    ep = groups[2]
    scratch = _Scratch()
    for name, p, layer_id, kind, group, ep_gather in _params(chunks, spec, groups):
        if arena is None:
            shards = _all_gather(p, group) if kind != "replicated" else [p.detach()]
            full = merge_named_tp_shards(name, shards, kind=kind, spec=spec)
        elif kind == "replicated" or _size(group) == 1:
            full = p.detach()  # no gather: a view of the Megatron storage (a 1-shard GLU merge is p itself)
        elif ep_gather:  # only the input of the EP gather below: transient
            full = merge_named_tp_shards(name, _all_gather(p, group), kind=kind, spec=spec)
        else:
            full = _gather_into_arena(name, p, kind, group, spec, arena, scratch)
        if ep_gather:
            local = spec.num_experts // _size(ep)
            parts = _all_gather(full, ep) if arena is None else _ep_gather_into_arena(name, full, ep, arena)
            for r, t in enumerate(parts):
                gname = globalize_name(name, layer_id=layer_id, expert_offset=r * local)
                yield from megatron_to_hf(gname, t, spec=spec, arena=arena)
        else:
            yield from megatron_to_hf(globalize_name(name, layer_id=layer_id), full, spec=spec, arena=arena)


def megatron_arena_nbytes(model_chunks: list[torch.nn.Module] | torch.nn.Module, *, spec: HFModelSpec,
                          pg_collection=None) -> int:
    """Bytes a :class:`~colocate.convert.ConversionArena` needs for one :func:`iter_hf_weights`
    pass over these chunks with these TP/ETP/EP groups: the converter's own outputs
    (:func:`~colocate.convert.arena_nbytes` in the parameters' dtype) plus every TP-merged and
    EP-gathered parameter (aligned), in exactly the order the pass takes them. Read from the
    model rather than the spec because which parameters are sharded, and how, is Megatron's
    per-parameter ``tensor_model_parallel``/``partition_dim``; no collective is run."""
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]
    groups = _groups(pg_collection)
    dtype = next(unwrap_model(chunks[0]).parameters()).dtype
    return arena_nbytes(spec, dtype=dtype) + sum(
        _gathered_nbytes(p, kind, group, ep_gather, groups[2])
        for _, p, _, kind, group, ep_gather in _params(chunks, spec, groups))


def megatron_arena(model_chunks: list[torch.nn.Module] | torch.nn.Module, *, spec: HFModelSpec,
                   pg_collection=None, share_memory: bool = False) -> ConversionArena:
    """A :class:`~colocate.convert.ConversionArena` of :func:`megatron_arena_nbytes` bytes on the
    parameters' device (for TP/EP > 1; at TP = EP = 1 it equals ``ConversionArena.for_spec``)."""
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]
    device = next(unwrap_model(chunks[0]).parameters()).device
    return ConversionArena(megatron_arena_nbytes(chunks, spec=spec, pg_collection=pg_collection), device=device,
                           share_memory=share_memory)


def publish_megatron(model_chunks, publish, *, version: int, spec: HFModelSpec, dtype: torch.dtype | None = None,
                     pg_collection=None, arena: ConversionArena | None = None):
    """Collective: every rank of the TP/EP groups calls this; the rank holding the receiver
    passes ``publish`` (e.g. ``Publisher.publish`` or ``ColocatedCycle.publish``), the others
    pass None and only take part in the gathers. Tensors are cast to ``dtype`` one at a time
    (None keeps the training dtype; ``e_score_correction_bias`` stays fp32). The name/shape/dtype
    check runs before any gather. Returns the publish report (None on non-publishing ranks).
    ``arena`` goes to :func:`iter_hf_weights` (converter outputs and TP/EP gathers written into
    it; the casts to ``dtype`` are still fresh tensors).

    Pipeline parallelism is refused (``ValueError``): one engine needs every stage's layers in
    one versioned update, which needs a cross-stage gather this function does not do.
    """
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp_size = dist.get_world_size(pg_collection.pp)
    else:
        from megatron.core import parallel_state as ps

        pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size != 1:
        raise ValueError(f"publish_megatron: pipeline_model_parallel_size={pp_size} is not supported "
                         "(gather the stages' iter_hf_weights to one publishing rank instead)")
    first = next(unwrap_model(chunks[0]).parameters())
    out_dtype = dtype or first.dtype
    stream = ((n, t if t.dtype == out_dtype or n.endswith("e_score_correction_bias") else t.to(out_dtype))
              for n, t in iter_hf_weights(chunks, spec=spec, pg_collection=pg_collection, arena=arena))
    if publish is None:
        for _ in stream:
            pass
        return None
    from colocate.convert import hf_param_specs

    meta = hf_param_specs(spec, dtype=out_dtype)
    if spec.router_dtype is None and spec.num_experts:
        for n in meta:
            if n.endswith("mlp.gate.weight"):
                meta[n] = (meta[n][0], out_dtype)
    return publish(stream, version=version, meta=meta)


def _staged_state(leaf):
    """The object that stages ``leaf``'s state on the host (``optim_staged``: it has
    ``gpu_state_bytes`` and ``offload_to_cpu`` or ``drain``), looking through Megatron's
    ``FP32Optimizer`` / ``Float16Optimizer`` wrappers (``.optimizer``); None for a plain optimizer."""
    x = leaf
    while x is not None:
        if hasattr(x, "gpu_state_bytes") and (hasattr(x, "offload_to_cpu") or hasattr(x, "drain")):
            return x
        x = getattr(x, "optimizer", None)
    return None


def _inner(leaf):
    """The ``torch.optim.Optimizer`` under Megatron's wrappers (None for a stub leaf)."""
    x = leaf
    while x is not None and not isinstance(x, torch.optim.Optimizer):
        x = getattr(x, "optimizer", None)
    return x


class _TrainerMemory:
    """What :func:`megatron_residency_hooks` moves: the DDP buffers, and what the optimizer holds
    outside them (see there)."""

    def __init__(self, ddp_models: list[torch.nn.Module], optimizer) -> None:
        from colocate.residency import TensorOffload

        self.ddps = ddp_models
        leaves = [] if optimizer is None else list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.staged = [x for x in map(_staged_state, leaves) if x is not None]
        self.inners = [x for x in map(_inner, leaves) if x is not None]
        self.plain = [_inner(x) for x in leaves if _staged_state(x) is None and _inner(x) is not None]
        self.grads = TensorOffload(lambda: self.buffers("grad_data"), keep_contents=False)
        self.weights = TensorOffload(self.weight_tensors, keep_contents=True)
        self.optim = TensorOffload(self.optimizer_tensors, keep_contents=True)

    def buffers(self, attr: str) -> list[torch.Tensor]:
        return [t for d in self.ddps
                for b in list(getattr(d, "buffers", [])) + list(getattr(d, "expert_parallel_buffers", []))
                if (t := getattr(b, attr, None)) is not None]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The DDP param buffers, and the parameters outside them (Megatron allocates the buffer
        only for its distributed optimizer; without it, e.g. under Muon, each parameter keeps its
        own storage)."""
        flat = self.buffers("param_data")
        inside = {t.untyped_storage().data_ptr() for t in flat}
        return flat + [p for d in self.ddps for p in d.parameters() if p.untyped_storage().data_ptr() not in inside]

    def ddp_storages(self) -> set[int]:
        """Storages of the model's weights and gradients (not the optimizer's)."""
        return {t.untyped_storage().data_ptr() for t in self.weight_tensors() + self.buffers("grad_data")}

    def main_params(self) -> list[torch.Tensor]:
        """Parameters the optimizer steps that are not views of a DDP buffer (fp32 masters)."""
        ddp = self.ddp_storages()
        return [p for o in self.inners for g in o.param_groups for p in g["params"]
                if p.untyped_storage().data_ptr() not in ddp]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        states = [v for o in self.plain for st in o.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.numel() > 1]
        return states + self.main_params()

    def release_optimizer(self) -> int:
        freed, ddp = 0, self.ddp_storages()
        for x in self.staged:
            before = x.gpu_state_bytes
            if hasattr(x, "offload_to_cpu"):
                x.offload_to_cpu()
            else:
                x.drain(release=True)
            freed += before - x.gpu_state_bytes
        for p in self.main_params():  # main grads: made again from the grad buffer by the next step
            if p.grad is not None:
                st = p.grad.untyped_storage()
                freed += 0 if st.data_ptr() in ddp else st.nbytes()  # an fp32 grad may be a buffer view
                p.grad = None
        return freed + self.optim.release()

    def resume_optimizer(self) -> int:
        for x in self.staged:
            if hasattr(x, "restore_from_cpu"):
                x.restore_from_cpu()  # staged state never left the host; slots return on the next step
        return self.optim.resume()


def megatron_residency_hooks(ddp_models: list[torch.nn.Module], optimizer=None) -> dict:
    """Release/resume callables for a :class:`colocate.residency.Residency` over Megatron DDP.

    Tags: ``optimizer``, ``grads`` (DDP flat grad buffers: storage resized to 0, re-created
    zeroed), ``weights`` (DDP flat param buffers, and parameters outside them when Megatron
    allocated none, as without its distributed optimizer: copied to a CPU mirror, storage resized
    to 0, then restored in place, so parameters and optimizer shards stay views of the buffer).

    ``optimizer`` covers everything the optimizer owns outside the DDP buffers: the state tensors
    of plain optimizers (Adam moments), and the main parameters that are not views of the param
    buffer (the fp32 master copies of a bf16 model, in Megatron's distributed optimizer and its
    ``Float16Optimizer``), offloaded like the buffers; their gradients (made again by the next
    step) are dropped. Optimizers that stage their state on the host (``optim_staged``, found
    through Megatron's ``FP32Optimizer`` / ``Float16Optimizer`` wrappers) are drained with their
    own ``offload_to_cpu`` / ``drain``: their host slabs stay as they are and only their device
    slots are freed. (Megatron's own ``offload_to_cpu`` replaces ``p.data`` and would break the
    aliasing with the param buffer.) Callables return bytes moved.
    """
    m = _TrainerMemory(list(ddp_models) if isinstance(ddp_models, list | tuple) else [ddp_models], optimizer)
    return {"optimizer": (m.release_optimizer, m.resume_optimizer), "grads": (m.grads.release, m.grads.resume),
            "weights": (m.weights.release, m.weights.resume)}


def awex_megatron_engine(config: dict, hf_config, model, *, residency):
    """An AWEX 0.9.0 ``MegatronEngine`` whose memory hooks work (AWEX leaves them unimplemented
    or as no-ops): ``release/resume_memory_occupation(tags)`` (tags ``optimizer``/``weights``,
    None = both, a bare string accepted as AWEX's writers pass one) and ``release_grad_memory``
    drive ``residency`` (a :class:`colocate.residency.Residency` from
    :func:`megatron_residency_hooks`). AWEX's writers, converters and transfer plan are used
    unchanged; ``awex`` is imported here, lazily.
    """
    from awex.engine.mcore import MegatronEngine

    def _tags(tags) -> list[str]:
        tags = ["optimizer", "weights"] if tags is None else [tags] if isinstance(tags, str) else list(tags)
        bad = [t for t in tags if t not in ("optimizer", "weights")]
        if bad:
            raise ValueError(f"AWEX memory tags must be 'optimizer' or 'weights', got {bad}")
        return tags

    class ResidentMegatronEngine(MegatronEngine):
        def release_memory_occupation(self, tags=None) -> None:
            residency.release(_tags(tags))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        def resume_memory_occupation(self, tags=None) -> None:
            residency.resume(_tags(tags))

        def release_grad_memory(self, empty_cache: bool = True) -> None:
            residency.release(["grads"])
            if empty_cache and torch.cuda.is_available():
                torch.cuda.empty_cache()

    return ResidentMegatronEngine(config, hf_config, model)
