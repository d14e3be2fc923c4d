"""Teacher training (supervised, Megatron DDP + distributed optimizer), greedy evaluation,
the sequence-level distillation set, and the config-hash-keyed teacher cache."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig, ModelConfig
from examples.demo.tasks import DOMAINS, VOCAB, TaskData, prompts_from_letters

CACHE_FORMAT = 3  # 3: models carry CONTEXT_MARGIN more positions


class TeacherNotConvergedError(RuntimeError):
    """A trained teacher is below ``teacher.min_accuracy`` on its held-out prompts."""


CONTEXT_MARGIN = 16
"""Positions beyond prompt + answer in every model's ``max_position_embeddings``: SGLang refuses a
request whose input + ``max_new_tokens`` reaches the context length (RoPE has no learned table, so
the margin changes no number)."""


def context_len(data: TaskData, cfg: DemoConfig) -> int:
    from examples.demo.workload import episode_len, model_turns

    return episode_len(data.prompt_len, cfg.length, model_turns(cfg)) + CONTEXT_MARGIN


def tiny_cfg(m: ModelConfig, *, max_len: int):
    from mcore_distill.testing import TinyGPTConfig

    return TinyGPTConfig(vocab_size=VOCAB, hidden_size=m.hidden_size, num_layers=m.num_layers,
                         num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                         ffn_hidden_size=m.ffn_hidden_size, max_sequence_length=max_len)


def cosine_lr(step: int, total: int, lr: float, min_ratio: float) -> float:
    """``lr · (r + (1 − r)(1 + cos(π step/total))/2)``."""
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * step / max(total, 1))))


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def run_device(cfg: DemoConfig) -> torch.device:
    """This rank's device: ``cuda:<current>`` for ``device=cuda``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def teacher_model_config(cfg: DemoConfig, task: str) -> ModelConfig:
    """The architecture of ``task``'s teacher: ``teacher.http_model`` when it is HTTP-served."""
    return cfg.teacher.http_model if task in cfg.teacher.http_routes else cfg.teacher.model


def masked_loss(model, rows: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the labels ``label_mask [N, S]`` selects (column t ↔ ``rows[:, t + 1]``)."""
    rows, mask = rows.to(model_device(model)), label_mask.to(model_device(model))
    pos = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    per_token = model(rows, pos, None, labels=torch.roll(rows, -1, dims=1)).float()  # [N, S]
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def training_loss(model, cfg: DemoConfig, data: TaskData, task: str, x: torch.Tensor, good: torch.Tensor,
                  g: torch.Generator) -> torch.Tensor:
    """Cross entropy on ``good [N, L]`` answers to ``x``: single-turn rows for GRPO (:func:`answer_loss`);
    for the agent workload the episodes of :func:`examples.demo.workload.supervised_episodes`."""
    prompts = prompts_from_letters(task, x)
    if cfg.workload.kind != "agent":
        return answer_loss(model, torch.cat([prompts, good], 1), data.prompt_len)
    from examples.demo.workload import model_turns, supervised_episodes

    rows, mask = supervised_episodes(prompts, data.answer(task, x), good, model_turns(cfg), g, letters=cfg.letters,
                                     p_wrong=cfg.workload.p_wrong)
    return masked_loss(model, rows, mask)


def answer_loss(model, rows: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Mean cross entropy of the answer tokens of ``rows [N, P + L]`` given their prefix."""
    rows = rows.to(model_device(model))
    pos = torch.arange(rows.shape[1]).expand_as(rows)
    per_token = model(rows, pos, None, labels=torch.roll(rows, -1, dims=1))  # [N, S]
    return per_token[:, prompt_len - 1: -1].float().mean()


@torch.no_grad()
def megatron_greedy_path(model, prompts: torch.Tensor, n_new: int, *, batch: int = 256
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy continuation of equal-length ``prompts [N, P]`` (full recompute) with, at every
    generated position, the runner-up token and the margin ``log p(top-1) - log p(top-2)``
    (nats): three ``[N, n_new]`` tensors (tokens, runner-up, margin)."""
    toks, second, margins, dev = [], [], [], model_device(model)
    for s in range(0, prompts.shape[0], batch):
        seq, ru, mg = prompts[s:s + batch].to(dev), [], []
        for _ in range(n_new):
            pos = torch.arange(seq.shape[1], device=dev).expand_as(seq)
            top = torch.log_softmax(model(seq, pos, None)[:, -1].float(), -1).topk(2, -1)
            ru.append(top.indices[:, 1])
            mg.append(top.values[:, 0] - top.values[:, 1])
            seq = torch.cat([seq, top.indices[:, :1]], 1)
        toks.append(seq[:, prompts.shape[1]:].cpu())
        second.append(torch.stack(ru, 1).cpu())
        margins.append(torch.stack(mg, 1).cpu())
    return torch.cat(toks), torch.cat(second), torch.cat(margins)


def megatron_greedy(model, prompts: torch.Tensor, n_new: int, *, batch: int = 256) -> torch.Tensor:
    """Greedy continuation ``[N, n_new]`` of equal-length ``prompts [N, P]`` (full recompute)."""
    return megatron_greedy_path(model, prompts, n_new, batch=batch)[0]


def cache_key(cfg: DemoConfig, world: int) -> str:
    """Hash of everything that determines the trained teachers."""
    key = {"format": CACHE_FORMAT, "device": cfg.device, "teacher": asdict(cfg.teacher), "length": cfg.length,
           "letters": cfg.letters, "shift": cfg.shift, "seed": cfg.seed, "held_out": cfg.held_out, "world": world}
    if cfg.workload.kind == "agent":  # teachers trained on episodes (GRPO keys unchanged)
        key["workload"] = {"turns": cfg.workload.turns, "p_wrong": cfg.workload.p_wrong}
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_teacher(task: str, cfg: DemoConfig, data: TaskData, *, bar=None) -> tuple[torch.nn.Module, float]:
    """Train one teacher on ``task`` across the default group; returns (model, held-out accuracy)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mcore_distill.testing import build_tiny_gpt, seed_all

    t = cfg.teacher
    rank = dist.get_rank()
    seed_all(cfg.seed * 100 + DOMAINS.index(task) + 1)
    model = build_tiny_gpt(tiny_cfg(teacher_model_config(cfg, task), max_len=context_len(data, cfg)))
    model.to(run_device(cfg))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr * t.min_lr_ratio,
                                                 weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=True,
                                                 bf16=False, fp16=False), [ddp])
    g = torch.Generator().manual_seed(1000 * cfg.seed + 17 * rank + DOMAINS.index(task))
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, t.steps, t.lr, t.min_lr_ratio)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        x = data.sample(task, t.batch, g)
        loss = training_loss(ddp, cfg, data, task, x, data.answer(task, x), g)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        if bar is not None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(teacher=task, loss=f"{loss.item():.3f}")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    acc = greedy_accuracy(model, task, data)
    del opt, ddp
    return model, acc


