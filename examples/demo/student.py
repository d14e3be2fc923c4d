"""The student side: Megatron model + StagedAdamW, embedded rollout engine fed by the colocate
publisher, sequence-level warm start, and one MOPD step (rollout → harts tree forward → routed
teachers → MOPD loss → optimizer → publish)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig
from examples.demo.tasks import DOMAINS, TaskData, prompts_from_letters
from examples.demo.teachers import answer_loss, cosine_lr, tiny_cfg

TEACHER_OF = {t: f"{t}_teacher" for t in DOMAINS}


def routing_spec():
    from mopd import RoutingSpec

    return RoutingSpec(field="task", routes={t: {TEACHER_OF[t]: 1.0} for t in DOMAINS})


@dataclass
class Student:
    """Everything the student phase holds (one per rank)."""

    model: torch.nn.Module
    ddp: torch.nn.Module
    opt: object
    engine: object
    publisher: object
    spec: object
    version: int = 0
    harts_handle: object = None
    publish_s: list = field(default_factory=list)


def build_student(cfg: DemoConfig, data: TaskData) -> Student:
    """Student GPT, Megatron DDP, ``get_staged_optimizer`` (host-resident AdamW state), an
    ``HFEngine`` with an in-process ``Publisher``, and version 1 published."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from colocate import EngineConfig, HFEngine, PublishConfig, Publisher
    from colocate.megatron import model_spec_from_megatron
    from mcore_distill.testing import build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    seed_all(cfg.seed * 100 + 50)
    model = build_tiny_gpt(tiny_cfg(cfg.student, max_len=data.prompt_len + cfg.length))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_staged_optimizer(StagedOptimizerConfig(residency="staged", clip_grad=1.0,
                                                     adamw=AdamWConfig(lr=cfg.warm_start.lr, weight_decay=0.0),
                                                     slots=SlotConfig(slot_numel=1 << 16, num_slots=2)), [ddp])
    spec = model_spec_from_megatron(model)
    engine = HFEngine(spec, EngineConfig(max_new_tokens=cfg.length, temperature=cfg.mopd.temperature))
    st = Student(model=model, ddp=ddp, opt=opt, engine=engine,
                 publisher=Publisher(engine, PublishConfig(transport="inprocess")), spec=spec)
    publish(st)
    if cfg.mopd.forward == "tree":
        from harts.megatron import apply_harts

        st.harts_handle = apply_harts(model)
    return st


def publish(st: Student) -> None:
    """Send the trainer's current weights to this rank's engine as the next version."""
    from colocate.megatron import publish_megatron

    t0 = time.perf_counter()
    st.version += 1
    publish_megatron([st.ddp], st.publisher.publish, version=st.version, spec=st.spec)
    if st.engine.weight_version() != st.version:
        raise RuntimeError(f"engine reports weight version {st.engine.weight_version()}, published {st.version}")
    st.publish_s.append(time.perf_counter() - t0)


def _set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def _train_update(st: Student, loss: torch.Tensor) -> float:
    loss.backward()
    st.ddp.finish_grad_sync()
    _, gnorm, _ = st.opt.step()
    return float(gnorm or 0.0)


def engine_accuracy(st: Student, cfg: DemoConfig, data: TaskData) -> dict[str, float]:
    """Held-out greedy exact match per domain through the rollout engine (the published weights);
    the held-out set is split across ranks and the counts all-reduced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.zeros(2 * len(DOMAINS), dtype=torch.float64)
    for k, task in enumerate(DOMAINS):
        x = data.held_out[task][rank::world]
        if x.shape[0]:
            res = st.engine.generate(prompts_from_letters(task, x).tolist(), max_new_tokens=cfg.length,
                                     temperature=0.0)
            counts[2 * k] = data.correct(task, x, torch.tensor(res.tokens)).sum()
        counts[2 * k + 1] = x.shape[0]
    dist.all_reduce(counts)
    return {t: float(counts[2 * k] / counts[2 * k + 1]) for k, t in enumerate(DOMAINS)}


def warm_start(st: Student, cfg: DemoConfig, data: TaskData, distill: dict, *, bar=None) -> None:
    """Sequence-level KD: cross entropy on the teachers' greedy answers, domains mixed by ``warm_start.mix``."""
    w = cfg.warm_start
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(31 * cfg.seed + rank + 3)
    st.ddp.train()
    total = sum(w.mix.values())
    counts = {t: round(w.batch * w.mix[t] / total) for t in DOMAINS}
    for step in range(w.steps):
        _set_lr(st.opt, w.lr)
        rows = []
        for task in DOMAINS:
            if counts[task] == 0:
                continue
            x, y = distill[task]
            pick = torch.randint(0, x.shape[0], (counts[task],), generator=g)
            rows.append(torch.cat([prompts_from_letters(task, x[pick]), y[pick]], 1))
        st.ddp.zero_grad_buffer()
        st.opt.zero_grad()
        loss = answer_loss(st.ddp, torch.cat(rows), data.prompt_len)
        _train_update(st, loss)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(phase="warm start", loss=f"{loss.item():.3f}")
    publish(st)


def student_logprobs(st: Student, ids: torch.Tensor, cfg: DemoConfig) -> tuple[torch.Tensor, float]:
    """``[B, S]`` log π_θ(ids[:, t+1] | ids[:, :t+1]) at ``mopd.temperature`` (with grad) in the label
    layout of the teachers' targets (last column 0), and the compression C = ΣL / T of the packed
    batch (1.0 in ``plain`` mode)."""
    tau = cfg.mopd.temperature
    if cfg.mopd.forward == "tree":
        from harts.megatron import tree_logprobs

        res = tree_logprobs(st.ddp, ids, backend=cfg.mopd.attention_backend, temperature=tau)
        return res.logp, res.batch.compression
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = st.ddp(ids, pos, None).float() / tau
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (0, 1)), 1.0


