"""Build a student and a frozen teacher from an :class:`ArchConfig` and run MOPD steps on tree-packed
GRPO batches (harts) with StagedAdamW, on one device (CUDA, or CPU through ``cpu_compat``).

One step::

    forest = build_forest(rollouts)                         # prompts shared within each group
    ℓ_T = sequence_logprobs(tree_forward(teacher, forest))  # no grad
    ℓθ  = sequence_logprobs(tree_forward(student, forest))  # with grad
    loss = mopd_pg_loss(ℓθ, ℓ_old = sg ℓθ, ℓ_T, mask = response tokens)
    backward → finish_grad_sync → optimizer.step()

The rollouts are synthetic (``harts.workload.grpo_groups``: random tokens), and ℓ_old is the detached
trainer log-prob (on-policy, one update per batch, so ρ = 1): this measures the training side.
Sampling is the rollout engine's job (``colocate``), not timed here.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from examples.train.config import ArchConfig, TrainConfig, TrainConfigError

__all__ = ["arch_from_hf", "build_model", "check_fits", "estimate_bytes", "make_rollouts", "response_mask", "run", "DeviceMemoryError"]


class DeviceMemoryError(MemoryError):
    """The selected model would not fit the device (estimate in the message)."""


def check_fits(cfg: TrainConfig, *, need: int, free: int, total: int) -> None:
    """Raise :class:`DeviceMemoryError` when ``need`` bytes exceed ``run.memory_margin`` of ``free``."""
    r = cfg.run
    if need > r.memory_margin * free:
        raise DeviceMemoryError(
            f"model={cfg.model.name}: about {need / 2**30:.1f} GiB resident (student + teacher weights, fp32 "
            f"grads{', fp32 optimizer state' if r.residency == 'gpu' else ''}) before activations, but only "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free; this entry point runs on one device "
            f"(use expert/tensor parallelism in your trainer, or a scaled-down config)")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def tiny_config(arch: ArchConfig, *, on_cuda: bool = False):
    """The ``mcore_distill.testing.TinyGPTConfig`` (shape + TransformerConfig extras) of ``arch``."""
    from mcore_distill.testing import TinyGPTConfig

    extra: dict = {}
    if arch.hybrid:
        extra.update(linear_conv_kernel_dim=arch.linear_conv_kernel_dim, linear_key_head_dim=arch.linear_key_head_dim,
                     linear_value_head_dim=arch.linear_value_head_dim,
                     linear_num_key_heads=arch.linear_num_key_heads,
                     linear_num_value_heads=arch.linear_num_value_heads)
    if on_cuda:
        extra["use_cpu_initialization"] = False  # initialize on the current CUDA device (fast for 8B)
    return TinyGPTConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_layers=arch.num_layers,
                         num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
                         kv_channels=arch.kv_channels, ffn_hidden_size=arch.ffn_hidden_size,
                         max_sequence_length=arch.max_sequence_length, rotary_base=arch.rotary_base,
                         tie_embeddings=arch.tie_embeddings, num_moe_experts=arch.num_moe_experts,
                         moe_router_topk=arch.moe_router_topk, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                         params_dtype=_dtype(arch.params_dtype), recompute=arch.recompute, extra=extra)


def param_count(arch: ArchConfig) -> int:
    """Parameters of the model ``arch`` builds (closed form; checked against the built model in tests)."""
    H, V, L = arch.hidden_size, arch.vocab_size, arch.num_layers
    d = arch.kv_channels or H // arch.num_attention_heads
    attn = H * d * (arch.num_attention_heads + 2 * arch.num_query_groups) + arch.num_attention_heads * d * H + 2 * d + H
    if arch.num_moe_experts:
        F = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        mlp = arch.num_moe_experts * 3 * H * F + H * arch.num_moe_experts + H
    else:
        mlp = 3 * H * arch.ffn_hidden_size + H
    per = {"A": attn + mlp}
    if arch.hybrid:
        k, v = arch.linear_key_head_dim, arch.linear_value_head_dim
        nk, nv = arch.linear_num_key_heads, arch.linear_num_value_heads
        conv_dim = 2 * nk * k + nv * v
        gdn = (H * (conv_dim + nv * v + 2 * nv) + conv_dim * arch.linear_conv_kernel_dim + 2 * nv + v + nv * v * H + H)
        per["G"] = gdn + mlp
    layers = sum(per[c] for c in (arch.layer_pattern or "A" * L))
    return layers + V * H * (1 if arch.tie_embeddings else 2) + H


def estimate_bytes(arch: ArchConfig, *, residency: str) -> int:
    """Resident device bytes before activations: student and teacher weights, the fp32 gradient
    buffer, and with ``residency='gpu'`` the fp32 master weights and two moments."""
    n = param_count(arch)
    w = torch.finfo(_dtype(arch.params_dtype)).bits // 8
    return n * (2 * w + 4 + (12 if residency == "gpu" else 0))


def arch_from_hf(arch: ArchConfig) -> ArchConfig:
    """``arch`` with its shape fields read from ``arch.hf_path``'s ``config.json``
    (:func:`mcore_distill.hf.hf_arch`)."""
    from mcore_distill.hf import hf_arch

    a = hf_arch(arch.hf_path)
    if a.is_hybrid and a.num_experts:
        raise TrainConfigError(f"model.hf_path={arch.hf_path!r}: MoE hybrids (Qwen3-Next with experts) are not "
                               "supported by this runner")
    pattern = None if a.layer_types is None else "".join("A" if t == "full_attention" else "G" for t in a.layer_types)
    gdn = {} if pattern is None else dict(
        linear_conv_kernel_dim=a.linear_conv_kernel_dim, linear_key_head_dim=a.linear_key_head_dim,
        linear_value_head_dim=a.linear_value_head_dim, linear_num_key_heads=a.linear_num_key_heads,
        linear_num_value_heads=a.linear_num_value_heads)
    return dataclasses.replace(
        arch, name=Path(arch.hf_path).name, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
        num_layers=a.num_layers, num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups,
        kv_channels=a.head_dim, ffn_hidden_size=a.ffn_hidden_size, rotary_base=int(a.rope_theta),
        tie_embeddings=a.tie_embeddings, max_sequence_length=a.max_position_embeddings,
        num_moe_experts=a.num_experts, moe_router_topk=a.num_experts_per_tok if a.num_experts else arch.moe_router_topk,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, layer_pattern=pattern, **gdn)


def _from_hf(arch: ArchConfig, path: str, device: torch.device):
    """``mcore_distill.hf.megatron_model_from_hf`` in ``arch.params_dtype``; no vocabulary padding
    (TP = 1), so the log-probs are over exactly the HF vocabulary."""
    from mcore_distill.hf import megatron_model_from_hf

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if arch.recompute else {}
    (model,) = megatron_model_from_hf(path, params_dtype=_dtype(arch.params_dtype), make_vocab_size_divisible_by=1,
                                      use_cpu_initialization=device.type != "cuda", **extra)
    return model


def build_model(arch: ArchConfig, *, seed: int, device: torch.device, hf_path: str | None = None):
    """A Megatron ``GPTModel`` for ``arch`` on ``device`` with harts applied (tree attention, RoPE by
    depth; hybrid stacks get ``TreeGatedDeltaNet`` mixers): random init, or the weights of the HF
    folder ``hf_path``. Model-parallel state must exist."""
    from megatron.core.models.gpt import GPTModel

    from harts.megatron import apply_harts
    from mcore_distill.testing import build_tiny_gpt, seed_all, transformer_config

    seed_all(seed)
    cfg = tiny_config(arch, on_cuda=device.type == "cuda")
    if hf_path is not None:
        model = _from_hf(arch, hf_path, device)
    elif arch.layer_pattern is not None:
        from harts.gdn_megatron import hybrid_block_spec

        model = GPTModel(config=transformer_config(cfg), transformer_layer_spec=hybrid_block_spec(arch.layer_pattern),
                         vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_sequence_length,
                         share_embeddings_and_output_weights=cfg.tie_embeddings, position_embedding_type="rope",
                         rotary_base=cfg.rotary_base)
    else:
        model = build_tiny_gpt(cfg)
    model = model.to(device=device, dtype=cfg.params_dtype)
    apply_harts(model)
    return model


def make_rollouts(cfg: TrainConfig, *, step: int) -> tuple[list[list[int]], torch.Tensor, list[float] | None]:
    """This step's rollouts (seeded by ``run.seed`` and ``step``): sequences, the loss mask in
    :func:`harts.sequence_logprobs` layout, and checker rewards (``agent`` only)."""
    w = cfg.workload
    seed = cfg.run.seed * 7919 + step
    if w.kind == "agent":
        from examples.agent import ScriptedPolicy, ToyTokenizer, agent_batch, make_tasks

        b = agent_batch(make_tasks(w.num_groups, seed=seed), ScriptedPolicy(p_error=w.agent_p_error), ToyTokenizer(),
                        group_size=w.group_size, seed=seed)
        return b.seqs, b.label_mask(), b.rewards
    from harts.workload import grpo_groups

    seqs = grpo_groups(w.num_groups, prompt_len=w.prompt_len, response_len=w.response_len, n=w.group_size,
                       vocab_size=cfg.model.vocab_size, seed=seed, response_jitter=w.response_jitter)
    return seqs, response_mask(seqs, w.prompt_len), None


def response_mask(seqs: list[list[int]], prompt_len: int) -> torch.Tensor:
    """[Σ(L_i − 1)] bool, in :func:`harts.sequence_logprobs` layout: True where the predicted token
    (position t ≥ 1) is a response token (t ≥ ``prompt_len``)."""
    parts = [torch.arange(1, len(s)) >= prompt_len for s in seqs]
    return torch.cat(parts)


def _backend(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.run.attention_backend != "auto":
        return cfg.run.attention_backend
    return "flex" if device.type == "cuda" else "dense"


def run(cfg: TrainConfig) -> dict:
    """Build student (DDP + optimizer) and teacher, run ``run.steps`` MOPD steps; return metrics.

    Needs an initialized default process group and Megatron parallel state (TP = PP = 1)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from harts import build_forest, sequence_logprobs, sharing_stats
    from harts.megatron import make_tree_params, tree_forward
    from mopd import MOPDLossConfig
    from mopd.objectives import TokenTargets, mopd_pg_loss
    from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    cfg.validate()
    if cfg.model.hf_path is not None:
        cfg = dataclasses.replace(cfg, model=arch_from_hf(cfg.model))
        cfg.validate()
    r = cfg.run
    cuda = r.device == "cuda" or (r.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    need = estimate_bytes(cfg.model, residency=r.residency)
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        check_fits(cfg, need=need, free=free, total=total)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    student = build_model(cfg.model, seed=r.seed, device=device, hf_path=cfg.model.hf_path)
    teacher = build_model(cfg.model, seed=r.seed + 1, device=device,
                          hf_path=cfg.model.teacher_hf_path or cfg.model.hf_path).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    bf16 = cfg.model.params_dtype == "bfloat16"
    if bf16:
        student, teacher = Float16Module(student.config, student), Float16Module(teacher.config, teacher)
    ddp = DistributedDataParallel(student.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), student)
    opt = get_staged_optimizer(StagedOptimizerConfig(residency=r.residency, clip_grad=1.0,
                                                     adamw=AdamWConfig(lr=r.lr, weight_decay=0.0),
                                                     slots=SlotConfig(slot_numel=r.slot_numel, num_slots=2,
                                                                      pin_memory=cuda)), [ddp])
    build_s = time.perf_counter() - t0
    backend = _backend(cfg, device)
    loss_cfg = MOPDLossConfig(is_cap=r.is_cap, adv_clip=r.adv_clip)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for step in range(r.steps):
        seqs, mask, rewards = make_rollouts(cfg, step=step)
        sync()
        t_start = time.perf_counter()
        forest = build_forest(seqs).to(device)
        params = make_tree_params(forest, backend=backend, model=student)  # GDN plans for hybrid stacks
        with torch.no_grad():
            t_node, _ = tree_forward(teacher, forest, params=params, temperature=r.temperature,
                                     chunk_size=r.head_chunk_size)
            t_lp = sequence_logprobs(t_node.float(), forest)
        sync()
        t_teacher = time.perf_counter()
        ddp.train()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        s_node, _ = tree_forward(ddp, forest, params=params, temperature=r.temperature, chunk_size=r.head_chunk_size)
        lp = sequence_logprobs(s_node.float(), forest)
        mask = mask.to(device)
        targets = TokenTargets(logp_sum=t_lp, weight_sum=torch.ones_like(t_lp))
        out = mopd_pg_loss(lp, lp.detach(), targets, mask, config=loss_cfg)
        out.loss.backward()
        ddp.finish_grad_sync()
        _, gnorm, _ = opt.step()
        sync()
        t_end = time.perf_counter()
        st = sharing_stats(forest)
        kl = float(((lp.detach() - t_lp) * mask).sum() / mask.sum())
        rows.append({"step": step, "step_s": t_end - t_start, "teacher_s": t_teacher - t_start,
                     "train_s": t_end - t_teacher, "tokens": st.total_tokens, "tree_tokens": st.tree_tokens,
                     "sharing_ratio": st.sharing_ratio, "compression": st.compression,
                     "tokens_per_s": st.total_tokens / (t_end - t_start), "loss": float(out.loss.detach()),
                     "sampled_kl": kl, "gnorm": float(gnorm or 0.0),
                     "reward": None if rewards is None else sum(rewards) / len(rewards)})
    timed = rows[1:] or rows
    mean_s = sum(x["step_s"] for x in timed) / len(timed)
    return {"model": cfg.model.name, "params": sum(p.numel() for p in ddp.parameters()),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "backend": backend,
            "residency": r.residency, "build_s": build_s, "steps": rows,
            "tokens_per_s": sum(x["tokens"] for x in timed) / sum(x["step_s"] for x in timed), "step_s": mean_s,
            "peak_memory_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "estimated_resident_GiB": need / 2**30}
