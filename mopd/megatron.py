"""Megatron-Core integration: token log-probs, the frozen Megatron teacher, the loss hook.

* :func:`token_logprobs` — log π(label) from vocab-parallel logits with Megatron's
  ``vocab_parallel_cross_entropy`` (the student's kernel), at a temperature.
* :class:`MegatronTeacherHost` / :class:`MegatronTeacher` — one frozen model in the trainer's
  parallel layout shared by every teacher of that architecture; switching teachers writes the
  next teacher's weights into it in place (shard files checked key/shape/dtype, or a Megatron
  ``dist_checkpointing`` folder). Scoring runs Megatron's forward-only schedule, so TP/PP work
  as in training; log-probs exist on the last pipeline stage (zeros elsewhere), where the
  student's loss is computed too. With a :class:`~mopd.config.TeacherTreeConfig` enabled, a
  teacher scores harts tree batches instead (prefix forest → compact row → tree attention →
  harts' chunked LM head → per-row log-probs restored by index), the student's kernels when it
  trains on tree batches. ``logprob_fn`` maps (model output, micro-batch) to per-token
  log-probs for other custom layouts.
* :func:`mopd_loss_func` — the loss for a Megatron ``forward_step_func``: returns
  ``(loss_sum, num_tokens, metrics)`` (the per-token-loss convention), metrics per route.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from mcore_distill.validate import check_type
from mopd.backends import HTTPTeacher, TokenBatch, read_teacher_shard, write_teacher_shard
from mopd.config import MOPDConfig, MOPDLossConfig, TeacherTreeConfig
from mopd.errors import TeacherStateError
from mopd.objectives import TokenTargets, compose_losses, mopd_pg_loss
from mopd.teachers import TeacherPool

__all__ = [
    "MOPDMicroBatch",
    "build_teacher_pool",
    "MegatronTeacher",
    "MegatronTeacherHost",
    "mopd_loss_func",
    "save_teacher_checkpoint",
    "shard_tag",
    "token_logprobs",
]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   tp_group: torch.distributed.ProcessGroup | None = None,
                   vocab_size: int | None = None) -> torch.Tensor:
    """``log softmax(logits / τ)[label]`` per token, fp32, from vocab-parallel ``logits
    [b, s, V/TP]`` and ``labels [b, s]``; differentiable (Megatron's cross-entropy kernel).
    ``vocab_size``: the real vocabulary when Megatron's is padded (the HF model's
    ``vocab_size``): the padded columns get −∞, so the softmax is the HF model's over ``vocab_size``
    entries (a padded row loaded from HF is zeros, logit 0, which would otherwise take mass)."""
    scaled = logits.float() / temperature  # a fresh tensor: the kernel edits its input in place
    if vocab_size is not None:
        local = scaled.shape[-1]
        start = local * (torch.distributed.get_rank(tp_group) if tp_group is not None else 0)
        if vocab_size < start + local:
            scaled[..., max(vocab_size - start, 0):] = float("-inf")
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels, tp_group=tp_group)


def _groups(pg_collection: Any | None) -> tuple[Any, Any]:
    if pg_collection is not None:
        return pg_collection.tp, pg_collection.pp
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group()


def shard_tag(pg_collection: Any | None = None) -> str:
    """``tp{rank}of{size}-pp{rank}of{size}`` of this rank: a shard written in one layout is
    not found in another, so layouts cannot be mixed silently."""
    tp, pp = _groups(pg_collection)
    r = torch.distributed.get_rank
    s = torch.distributed.get_world_size
    return f"tp{r(tp)}of{s(tp)}-pp{r(pp)}of{s(pp)}"


def _tensors(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    out = {}
    for i, m in enumerate(chunks):
        for k, v in m.state_dict(keep_vars=True).items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = v
    return out


def save_teacher_checkpoint(model: torch.nn.Module | Sequence[torch.nn.Module], folder: str, *,
                            pg_collection: Any | None = None) -> None:
    """Write this model-parallel rank's weights as a teacher shard (atomic); only data-parallel
    rank 0 writes. Collective over the default group (a barrier at the end)."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    dp_rank = (pg_collection.dp.rank() if pg_collection is not None
               else parallel_state.get_data_parallel_rank())
    if dp_rank == 0:
        write_teacher_shard(_tensors(chunks), folder, rank_tag=shard_tag(pg_collection))
    torch.distributed.barrier()


