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
from typing import Any

import torch
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from mcore_distill.errors import ConfigTypeError
from mcore_distill.validate import check_type
from optim_staged.adamw import StagedAdamW
from optim_staged.config import StagedOptimizerConfig, UnsupportedMegatronConfigError
from optim_staged.muon import StagedMuon

__all__ = ["get_staged_optimizer", "save_checkpoint", "load_checkpoint", "StagedDistributedOptimizer", "megatron_optimizer_config",
           "megatron_muon_config", "staged_leaves"]


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
    ``config`` or a model chunk that is not DDP-wrapped raises ``ConfigTypeError`` naming it.
    """
    _check_arguments(config, model_chunks)
    if config.algorithm == "muon":
        return _get_staged_muon(config, model_chunks, megatron_config=megatron_config,
                                config_overrides=config_overrides, pg_collection=pg_collection,
                                use_gloo_process_groups=use_gloo_process_groups)
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
                               impl=config.adamw.impl)
        else:
            raise UnsupportedMegatronConfigError(
                f"Muon chain leaf optimizer {type(inner).__name__} cannot be staged "
                "(expected TensorParallelMuon or AdamW)")
        twin.initialize_state()
        return twin

    leaves = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedOptimizer):
            raise UnsupportedMegatronConfigError(
                "OptimizerConfig.use_distributed_optimizer=True with Muon: scalar Adam leaves under a "
                "DistributedOptimizer are not staged by the Muon path; set it to False")
        if isinstance(leaf, torch.optim.Optimizer):  # layer-wise DistOpt, fp32: raw inner optimizers
            leaves[i] = staged_twin(leaf)
        elif getattr(leaf, "optimizer", None) is not None:  # FP32Optimizer / Float16Optimizer wrappers
            leaf.optimizer = staged_twin(leaf.optimizer)
            leaf.init_state_fn = _init_state_fn  # checkpoint templates: state exists, keep it
    return opt


# -------------------------------------------------------------------------------- checkpoints
CHECKPOINT_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
"""Model-space, per-parameter optimizer state: loads at a different DP size."""


def _layout(model_chunk: Any, optimizer: Any) -> dict[str, int]:
    from optim_staged.checkpoint import parallel_layout

    leaves = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    dp_group = next((getattr(x, "data_parallel_group", None) for x in leaves
                     if getattr(x, "data_parallel_group", None) is not None), None)
    cfg = model_chunk.config
    mp = int(getattr(cfg, "tensor_model_parallel_size", 1) or 1) * int(getattr(cfg, "pipeline_model_parallel_size", 1) or 1)
    dp = (torch.distributed.get_world_size(dp_group) if dp_group is not None
          else torch.distributed.get_world_size() // mp)
    return parallel_layout(model_chunk.config, data_parallel_size=dp)


def save_checkpoint(model_chunk: Any, optimizer: Any, directory: str, *, group: Any = None) -> None:
    """Synchronous, atomic ``dist_checkpointing`` save of ``{'model', 'optimizer'}``.

    Every rank writes into ``<directory>.tmp``; after a barrier rank 0 records the parallel layout
    (``optim_staged_layout.json``: TP/PP/EP/DP sizes), fsyncs the folder and renames it to
    ``directory`` (an older checkpoint there is replaced only once the new one is complete).
    """
    import os

    from megatron.core import dist_checkpointing

    from optim_staged.checkpoint import publish_directory, write_layout

    tmp = f"{directory}.tmp"
    rank = torch.distributed.get_rank(group)
    if rank == 0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier(group)
    sd = {"model": model_chunk.sharded_state_dict(),
          "optimizer": optimizer.sharded_state_dict(model_chunk.sharded_state_dict(), metadata=CHECKPOINT_SHARDING)}
    dist_checkpointing.save(sd, tmp)
    torch.distributed.barrier(group)
    if rank == 0:
        write_layout(tmp, _layout(model_chunk, optimizer))
        publish_directory(tmp, directory)
    torch.distributed.barrier(group)


def load_checkpoint(model_chunk: Any, optimizer: Any, directory: str) -> None:
    """Load a :func:`save_checkpoint` directory into ``model_chunk`` and ``optimizer`` (any DP size;
    a different TP/PP/EP size raises :class:`~optim_staged.config.CheckpointLayoutError` before
    anything is read).

    The optimizer template is built with ``is_loading=True`` after its state exists, so every
    state key (master, exp_avg, exp_avg_sq) is requested from the checkpoint: a checkpoint without
    moments fails to load instead of silently resetting them.
    """
    from megatron.core import dist_checkpointing

    from optim_staged.checkpoint import check_layout

    check_layout(directory, _layout(model_chunk, optimizer))  # TP/PP/EP changes: CheckpointLayoutError
    template = {"model": model_chunk.sharded_state_dict(),
                "optimizer": optimizer.sharded_state_dict(model_chunk.sharded_state_dict(), is_loading=True,
                                                          metadata=CHECKPOINT_SHARDING)}
    loaded = dist_checkpointing.load(template, directory)
    # Megatron's wrappers prefix sharded keys with "module." but load through to the inner module.
    model_sd, want = loaded["model"], set(model_chunk.state_dict())
    while model_sd and not (set(model_sd) & want) and all(k.startswith("module.") for k in model_sd):
        model_sd = {k.removeprefix("module."): v for k, v in model_sd.items()}
    model_chunk.load_state_dict(model_sd)
    optimizer.load_state_dict(loaded["optimizer"])