def mopd_step(st: Student, cfg: DemoConfig, data: TaskData, pool, step: int, g: torch.Generator) -> dict:
    """One on-policy step on this rank's prompts; returns per-step metrics (rank-local)."""
    from mopd import MOPDLossConfig, TokenBatch
    from mopd.objectives import mopd_pg_loss
    from mopd.routing import score_routed, stamp_routes

    m = cfg.mopd
    rank, L, P = dist.get_rank(), cfg.length, data.prompt_len
    t0 = time.perf_counter()
    tasks = [DOMAINS[(i + rank + step) % len(DOMAINS)] for i in range(m.prompts_per_step)]
    xs = torch.cat([data.sample(t, 1, g) for t in tasks])
    prompts = [prompts_from_letters(t, x[None])[0].tolist() for t, x in zip(tasks, xs, strict=True)]
    rep = [p for p in prompts for _ in range(m.group_size)]
    res = st.engine.generate(rep, max_new_tokens=L, temperature=m.temperature,
                             seed=(cfg.seed * 1_000_003 + step * 9973 + rank * 101) % (1 << 62))
    t_roll = time.perf_counter()
    gen = torch.tensor(res.tokens)                                    # [B, L]
    ids = torch.cat([torch.tensor(rep), gen], 1)                      # [B, S]
    B, S = ids.shape
    old = torch.zeros(B, S)
    old[:, P - 1:P - 1 + L] = torch.tensor(res.logprobs)              # label layout: old[:, t] ↔ ids[:, t+1]
    samples = [{"task": t} for t in tasks for _ in range(m.group_size)]
    spec = routing_spec()
    routes = stamp_routes(samples, spec)                              # samples[i]["mopd_route"] = its task
    batch = TokenBatch(ids, torch.full((B,), S), torch.full((B,), P - 1))
    mask = batch.label_mask()                                         # [B, S]: the L answer labels
    targets, _ = score_routed(pool, batch, routes, spec, old_logp=old, loss_mask=mask)
    t_score = time.perf_counter()

    st.ddp.train()
    st.ddp.zero_grad_buffer()
    st.opt.zero_grad()
    _set_lr(st.opt, cosine_lr(step, m.steps, m.lr, 0.1))
    lp, compression = student_logprobs(st, ids, cfg)                  # [B, S], the targets' layout
    out = mopd_pg_loss(lp, old, targets, mask, config=MOPDLossConfig(is_cap=m.is_cap, adv_clip=m.adv_clip))
    gnorm = _train_update(st, out.loss)
    t_train = time.perf_counter()
    publish(st)
    t_pub = time.perf_counter()

    kl_tok = (old - targets.logp_sum) * mask                          # sampled reverse-KL estimate per token
    seq_task = torch.tensor([DOMAINS.index(t) for t in tasks]).repeat_interleave(m.group_size)
    ok = torch.stack([data.correct(t, x[None].expand(m.group_size, -1), gen[i * m.group_size:(i + 1) * m.group_size])
                      for i, (t, x) in enumerate(zip(tasks, xs, strict=True))]).reshape(-1)
    metrics = {"tokens": float(B * S), "compact_tokens": float(B * S / compression), "gnorm": gnorm,
               "engine_trainer_max_abs": float(((lp.detach() - old) * mask).abs().max()),
               "time_rollout": t_roll - t0, "time_score": t_score - t_roll, "time_train": t_train - t_score,
               "time_publish": t_pub - t_train}
    for k, t in enumerate(DOMAINS):
        rows = seq_task == k
        metrics[f"{t}/kl_sum"] = float(kl_tok[rows].sum())
        metrics[f"{t}/tokens"] = float(mask[rows].sum())
        metrics[f"{t}/correct"] = float(ok[rows].sum())
        metrics[f"{t}/samples"] = float(rows.sum())
    return metrics


def build_pool(cfg: DemoConfig, data: TaskData, folders: dict):
    """One frozen Megatron host (teacher architecture) shared by both teachers, in a TeacherPool;
    ``folders``: each teacher's Hugging Face checkpoint folder."""
    from mcore_distill.hf import megatron_model_from_hf
    from mopd import TeacherPool, TeacherPoolConfig, TeacherTreeConfig
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost

    n = cfg.mopd.prompts_per_step * cfg.mopd.group_size
    # the host's architecture from a teacher's Hugging Face config.json (weights: each teacher's folder)
    host_model = megatron_model_from_hf(folders[DOMAINS[0]], make_vocab_size_divisible_by=1, load=False)[0]
    host = MegatronTeacherHost(host_model, micro_batch_size=n)
    # teachers score the student's rollouts with the same kernels as the student: harts tree packing
    # (each GRPO group's prompt once) and the tree-aware chunked LM head when the student runs trees
    tree = TeacherTreeConfig(enabled=cfg.mopd.forward == "tree", backend=cfg.mopd.attention_backend, align=16,
                             token_cap=8192)
    backends = {TEACHER_OF[t]: MegatronTeacher(TEACHER_OF[t], host, folders[t], temperature=cfg.mopd.temperature,
                                               tree=tree)
                for t in DOMAINS}
    return TeacherPool(backends, config=TeacherPoolConfig())