class MegatronTeacherHost:
    """A frozen model (one chunk: no virtual pipeline) that teachers share.

    ``free()`` drops the device storage of every parameter/buffer of the state dict;
    ``write(tensors)`` (re)allocates and copies a teacher's weights in; ``snapshot()`` copies
    the current weights to host memory (pinned when on CUDA). ``owner`` names the teacher
    whose weights are in the model (None when freed).
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], *, pg_collection: Any | None = None,
                 micro_batch_size: int = 1) -> None:
        self.chunks = list(model) if isinstance(model, Sequence) else [model]
        if len(self.chunks) != 1:
            raise ValueError(f"MegatronTeacherHost takes one model chunk; got {len(self.chunks)} "
                             "(virtual-pipeline teachers are not supported)")
        for m in self.chunks:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        self.pg_collection = pg_collection
        self.micro_batch_size = micro_batch_size
        self._targets = _tensors(self.chunks)
        self.layout = {k: (tuple(v.shape), v.dtype) for k, v in self._targets.items()}
        self.device = next(iter(self._targets.values())).device
        self.owner: str | None = None
        self.harts_handle: Any = None

    def enable_tree(self) -> None:
        """Make the model tree-capable (:func:`harts.megatron.apply_harts`, once; plain batches
        run unchanged afterwards). Raises ``TreeIncompatibleError`` for configurations harts
        cannot run exactly (context parallelism, MTP, token-dropping MoE, MLA)."""
        if self.harts_handle is None:
            from harts.megatron import apply_harts

            self.harts_handle = apply_harts(self.chunks[0])

    def free(self) -> None:
        for v in self._targets.values():
            v.data = torch.empty(0, dtype=v.dtype, device=self.device)
        self.owner = None

    def write(self, tensors: dict[str, torch.Tensor], owner: str) -> None:
        for k, v in self._targets.items():
            shape, dtype = self.layout[k]
            if tuple(v.data.shape) != shape:
                v.data = torch.empty(shape, dtype=dtype, device=self.device)
            v.data.copy_(tensors[k], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.owner = owner

    def snapshot(self) -> dict[str, torch.Tensor]:
        pin = self.device.type == "cuda"
        return {k: v.detach().to("cpu").pin_memory() if pin else v.detach().to("cpu", copy=True)
                for k, v in self._targets.items()}

    def load_dist_checkpoint(self, folder: str, owner: str) -> None:
        """Load a Megatron ``dist_checkpointing`` folder in place (collective; main thread)."""
        from megatron.core import dist_checkpointing

        for k, v in self._targets.items():  # storage must exist for an in-place load
            shape, dtype = self.layout[k]
            if tuple(v.data.shape) != shape:
                v.data = torch.empty(shape, dtype=dtype, device=self.device)
        for m in self.chunks:
            sharded = m.sharded_state_dict()
            state = dist_checkpointing.load(sharded, folder)
            m.load_state_dict(state, strict=False)
        self.owner = owner

    def load_hf(self, folder: str, owner: str) -> None:
        """Load an HF checkpoint folder in place (:func:`mcore_distill.hf.load_hf_checkpoint`:
        collective, each rank reads its slices; nothing is written unless every check passes)."""
        from mcore_distill.hf import load_hf_checkpoint

        for k, v in self._targets.items():  # storage must exist for an in-place load
            shape, dtype = self.layout[k]
            if tuple(v.data.shape) != shape:
                v.data = torch.empty(shape, dtype=dtype, device=self.device)
        load_hf_checkpoint(self.chunks, folder, pg_collection=self.pg_collection)
        self.owner = owner


@dataclass(frozen=True, slots=True)
class _Micro:
    ids: torch.Tensor
    labels: torch.Tensor


class MegatronTeacher:
    """One teacher's weights for a :class:`MegatronTeacherHost` (see module docstring).

    ``checkpoint`` is a folder of teacher shards (:func:`save_teacher_checkpoint`; prefetchable
    on a host thread, memory-mapped), a ``dist_checkpointing`` folder or an HF folder (both
    loaded in ``load``, collectively).
    ``tree`` (enabled) scores harts tree batches (:meth:`_score_tree`); ``logprob_fn(output,
    micro)`` replaces :func:`token_logprobs` for other batch layouts (not with ``tree``).
    ``vocab_size``: the teacher's real vocabulary when the host's output layer is padded; the
    padded entries leave the softmax. None: an HF folder's ``config.json`` ``vocab_size`` (read at
    :meth:`load`), else every row counts (a Megatron checkpoint trained with its padding).
    """

    def __init__(self, teacher_id: str, host: MegatronTeacherHost, checkpoint: str, *, temperature: float = 1.0,
                 logprob_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
                 tree: TeacherTreeConfig | None = None, vocab_size: int | None = None) -> None:
        if tree is not None and tree.enabled and logprob_fn is not None:
            raise ValueError(f"teacher {teacher_id!r}: logprob_fn and an enabled tree config both define the "
                             "scoring layout; pass one")
        self.teacher_id, self.host, self.checkpoint = teacher_id, host, checkpoint
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.logprob_fn = logprob_fn
        self.tree = tree if tree is not None and tree.enabled else None
        self.last_tree_stats: dict[str, float] | None = None
        self._staged: dict[str, torch.Tensor] | None = None
        self._offloaded: dict[str, torch.Tensor] | None = None

    def _is_shard_folder(self) -> bool:
        return any(Path(self.checkpoint).glob("shard_*.pt"))

    def _is_hf_folder(self) -> bool:
        return (Path(self.checkpoint) / "config.json").is_file() and any(Path(self.checkpoint).glob("*.safetensors"))

    def prefetch(self) -> None:
        if self._staged is None and self._is_shard_folder():
            self._staged = read_teacher_shard(self.checkpoint, rank_tag=shard_tag(self.host.pg_collection),
                                              expect=self.host.layout)

    def load(self) -> None:
        if self._is_shard_folder():
            self.prefetch()
            self.host.write(self._staged, self.teacher_id)
            self._staged = None
        elif self._is_hf_folder():
            self.host.load_hf(self.checkpoint, self.teacher_id)
            if self.vocab_size is None:
                from mcore_distill.hf import read_hf_config

                self.vocab_size = int(read_hf_config(self.checkpoint)["vocab_size"])
        else:
            self.host.load_dist_checkpoint(self.checkpoint, self.teacher_id)

    def offload(self) -> None:
        if self.host.owner == self.teacher_id:
            self._offloaded = self.host.snapshot()
            self.host.free()

    def onload(self) -> None:
        if self._offloaded is None:
            raise TeacherStateError(f"teacher {self.teacher_id!r} has no offloaded weights to onload")
        self.host.write(self._offloaded, self.teacher_id)
        self._offloaded = None

    def close(self) -> None:
        self._staged = self._offloaded = None
        if self.host.owner == self.teacher_id:
            self.host.free()

    @torch.no_grad()
    def score(self, batch: TokenBatch) -> torch.Tensor:
        """``logp [B, L]`` on the last pipeline stage (zeros on other stages): fp32 (Megatron's
        cross-entropy kernel computes in fp32); tree scoring keeps an fp64 model's fp64."""
        if self.host.owner != self.teacher_id:
            raise TeacherStateError(f"teacher {self.teacher_id!r} is not the host's resident teacher "
                                    f"(owner: {self.host.owner!r})")
        if self.tree is not None:
            return self._score_tree(batch)
        ids = batch.input_ids.to(self.host.device)
        B, L = ids.shape
        mbs = self.host.micro_batch_size
        pad = (-B) % mbs
        ids_p = torch.cat([ids, ids[:1].expand(pad, L)]) if pad else ids
        labels = torch.cat([ids_p[:, 1:], ids_p[:, -1:]], dim=1)
        micro = [_Micro(ids_p[i:i + mbs], labels[i:i + mbs]) for i in range(0, ids_p.shape[0], mbs)]
        tp_group = _groups(self.host.pg_collection)[0]
        temperature, custom, vocab_size = self.temperature, self.logprob_fn, self.vocab_size

        def step(data_iterator, model):
            mb = next(data_iterator)
            pos = torch.arange(L, device=mb.ids.device).expand_as(mb.ids)
            output = model(mb.ids, pos, None)

            def collect(output_tensor, non_loss_data=True):
                if custom is not None:
                    return custom(output_tensor, mb)
                return token_logprobs(output_tensor, mb.labels, temperature=temperature, tp_group=tp_group,
                                      vocab_size=vocab_size)

            return output, collect

        fb = get_forward_backward_func()
        chunks = self.host.chunks
        kw = {} if self.host.pg_collection is None else {"pg_collection": self.host.pg_collection}
        res = fb(forward_step_func=step, data_iterator=iter(micro), model=chunks[0], num_microbatches=len(micro),
                 seq_length=L, micro_batch_size=mbs, forward_only=True, collect_non_loss_data=True, **kw)
        if not res:  # not the last pipeline stage
            return torch.zeros(B, L, dtype=torch.float32, device=ids.device)
        logp = torch.cat([r.float() for r in res])[:B]
        return torch.where(batch.label_mask().to(logp.device), logp, torch.zeros_like(logp))

    def _score_tree(self, batch: TokenBatch) -> torch.Tensor:
        """harts tree scoring (:func:`harts.megatron.tree_logprobs` through Megatron's forward-only
        schedule): rows ``input_ids[b, :lengths[b]]`` are planned into micro-batches of at most
        ``token_cap`` compact rows (sequences sorted, shared prefixes once, THD fallback for
        micro-batches that barely compress), each run as one packed row with tree attention (Gated
        DeltaNet plans for hybrid teachers) and harts' chunked LM head at the teacher
        temperature, and written back as label-layout rows (``logp[b, t]`` for
        ``t < lengths[b] − 1``). Under pipeline parallelism without ``variable_seq_lengths`` every
        micro-batch is padded to the longest one."""
        from harts import PlannerConfig
        from harts.megatron import tree_logprobs

        cfg = self.tree
        self.host.enable_tree()
        planner = PlannerConfig(token_cap=cfg.token_cap, align=cfg.align,
                                fallback_compression=cfg.fallback_compression, dp_size=1)
        res = tree_logprobs(self.host.chunks[0], batch.input_ids, batch.lengths, temperature=self.temperature,
                            backend=cfg.backend, planner=planner, chunk_size=cfg.chunk_size, forward_only=True,
                            pg_collection=self.host.pg_collection, vocab_size=self.vocab_size)
        plan = res.batch
        self.last_tree_stats = {"compression": plan.compression, "micro_batches": float(len(plan.microbatches)),
                                "rows": float(plan.rows), "tokens": float(batch.lengths.sum())}
        out = res.logp.to(torch.promote_types(res.logp.dtype, torch.float32)).to(batch.input_ids.device)
        return torch.where(batch.label_mask().to(out.device), out, torch.zeros_like(out))