def greedy_accuracy(model, task: str, data: TaskData) -> float:
    x = data.held_out[task]
    gen = megatron_greedy(model, prompts_from_letters(task, x), data.length)
    return float(data.correct(task, x, gen).float().mean())


def prepare_teachers(cfg: DemoConfig, data: TaskData, *, bar=None) -> dict:
    """Train (or load from the cache) both teachers. Collective over the default group.

    Returns ``{"folders": {task: Hugging Face folder}, "accuracy": {task: float}, "distill": {task:
    (x, y)}, "cached": bool}``: each teacher is written as a Hugging Face checkpoint folder
    (``config.json`` + safetensors, :func:`mcore_distill.hf.save_hf_checkpoint`), which is what the
    MOPD stage loads (:func:`mcore_distill.hf.megatron_model_from_hf`); the distillation set holds
    ``teacher.distill_prompts`` training prompts per domain with the teacher's greedy answers.
    """
    from mcore_distill.atomic import atomic_torch_save
    from mcore_distill.hf import save_hf_checkpoint

    world = dist.get_world_size()
    root = Path(cfg.out_dir) / "cache" / cache_key(cfg, world)
    meta_path = root / "meta.pt"
    complete = meta_path.exists() and all(any((root / t).glob("*.safetensors")) for t in DOMAINS)
    if cfg.use_cache and complete:  # an incomplete cache folder (a deleted weights file) is retrained
        meta = torch.load(meta_path, weights_only=True)
        if bar is not None:
            bar.update(cfg.teacher.steps * len(DOMAINS))
        return {"folders": {t: str(root / t) for t in DOMAINS}, "accuracy": meta["accuracy"],
                "distill": {t: (meta[f"{t}_x"], meta[f"{t}_y"]) for t in DOMAINS}, "cached": True}
    accuracy, distill = {}, {}
    g = torch.Generator().manual_seed(7919 * cfg.seed + 5)  # same on every rank
    for task in DOMAINS:
        model, acc = train_teacher(task, cfg, data, bar=bar)
        accuracy[task] = acc
        if acc < cfg.teacher.min_accuracy:
            raise TeacherNotConvergedError(
                f"teacher '{task}' reached {acc:.1%} held-out exact match after teacher.steps={cfg.teacher.steps}, "
                f"below teacher.min_accuracy={cfg.teacher.min_accuracy}: a distillation table would be misleading; "
                "raise teacher.steps or teacher.lr")
        x = data.sample(task, cfg.teacher.distill_prompts, g)
        distill[task] = (x, megatron_greedy(model, prompts_from_letters(task, x), data.length))
        save_hf_checkpoint([model], root / task, model_type="qwen3", vocab_size=VOCAB)  # atomic, collective
        del model
    if dist.get_rank() == 0:
        meta = {"accuracy": accuracy, **{f"{t}_x": distill[t][0] for t in DOMAINS},
                **{f"{t}_y": distill[t][1] for t in DOMAINS}}
        atomic_torch_save(meta, meta_path)
    dist.barrier()
    return {"folders": {t: str(root / t) for t in DOMAINS}, "accuracy": accuracy, "distill": distill,
            "cached": False}
