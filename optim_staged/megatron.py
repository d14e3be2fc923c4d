"""Megatron-Core integration (the only module of the package importing ``megatron.core``).

``get_staged_optimizer(config, model_chunks)`` builds the *normal* Megatron optimizer through
``get_megatron_optimizer`` (distributed optimizer, ``ChainedOptimizer``, grad-norm, clipping,
param all-gather all stay Megatron's) and then swaps each ``DistributedOptimizer`` leaf for a
:class:`StagedDistributedOptimizer` over the same buffers, whose inner optimizer is
:class:`~optim_staged.StagedAdamW` driven through Megatron's precision-aware contract: the
DistOpt hands the inner optimizer bf16 (or fp32) shard views of the parameters plus fp32
``decoupled_grad`` views, allocates no fp32 main params, and checkpoints through
``get_unscaled_state`` / ``set_scaled_state``. TransformerEngine is not required: the contract is
implemented here, so the precision-aware flags are set on a copy of the Megatron config after its
TE-only validation.

The stock build allocates fp32 main-param shards once (4 B/param, freed when the leaf is swapped).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from mcore_distill.errors import ConfigTypeError
from mcore_distill.validate import check_type
from optim_staged.adamw import StagedAdamW
from optim_staged.config import StagedOptimizerConfig, UnsupportedMegatronConfigError
from optim_staged.muon import StagedMuon

__all__ = ["get_staged_optimizer", "save_checkpoint", "load_checkpoint", "async_save_checkpoint", "AsyncCheckpoint",
           "StagedDistributedOptimizer", "megatron_optimizer_config", "megatron_muon_config", "megatron_layout",
           "staged_leaves"]


def megatron_optimizer_config(cfg: StagedOptimizerConfig, model_chunks: list[Any], **overrides: Any) -> OptimizerConfig:
    """The Megatron ``OptimizerConfig`` equivalent to ``cfg`` for these model chunks (AdamW)."""
    mc = model_chunks[0].config
    a = cfg.adamw
    kwargs = dict(
        optimizer="adam", lr=a.lr, min_lr=0.0, weight_decay=a.weight_decay, adam_beta1=a.betas[0],
        adam_beta2=a.betas[1], adam_eps=a.eps, use_distributed_optimizer=True, clip_grad=cfg.clip_grad,
        bf16=bool(getattr(mc, "bf16", False)), fp16=bool(getattr(mc, "fp16", False)),
        params_dtype=getattr(mc, "params_dtype", torch.float32),
    )
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


def _check_supported(mcfg: OptimizerConfig, model_chunks: list[Any]) -> None:
    def bad(field: str, value: Any, why: str) -> None:
        raise UnsupportedMegatronConfigError(f"{field}={value!r} is not supported by staged optimizers: {why}")

    if mcfg.fp16:
        bad("OptimizerConfig.fp16", mcfg.fp16, "use bf16 (no loss-scaled fp16 path)")
    if mcfg.optimizer != "adam":
        bad("OptimizerConfig.optimizer", mcfg.optimizer, "the staged AdamW path needs 'adam' (Muon: algorithm='muon')")
    if getattr(mcfg, "optimizer_cuda_graph", False):
        bad("OptimizerConfig.optimizer_cuda_graph", True, "the staged step streams state and cannot be captured")
    if mcfg.optimizer_cpu_offload:
        bad("OptimizerConfig.optimizer_cpu_offload", True, "HybridDeviceOptimizer and staging are exclusive")
    if not mcfg.use_distributed_optimizer:
        bad("OptimizerConfig.use_distributed_optimizer", False, "staged AdamW plugs into the distributed optimizer")
    if mcfg.exp_avg_dtype != torch.float32 or mcfg.exp_avg_sq_dtype != torch.float32:
        bad("OptimizerConfig.exp_avg_dtype", mcfg.exp_avg_dtype,
            "set StagedOptimizerConfig.adamw.exp_avg_dtype / exp_avg_sq_dtype ('bf16') instead")
    for chunk in model_chunks:
        mc = chunk.config
        if getattr(mc, "fp8", None):
            bad("TransformerConfig.fp8", mc.fp8, "FP8 parameters need TE's quantized master copies")
        if getattr(mc, "fp4", None):
            bad("TransformerConfig.fp4", mc.fp4, "FP4 parameters need TE's quantized master copies")
        if not chunk.ddp_config.use_distributed_optimizer:
            bad("DistributedDataParallelConfig.use_distributed_optimizer", False,
                "wrap the model with use_distributed_optimizer=True")
        if getattr(chunk.ddp_config, "use_megatron_fsdp", False):
            bad("DistributedDataParallelConfig.use_megatron_fsdp", True, "Megatron-FSDP is not supported")


def _init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
    opt.initialize_state()


class StagedDistributedOptimizer(DistributedOptimizer):
    """``DistributedOptimizer`` whose inner optimizer is a staged optimizer.

    Adds ``prefetch`` of the first slots from ``prepare_grads`` (state H2D overlaps grad
    unscale/norm/clip), RL-colocation ``offload_to_cpu`` (drain, free slots: accelerator state
    bytes go to 0) / ``restore_from_cpu`` (nothing to move; slots come back on the next step),
    and ``reload_model_params`` support (masters re-read from the model params).
    """

    def prepare_grads(self) -> bool:
        if not self.is_stub_optimizer:
            self.optimizer.prefetch()
        return super().prepare_grads()

    def offload_to_cpu(self) -> None:
        if not self.is_stub_optimizer:
            self.optimizer.drain(release=True)

    def restore_from_cpu(self) -> None:
        """State never left the host; slots are re-allocated lazily by the next step."""

    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        if self.is_stub_optimizer:
            return
        if state_dict is not None:
            raise UnsupportedMegatronConfigError(
                "reload_model_params(state_dict=...) is not supported with staged state; load the model "
                "weights first, then call reload_model_params() without a state_dict")
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        # Cold path. The model params were just changed by code outside the optimizer (a
        # checkpoint loader, an RL weight sync on its own stream or through NCCL, a test's
        # in-place op): a device-wide barrier orders every such write before the reads below,
        # whichever stream issued it. The optimizer's own last param writes (compute stream) are
        # already joined into the caller's stream by step(); drain() settles its transfers.
        if params and params[0].is_cuda:
            torch.cuda.synchronize(params[0].device)
        opt.drain(release=False)
        for p in params:
            opt.set_scaled_state(p, "master_param", p.detach().float())

    @property
    def gpu_state_bytes(self) -> int:
        return 0 if self.is_stub_optimizer else self.optimizer.gpu_state_bytes

    def state_dict(self):
        """Megatron's non-parameter state (hyper-parameters per group, grad scaler). Step counters
        come from the staged optimizer's per-group counters, which advance on every rank, so a
        rank whose shard is empty or padding-only (no per-parameter state to read a step from,
        where Megatron's own extraction fails) saves the same counters as the owners."""
        if self.is_stub_optimizer:
            return super().state_dict()
        inner = self.optimizer.state_dict()
        out = {"optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in inner["param_groups"]]}}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out


def _restage(leaf: DistributedOptimizer, cfg: StagedOptimizerConfig) -> DistributedOptimizer:
    if leaf.is_stub_optimizer:
        return leaf
    groups = []
    for gi, gr in enumerate(leaf.opt_group_ranges):
        orig = gr["orig_group"]
        params = list(leaf.model_fp32_groups[gi]) + list(leaf.model_float16_groups[gi])
        groups.append({**{k: v for k, v in orig.items() if k != "params"}, "params": params})
    a = cfg.adamw
    inner = StagedAdamW.from_config(groups, a, slots=cfg.slots, staged_fraction=cfg.staged_fraction)
    # Precision-aware flags on a copy: OptimizerConfig's own check only looks for TE FusedAdam.
    pa = copy.copy(leaf.config)
    pa.use_precision_aware_optimizer = True
    pa.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    pa.store_param_remainders = False
    new = StagedDistributedOptimizer(
        inner, pa, leaf.grad_scaler, _init_state_fn,
        model_chunks=leaf.model_chunks, per_model_buffers=leaf.per_model_buffers,
        data_parallel_group=leaf.data_parallel_group, data_parallel_group_gloo=leaf.data_parallel_group_gloo,
        data_parallel_group_idx=leaf.data_parallel_group_idx,
        distributed_optimizer_instance_id=leaf.distributed_optimizer_instance_id,
    )
    for attr in ("grad_stats_parallel_group", "tp_group", "expert_tp_group"):
        if hasattr(leaf, attr):
            setattr(new, attr, getattr(leaf, attr))
    new.optimizer.initialize_state()  # allocate slabs now (host RAM checked), masters <- params
    return new


def staged_leaves(optimizer: Any) -> list[StagedDistributedOptimizer]:
    """The staged leaves of a (possibly chained) Megatron optimizer."""
    leaves = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [x for x in leaves if isinstance(x, StagedDistributedOptimizer)]


def _check_arguments(config: Any, model_chunks: Any) -> None:
    check_type("config", config, StagedOptimizerConfig)
    if not isinstance(model_chunks, list | tuple):
        raise ConfigTypeError(f"model_chunks must be a list of DDP-wrapped model chunks, got "
                              f"{type(model_chunks).__name__} (pass [ddp_model])")
    for i, chunk in enumerate(model_chunks):
        if not hasattr(chunk, "ddp_config"):
            raise ConfigTypeError(
                f"model_chunks[{i}] is an unwrapped {type(chunk).__name__}: wrap it first, e.g. "
                "DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), "
                "model) from megatron.core.distributed")


def get_staged_optimizer(config: StagedOptimizerConfig, model_chunks: list[Any], *,
                         megatron_config: OptimizerConfig | None = None, config_overrides: Any = None,
                         pg_collection: Any = None, use_gloo_process_groups: bool = True):
    """Build Megatron's optimizer for ``model_chunks`` with staged AdamW state.

    Args:
        config: algorithm / residency / slots / hyper-parameters.
        model_chunks: Megatron DDP-wrapped model chunks (``use_distributed_optimizer=True``).
        megatron_config: a full Megatron ``OptimizerConfig`` to start from (LR schedule fields,
            ``config_overrides`` semantics); default :func:`megatron_optimizer_config`.
        pg_collection: explicit process groups, passed to ``get_megatron_optimizer``.

    Returns the Megatron optimizer (``ChainedOptimizer`` of :class:`StagedDistributedOptimizer`
    leaves). ``residency='gpu'`` returns the stock Megatron optimizer unchanged. A plain dict for
    ``config`` or a model chunk that is not DDP-wrapped raises ``ConfigTypeError`` naming it. With
    ``config.memory_snapshot.output_dir`` set, a CUDA allocator snapshot of training iteration
    ``config.memory_snapshot.step`` is written there (:class:`optim_staged.memory.AllocatorSnapshot`).
    """
    _check_arguments(config, model_chunks)
    if config.algorithm == "muon":
        opt = _get_staged_muon(config, model_chunks, megatron_config=megatron_config,
                               config_overrides=config_overrides, pg_collection=pg_collection,
                               use_gloo_process_groups=use_gloo_process_groups)
    else:
        opt = _get_staged_adamw(config, model_chunks, megatron_config=megatron_config,
                                config_overrides=config_overrides, pg_collection=pg_collection,
                                use_gloo_process_groups=use_gloo_process_groups)
    if config.memory_snapshot.output_dir:
        from optim_staged.memory import AllocatorSnapshot

        opt.memory_snapshot = AllocatorSnapshot(config.memory_snapshot).attach(opt)
    return opt


def _get_staged_adamw(config: StagedOptimizerConfig, model_chunks: list[Any], *, megatron_config, config_overrides,
                      pg_collection, use_gloo_process_groups):
    mcfg = megatron_config or megatron_optimizer_config(config, model_chunks)
    _check_supported(mcfg, model_chunks)
    opt = get_megatron_optimizer(mcfg, model_chunks, config_overrides=config_overrides,
                                 use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection)
    if config.residency == "gpu":
        return opt
    if isinstance(opt, ChainedOptimizer):
        opt.chained_optimizers = [_restage(x, config) if isinstance(x, DistributedOptimizer) else x
                                  for x in opt.chained_optimizers]
        return opt
    return _restage(opt, config)


# ---------------------------------------------------------------------------------------- Muon
def megatron_muon_config(cfg: StagedOptimizerConfig, model_chunks: list[Any], **overrides: Any) -> OptimizerConfig:
    """Megatron ``OptimizerConfig`` for Muon (matrices) + Adam (everything else) from ``cfg``."""
    mc = model_chunks[0].config
    m, a = cfg.muon, cfg.adamw
    kwargs = dict(
        optimizer="muon", lr=m.lr, min_lr=0.0, weight_decay=m.weight_decay, adam_beta1=a.betas[0],
        adam_beta2=a.betas[1], adam_eps=a.eps, use_distributed_optimizer=False, clip_grad=cfg.clip_grad,
        bf16=bool(getattr(mc, "bf16", False)), fp16=False, params_dtype=getattr(mc, "params_dtype", torch.float32),
        muon_momentum=m.momentum, muon_nesterov=m.nesterov, muon_split_qkv=m.split_qkv,
        muon_num_ns_steps=m.num_ns_steps, muon_scale_mode=m.scale_mode,
        muon_extra_scale_factor=m.extra_scale_factor, muon_fp32_matmul_prec=m.fp32_matmul_prec,
        muon_tp_mode=m.tp_mode, muon_coefficient_type=m.coefficient_type,
    )
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


def _get_staged_muon(config: StagedOptimizerConfig, model_chunks: list[Any], *, megatron_config, config_overrides,
                     pg_collection, use_gloo_process_groups):
    """Megatron's Muon chain (TensorParallelMuon for matrices, Adam for the rest) with each leaf's
    inner optimizer replaced by :class:`StagedMuon` / :class:`StagedAdamW` over the same groups.

    Supported leaves: ``FP32Optimizer`` (fp32 models: master, momentum and moments all staged),
    ``Float16OptimizerWithFloat16Params`` (bf16: Megatron keeps its fp32 main params on the device,
    only momentum/moments are staged), and the raw leaves of ``LayerWiseDistributedOptimizer``
    (each DP rank steps whole matrices it owns; Megatron all-gathers them afterwards).
    """
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    mcfg = megatron_config or megatron_muon_config(config, model_chunks)
    if mcfg.fp16:
        raise UnsupportedMegatronConfigError("OptimizerConfig.fp16=True is not supported by staged optimizers")
    opt = get_megatron_optimizer(mcfg, model_chunks, config_overrides=config_overrides,
                                 use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection)
    if config.residency == "gpu":
        return opt

    def staged_twin(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(inner, TensorParallelMuon):
            twin = StagedMuon.from_tensor_parallel_muon(inner, slots=config.slots)
        elif isinstance(inner, torch.optim.AdamW | torch.optim.Adam):
            g0 = inner.param_groups[0]
            twin = StagedAdamW([dict(g) for g in inner.param_groups], lr=g0["lr"], betas=g0["betas"],
                               eps=g0["eps"], weight_decay=g0["weight_decay"], slots=config.slots,
                               impl=config.adamw.impl, fused_max_slices=config.adamw.fused_max_slices)
        else:
            raise UnsupportedMegatronConfigError(
                f"Muon chain leaf optimizer {type(inner).__name__} cannot be staged "
                "(expected TensorParallelMuon or AdamW)")
        twin.initialize_state()
        return twin

    def swap(leaves: list[Any]) -> None:
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedOptimizer):  # layer-wise Muon's byte-sharded Adam leaf
                leaves[i] = _restage(leaf, config)
            elif isinstance(leaf, ChainedOptimizer):  # LayerWiseDistributedOptimizer inside the chain
                swap(leaf.chained_optimizers)
            elif isinstance(leaf, torch.optim.Optimizer):  # layer-wise DistOpt, fp32: raw inner optimizers
                leaves[i] = staged_twin(leaf)
            elif getattr(leaf, "optimizer", None) is not None:  # FP32Optimizer / Float16Optimizer wrappers
                leaf.optimizer = staged_twin(leaf.optimizer)
                leaf.init_state_fn = _init_state_fn  # checkpoint templates: state exists, keep it

    if isinstance(opt, ChainedOptimizer):
        swap(opt.chained_optimizers)
        return opt
    one = [opt]
    swap(one)
    return one[0]


# -------------------------------------------------------------------------------- checkpoints
CHECKPOINT_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
"""Model-space, per-parameter optimizer state: loads at a different DP size."""


def _pg_collection(model_chunk: Any) -> Any:
    """The model's process groups (``pg_collection`` of the innermost module that has one)."""
    m = model_chunk
    while m is not None:
        pg = getattr(m, "pg_collection", None)
        if pg is not None:
            return pg
        m = getattr(m, "module", None)
    return None


def megatron_layout(model_chunk: Any) -> dict[str, int]:
    """The parallel layout this rank runs at: sizes of the model's process groups (its
    ``pg_collection``), else of Megatron's parallel state. Never from ``TransformerConfig``: a job
    may set TP only in parallel state and leave the config at TP=1 (Megatron's own minimal
    training example does), and the layers follow the process groups."""
    from megatron.core import parallel_state as ps

    from optim_staged.checkpoint import parallel_layout

    pg = _pg_collection(model_chunk)

    def size(name: str, fallback) -> int:
        group = getattr(pg, name, None) if pg is not None else None
        return torch.distributed.get_world_size(group) if group is not None else int(fallback())

    return parallel_layout(
        tensor_model_parallel_size=size("tp", ps.get_tensor_model_parallel_world_size),
        pipeline_model_parallel_size=size("pp", ps.get_pipeline_model_parallel_world_size),
        expert_model_parallel_size=size("ep", ps.get_expert_model_parallel_world_size),
        expert_tensor_parallel_size=size("expt_tp", ps.get_expert_tensor_parallel_world_size),
        context_parallel_size=size("cp", ps.get_context_parallel_world_size),
        data_parallel_size=size("dp", ps.get_data_parallel_world_size),
        expert_data_parallel_size=size("expt_dp", ps.get_expert_data_parallel_world_size),
    )


def _sharded_state_dict(model_chunk: Any, optimizer: Any, *, is_loading: bool = False) -> dict[str, Any]:
    kw = {"is_loading": True} if is_loading else {}
    return {"model": model_chunk.sharded_state_dict(),
            "optimizer": optimizer.sharded_state_dict(model_chunk.sharded_state_dict(), metadata=CHECKPOINT_SHARDING,
                                                      **kw)}


def _begin_save(directory: str, group: Any) -> Path:
    """The temp directory every rank writes into: ``<directory>.tmp-<token>`` with rank 0's token,
    broadcast. Rank 0 first renames back a checkpoint left aside by a crashed switch and deletes
    the temporaries of dead writers; the others wait at a barrier."""
    from mcore_distill.atomic import new_token, recover_directory, remove_stale, temp_directory_for

    rank = torch.distributed.get_rank(group)
    token = [new_token() if rank == 0 else None]
    src = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast_object_list(token, src=src, group=group)
    if rank == 0:
        recover_directory(directory)
        remove_stale(directory)
    torch.distributed.barrier(group)
    return temp_directory_for(directory, token[0])  # created by every rank (idempotent)


def _publish(model_chunk: Any, tmp: Path, directory: str, group: Any) -> None:
    """After every rank wrote ``tmp``: rank 0 records the layout and switches ``tmp`` in as
    ``directory`` (crash-safe at every step, :func:`mcore_distill.atomic.publish_directory`)."""
    from optim_staged.checkpoint import publish_directory, write_layout

    torch.distributed.barrier(group)
    if torch.distributed.get_rank(group) == 0:
        write_layout(tmp, megatron_layout(model_chunk))
        publish_directory(tmp, directory)
    torch.distributed.barrier(group)


def save_checkpoint(model_chunk: Any, optimizer: Any, directory: str, *, group: Any = None) -> None:
    """Synchronous, atomic ``dist_checkpointing`` save of ``{'model', 'optimizer'}``.

    Every rank writes into ``<directory>.tmp-<token>`` (one token, from rank 0); after a barrier
    rank 0 records the parallel layout (``optim_staged_layout.json``: TP/PP/EP/expert-TP/CP/DP
    sizes from the process groups) and switches the folder in as ``directory``. At every instant
    ``directory`` is the old or the new complete checkpoint (or, on file systems without
    ``RENAME_EXCHANGE``, recoverable: the next save or load renames the surviving copy back). The
    save also deletes temporaries left by saves that were killed.
    """
    from megatron.core import dist_checkpointing

    tmp = _begin_save(directory, group)
    _writer_results_queue_ends_with_rank()
    dist_checkpointing.save(_sharded_state_dict(model_chunk, optimizer), str(tmp))
    _publish(model_chunk, tmp, directory, group)


def _writer_results_queue_ends_with_rank() -> None:
    """Megatron's ``torch_dist`` writer sends write results through a process-wide
    ``multiprocessing`` Manager queue that it spawns at the first save
    (``filesystem_async.get_write_results_queue``). The Manager's server process outlives a rank
    killed with SIGKILL, as an orphan holding the memory of a spawned interpreter (~0.7 GB with
    torch imported), one per killed rank. Create that queue first, on a Manager whose server
    process ends with this rank (:func:`mcore_distill.lifetime.exit_with_parent`); Megatron then
    reuses it. The queue's proxy keeps its Manager alive."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcore_distill.lifetime import exit_with_parent

    if not hasattr(filesystem_async, "_results_queue") or filesystem_async._results_queue is not None:
        return  # renamed upstream (nothing to pre-create), or created already
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()


def load_checkpoint(model_chunk: Any, optimizer: Any, directory: str, *, group: Any = None) -> None:
    """Load a :func:`save_checkpoint` / :func:`async_save_checkpoint` directory into
    ``model_chunk`` and ``optimizer`` (any DP size; a different TP/PP/EP/expert-TP size raises
    :class:`~optim_staged.config.CheckpointLayoutError`, naming both layouts, before anything is
    read).

    Rank 0 first renames back a complete copy left by a save that crashed during the switch
    (others wait at a barrier). It does not delete temporaries: a save of another job may still
    be writing them (saves clean up). The optimizer template is built with ``is_loading=True``
    after its state exists, so every state key (master, exp_avg, exp_avg_sq) is requested from
    the checkpoint: a checkpoint without moments fails to load instead of silently resetting them.
    """
    from megatron.core import dist_checkpointing

    from mcore_distill.atomic import recover_directory
    from optim_staged.checkpoint import check_layout

    if torch.distributed.get_rank(group) == 0:
        recover_directory(directory)
    torch.distributed.barrier(group)
    check_layout(directory, megatron_layout(model_chunk))  # TP/PP/EP changes: CheckpointLayoutError
    loaded = dist_checkpointing.load(_sharded_state_dict(model_chunk, optimizer, is_loading=True), directory)
    # Megatron's wrappers prefix sharded keys with "module." but load through to the inner module.
    model_sd, want = loaded["model"], set(model_chunk.state_dict())
    while model_sd and not (set(model_sd) & want) and all(k.startswith("module.") for k in model_sd):
        model_sd = {k.removeprefix("module."): v for k, v in model_sd.items()}
    model_chunk.load_state_dict(model_sd)
    optimizer.load_state_dict(loaded["optimizer"])


# -------------------------------------------------------------------------- async checkpoints
def _all_ranks_true(flag: bool, group: Any) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one all-reduce)."""
    nccl = torch.distributed.get_backend(group) == "nccl"
    t = torch.tensor([0 if flag else 1], dtype=torch.int32,
                     device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item()) == 0


def _live_storages(model_chunk: Any, optimizer: Any, sharded: dict[str, Any]) -> set[int]:
    """Data pointers of the host storages that training writes: model parameters and buffers,
    staged slabs, and every tensor of the sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    tensors = [*torch.nn.Module.parameters(model_chunk), *torch.nn.Module.buffers(model_chunk)]
    for buf in getattr(model_chunk, "buffers", None) or []:  # Megatron DDP's param/grad buffers (a list)
        tensors.append(getattr(buf, "param_data", None))
    for leaf in (optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]):
        inner = getattr(leaf, "optimizer", leaf)
        for store in (getattr(inner, "slabs", None), getattr(inner, "resident", None)):
            if store is not None:
                tensors += list(store.tensors.values())
    tensors += [getattr(v, "data", None) for v in nested_values(sharded)]
    return {t.untyped_storage().data_ptr() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()}


def _private_copies(buckets: list, live: set[int]) -> list:
    """The writer's buckets with every tensor that shares host memory with training state cloned."""
    out = []
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        tensor_data = [(item, t.clone() if t.untyped_storage().data_ptr() in live else t) for item, t in tensor_data]
        out.append((file_name, storage_key, (bytes_data, tensor_data)))
    return out


class AsyncCheckpoint:
    """A Megatron checkpoint whose files are being written on a background thread.

    Made by :func:`async_save_checkpoint`. ``done()`` tells (locally) whether this rank's files are
    written. ``wait()`` is collective (every rank calls it, e.g. once per iteration or before
    the next save): it waits for the writers, then writes the metadata and switches the folder
    in as the checkpoint, exactly as :func:`save_checkpoint` does.
    """

    def __init__(self, request: Any, args: list, *, tmp: Path, directory: str, model_chunk: Any, group: Any,
                 timeout_s: float) -> None:
        import threading

        self.directory, self.tmp, self.timeout_s = directory, tmp, timeout_s
        self._request, self._model_chunk, self._group = request, model_chunk, group
        self.error: BaseException | None = None
        self.published = False

        def write() -> None:
            try:
                if request.async_fn is not None:
                    request.async_fn(*args, **request.async_fn_kwargs)
            except BaseException as e:  # noqa: BLE001 - reported by wait() on every rank
                self.error = e

        self._thread = threading.Thread(target=write, name=f"optim_staged-ckpt-{Path(directory).name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's background write has ended (no collective)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Collective: wait up to ``timeout`` s (default ``timeout_s``) for every rank's writer,
        then finalize and publish. Raises ``TimeoutError`` on every rank if any rank's writer is
        still running (call again later), or :class:`~optim_staged.errors.CheckpointWriteError` on
        every rank if a write failed (its temporary folder is removed); the previous checkpoint at
        ``directory`` stays in place in both cases."""
        if self.published:
            return
        t = self.timeout_s if timeout is None else timeout
        self._thread.join(t)
        if not _all_ranks_true(not self._thread.is_alive(), self._group):
            raise TimeoutError(f"async checkpoint save to {self.directory}: a rank's writer is still running after {t} s")
        from torch.distributed.checkpoint.api import CheckpointException

        from optim_staged.errors import CheckpointWriteError

        failure: BaseException | None = None
        if not _all_ranks_true(self.error is None, self._group):
            failure = self.error or RuntimeError("another rank's writer failed")
        else:
            try:
                for fn in self._request.finalize_fns:  # write results gathered, .metadata, metadata.json
                    fn()
            except CheckpointException as e:  # raised on every rank when any rank's write failed
                failure = e
        if failure is not None:  # every rank is here: drop the incomplete folder, keep the old checkpoint
            torch.distributed.barrier(self._group)
            if torch.distributed.get_rank(self._group) == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.published = True  # nothing more to wait for
            raise CheckpointWriteError(f"async checkpoint save to {self.directory} failed: {failure!r}; "
                                       "the previous checkpoint there is unchanged") from failure
        _publish(self._model_chunk, self.tmp, self.directory, self._group)
        self.published = True


def async_save_checkpoint(model_chunk: Any, optimizer: Any, directory: str, *, group: Any = None,
                          timeout_s: float = 600.0) -> AsyncCheckpoint:
    """Start a :func:`save_checkpoint` whose file writes run on a background thread; returns an
    :class:`AsyncCheckpoint` (call ``wait()`` on every rank to publish it).

    Before returning, the state is a snapshot: Megatron's async ``dist_checkpointing`` plans the
    save (the collectives), copies device tensors to host and clones host views; every remaining
    host tensor that shares memory with training state (model parameters, staged slabs) is cloned
    here. Training may go on at once: a step taken after this call does not reach the files. Host
    RAM: one copy of this rank's checkpoint shard until the write ends.

    A crash (kill -9) before ``wait()`` has published leaves the previous checkpoint at
    ``directory`` untouched; the next save deletes the incomplete temporary.
    """
    from megatron.core import dist_checkpointing

    tmp = _begin_save(directory, group)
    _writer_results_queue_ends_with_rank()
    sharded = _sharded_state_dict(model_chunk, optimizer)
    live = _live_storages(model_chunk, optimizer, sharded)
    request = dist_checkpointing.save(sharded, str(tmp), async_sharded_save=True, async_strategy="mcore")
    args = list(request.async_fn_args)
    if request.preload_fn is not None:  # device -> host now, as Megatron's own async callers do
        args[1] = _private_copies(request.preload_fn(), live)
    return AsyncCheckpoint(request, args, tmp=tmp, directory=directory, model_chunk=model_chunk, group=group,
                           timeout_s=timeout_s)