def build_teacher_pool(config: MOPDConfig, *, host: MegatronTeacherHost | None = None,
                       logprob_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
                       on_event: Callable[[str, str], None] | None = None) -> TeacherPool:
    """A :class:`TeacherPool` for every teacher of ``config`` (nothing is loaded yet).

    Megatron teachers share ``host`` (required if any is configured) and score harts tree
    batches when ``config.teacher_tree.enabled``; every teacher scores at
    ``config.rollout_temperature``; HTTP teachers take their timeouts, retries, batch size and
    temperature capability from their :class:`~mopd.config.TeacherSpec`.
    """
    check_type("config", config, MOPDConfig)
    backends = {}
    for tid, spec in config.teachers.items():
        if spec.backend == "http":
            backends[tid] = HTTPTeacher.from_spec(tid, spec, temperature=config.rollout_temperature)
        else:
            if host is None:
                raise ValueError(f"teacher {tid!r} uses backend='megatron' but no MegatronTeacherHost was given")
            if not spec.weights_path:
                raise ValueError(f"teacher {tid!r}: backend='megatron' needs teachers.{tid}.checkpoint or .hf_path")
            backends[tid] = MegatronTeacher(tid, host, spec.weights_path, temperature=config.rollout_temperature,
                                            logprob_fn=logprob_fn, tree=config.teacher_tree, vocab_size=spec.vocab_size)
    return TeacherPool(backends, config=config.pool, on_event=on_event)


@dataclass(kw_only=True)
class MOPDMicroBatch:
    """Per-micro-batch inputs of :func:`mopd_loss_func`; token tensors share one shape ``[*]``
    (``[b, s]`` for plain batches, the packed token layout for tree batches).

    ``labels`` (next tokens), ``loss_mask`` (bool), ``old_logp`` (behaviour), ``targets``
    (aggregated teacher targets), ``route_ids`` (int route index per token, −1 = none),
    optional ``normalization_mask`` and ``rl_advantages``, plus ``extra`` for custom hooks.
    """

    labels: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    targets: TokenTargets
    route_ids: torch.Tensor
    normalization_mask: torch.Tensor | None = None
    rl_advantages: torch.Tensor | None = None
    extra: dict | None = None

    def __post_init__(self) -> None:
        check_type("MOPDMicroBatch.targets", self.targets, TokenTargets)
        shape = self.loss_mask.shape if isinstance(self.loss_mask, torch.Tensor) else None
        for name in ("labels", "loss_mask", "old_logp", "route_ids", "normalization_mask", "rl_advantages"):
            value = getattr(self, name)
            optional = name in ("normalization_mask", "rl_advantages")
            check_type(f"MOPDMicroBatch.{name}", value, torch.Tensor | None if optional else torch.Tensor)
            if value is not None and value.shape != shape:
                raise ValueError(f"MOPDMicroBatch.{name} has shape {tuple(value.shape)}, the token tensors have "
                                 f"{tuple(shape)} (loss_mask): one value per token; route_ids are per token too "
                                 "(expand a per-sample [b] vector with route_ids[:, None].expand_as(loss_mask))")
        if self.targets.logp_sum.shape != shape:
            raise ValueError(f"MOPDMicroBatch.targets has shape {tuple(self.targets.logp_sum.shape)}, the token "
                             f"tensors have {tuple(shape)} (loss_mask)")
        if self.route_ids.dtype.is_floating_point or self.route_ids.dtype == torch.bool:
            raise ValueError(f"MOPDMicroBatch.route_ids must hold integer route indices, got {self.route_ids.dtype}")


_ROUTE_METRICS = ("loss", "reward", "is_weight", "is_capped_frac", "adv_clip_frac", "teacher_weight")


def mopd_loss_func(micro: MOPDMicroBatch, output_tensor: torch.Tensor, *, config: MOPDLossConfig,
                   route_names: Sequence[str], temperature: float = 1.0,
                   logprob_fn: Callable[[torch.Tensor, MOPDMicroBatch], torch.Tensor] | None = None,
                   rl_loss_fn: Callable[[torch.Tensor, MOPDMicroBatch], torch.Tensor] | None = None,
                   tp_group: Any | None = None,
                   vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss for Megatron's ``forward_step_func``: ``return output, partial(mopd_loss_func, micro, config=...)``.

    Student log-probs come from ``logprob_fn(output, micro)`` or :func:`token_logprobs`
    (``vocab_size``: the student's real vocabulary when its output layer is padded, as the engine
    that sampled it has).
    Total = ``rl_coef · rl_loss_fn(ℓθ, micro) + distill_coef · L_mopd_sum`` (sums over tokens;
    a zero coefficient skips its term, ``rl_loss_fn`` is then not called). Returns
    ``(loss_sum, num_tokens, metrics)``; every metric is a ``[sum, count]`` fp32 pair (Megatron
    reports sum/count): ``mopd/<metric>`` overall and ``mopd/<route>/<metric>`` for metrics
    loss, reward (−reverse KL estimate), is_weight, is_capped_frac, adv_clip_frac,
    teacher_weight, plus ``mopd/<route>/tokens`` as ``[tokens, 1]``.
    """
    check_type("micro", micro, MOPDMicroBatch)
    check_type("config", config, MOPDLossConfig)
    if logprob_fn is not None:
        student = logprob_fn(output_tensor, micro)
    else:
        student = token_logprobs(output_tensor, micro.labels, temperature=temperature, tp_group=tp_group,
                                 vocab_size=vocab_size)
    out = mopd_pg_loss(student, micro.old_logp, micro.targets, micro.loss_mask, config=config,
                       normalization_mask=micro.normalization_mask, rl_advantages=micro.rl_advantages)
    rl_sum = rl_loss_fn(student, micro) if config.rl_coef != 0.0 else None
    total = compose_losses(rl_loss=rl_sum, distill_loss=out.loss_sum if config.distill_coef != 0.0 else None,
                           rl_coef=config.rl_coef, distill_coef=config.distill_coef)
    metrics = _route_metrics(out, micro, student, route_names)
    return total, out.num_tokens.to(torch.int), metrics


@torch.no_grad()
def _route_metrics(out: Any, micro: MOPDMicroBatch, student: torch.Tensor,
                   route_names: Sequence[str]) -> dict[str, torch.Tensor]:
    mask = micro.loss_mask.bool()
    st = out.stats
    lp = torch.where(mask, student.detach(), torch.zeros_like(student))
    per_token = {
        "loss": -(st["rho"] * st["advantage"]),
        "reward": st["reward"],
        "is_weight": st["rho"],
        "is_capped_frac": st["capped"].to(lp.dtype),
        "adv_clip_frac": st["adv_clipped"].to(lp.dtype),
        "teacher_weight": torch.where(mask, micro.targets.weight_sum, torch.zeros_like(lp)).to(lp.dtype),
    }
    R = len(route_names)
    codes = torch.where(mask & (micro.route_ids >= 0), micro.route_ids, torch.full_like(micro.route_ids, R)).reshape(-1)
    counts = torch.zeros(R + 1, dtype=torch.float32, device=codes.device).index_add_(
        0, codes, torch.ones_like(codes, dtype=torch.float32))
    metrics: dict[str, torch.Tensor] = {}
    n_all = mask.sum().float()
    for name, v in per_token.items():
        v = v.reshape(-1).float()
        sums = torch.zeros(R + 1, dtype=torch.float32, device=codes.device).index_add_(0, codes, v)
        metrics[f"mopd/{name}"] = torch.stack([v.sum(), n_all])
        for r, rn in enumerate(route_names):
            metrics[f"mopd/{rn}/{name}"] = torch.stack([sums[r], counts[r]])
    for r, rn in enumerate(route_names):
        metrics[f"mopd/{rn}/tokens"] = torch.stack([counts[r], torch.ones_like(counts[r])])
    return metrics
