"""The student side: Megatron model + StagedAdamW, embedded rollout engine fed by the colocate
publisher, sequence-level warm start, and one MOPD step (rollout → harts tree forward → routed
teachers → MOPD loss → optimizer → publish)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig
from examples.demo.tasks import DOMAINS, TaskData, prompts_from_letters
from examples.demo.teachers import context_len, tiny_cfg, training_loss

TEACHER_OF = {t: f"{t}_teacher" for t in DOMAINS}


def routing_spec():
    from mopd import RoutingSpec

    return RoutingSpec(field="task", routes={t: {TEACHER_OF[t]: 1.0} for t in DOMAINS})


@dataclass
class Student:
    """Everything the student phase holds (one per rank): the Megatron trainer, its residency,
    the rollout engine, the publisher and the colocated cycle over both."""

    model: torch.nn.Module
    ddp: torch.nn.Module
    opt: object
    engine: object
    publisher: object
    spec: object
    residency: object
    cycle: object
    device: torch.device
    hf_dir: str
    version: int = 0
    harts_handle: object = None
    publish_s: list = field(default_factory=list)


def build_student(cfg: DemoConfig, data: TaskData, *, engine_factory=None) -> Student:
    """Student GPT, Megatron DDP, ``get_staged_optimizer`` (host-resident AdamW state), its
    Hugging Face folder ``<out_dir>/student_hf`` (what an SGLang engine loads), the engine of
    ``engine.kind`` (``engine_factory(cfg, spec, hf_dir, device)``, default
    :func:`examples.demo.engine.build_engine`) with a ``Publisher``, the trainer's
    :class:`colocate.Residency` over :func:`colocate.megatron_residency_hooks`, a
    :class:`colocate.ColocatedCycle`, and version 1 published."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from colocate import ColocatedCycle, PublishConfig, Publisher, Residency, megatron_residency_hooks
    from colocate.megatron import model_spec_from_megatron
    from examples.demo.engine import build_engine
    from examples.demo.tasks import VOCAB
    from examples.demo.teachers import run_device
    from mcore_distill.hf import save_hf_checkpoint
    from mcore_distill.testing import build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    device = run_device(cfg)
    seed_all(cfg.seed * 100 + 50)
    model = build_tiny_gpt(tiny_cfg(cfg.student, max_len=context_len(data, cfg))).to(device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_staged_optimizer(StagedOptimizerConfig(residency="staged", clip_grad=1.0,
                                                     adamw=AdamWConfig(lr=cfg.warm_start.lr, weight_decay=0.0),
                                                     slots=SlotConfig(slot_numel=1 << 16, num_slots=2)), [ddp])
    spec = model_spec_from_megatron(model)
    hf_dir = str(Path(cfg.out_dir) / "student_hf")
    save_hf_checkpoint([model], hf_dir, model_type="qwen3", vocab_size=VOCAB)  # atomic, collective
    engine = (engine_factory or build_engine)(cfg, spec, hf_dir, device)
    transport = "inprocess" if cfg.engine.kind == "hf" else "auto"
    publisher = Publisher(engine, PublishConfig(transport=transport))
    residency = Residency(megatron_residency_hooks([ddp], opt), owner=f"trainer{dist.get_rank()}")
    st = Student(model=model, ddp=ddp, opt=opt, engine=engine, publisher=publisher, spec=spec, residency=residency,
                 cycle=ColocatedCycle(residency, engine, publisher), device=device, hf_dir=hf_dir)
    publish(st)
    if cfg.mopd.forward == "tree":
        from harts.megatron import apply_harts

        st.harts_handle = apply_harts(model)
    return st


def _check_version(st: Student) -> None:
    from examples.demo.errors import PublishVerificationError

    got = st.engine.weight_version()
    if got != st.version:
        raise PublishVerificationError(st.version, "verify", RuntimeError(
            f"engine reports weight version {got}, published {st.version}"))


def publish(st: Student, *, version: int | None = None) -> None:
    """Send the trainer's current weights to this rank's engine as the next version (or
    ``version``), both sides resident (outside the colocated cycle: start, warm start, resume)."""
    from colocate.megatron import publish_megatron

    t0 = time.perf_counter()
    st.version = st.version + 1 if version is None else version
    publish_megatron([st.ddp], st.publisher.publish, version=st.version, spec=st.spec,
                     dtype=_publish_dtype(st))
    _check_version(st)
    st.publish_s.append(time.perf_counter() - t0)


def publish_in_cycle(st: Student):
    """The publish half of the colocated cycle (:meth:`colocate.ColocatedCycle.publish`): trainer
    releases optimizer and grads, engine resumes weights, publish, trainer releases weights, engine
    resumes ``cuda_graph`` and ``kv_cache``. Returns the :class:`colocate.PublishReport`."""
    from colocate.megatron import publish_megatron

    t0 = time.perf_counter()
    st.version += 1
    report = publish_megatron([st.ddp], st.cycle.publish, version=st.version, spec=st.spec, dtype=_publish_dtype(st))
    st.publish_s.append(time.perf_counter() - t0)
    return report


def _publish_dtype(st: Student) -> torch.dtype:
    """The dtype the engine takes (its ``param_specs``)."""
    return next(iter(st.engine.param_specs().values()))[1]


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
    the held-out set is split across ranks and the counts all-reduced. Agent workload: greedy
    episodes (:func:`examples.demo.workload.run_episodes`), the domain's key is turn 1's answer
    and ``turn<j>/<domain>`` each turn's."""
    from examples.demo.engine import greedy
    from examples.demo.workload import model_turns, run_episodes

    rank, world, n = dist.get_rank(), dist.get_world_size(), model_turns(cfg)

    def act(ctx: torch.Tensor, turn: int):
        y = greedy(st.engine, ctx.tolist(), n_new=cfg.length)
        return y, torch.zeros(y.shape)

    counts = torch.zeros((n + 1) * len(DOMAINS), dtype=torch.float64, device=st.device)
    for k, task in enumerate(DOMAINS):
        x = data.held_out[task][rank::world]
        if x.shape[0]:
            ep = run_episodes(prompts_from_letters(task, x), data.answer(task, x), n, act)
            for j, y in enumerate(ep.answers):
                counts[(n + 1) * k + j] = data.correct(task, x, y).sum()
        counts[(n + 1) * k + n] = x.shape[0]
    dist.all_reduce(counts)
    out = {t: float(counts[(n + 1) * k] / counts[(n + 1) * k + n]) for k, t in enumerate(DOMAINS)}
    if n > 1:
        out.update({f"turn{j + 1}/{t}": float(counts[(n + 1) * k + j] / counts[(n + 1) * k + n])
                    for k, t in enumerate(DOMAINS) for j in range(n)})
    return out


def trainer_greedy(st: Student, prompts: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's (Megatron) greedy path on ``prompts``: tokens, runner-up tokens and top-1/top-2
    log-prob margins, each ``[N, n_new]`` (:func:`examples.demo.teachers.megatron_greedy_path`)."""
    from examples.demo.teachers import megatron_greedy_path

    return megatron_greedy_path(st.model, prompts, n_new)


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
        st.ddp.zero_grad_buffer()
        st.opt.zero_grad()
        loss = _warm_start_loss(st, cfg, data, distill, counts, g)
        _train_update(st, loss)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(phase="warm start", loss=f"{loss.item():.3f}")
    publish(st)


def _warm_start_loss(st: Student, cfg: DemoConfig, data: TaskData, distill: dict, counts: dict,
                     g: torch.Generator) -> torch.Tensor:
    """Cross entropy on ``counts[task]`` teacher answers per domain: one batch of single-turn rows
    (GRPO), or the agent workload's supervised episodes per domain, weighted by their rows."""
    picks = {}
    for task in DOMAINS:
        if counts[task]:
            x, y = distill[task]
            pick = torch.randint(0, x.shape[0], (counts[task],), generator=g)
            picks[task] = (x[pick], y[pick])
    if cfg.workload.kind != "agent":
        from examples.demo.teachers import answer_loss

        rows = [torch.cat([prompts_from_letters(t, x), y], 1) for t, (x, y) in picks.items()]
        return answer_loss(st.ddp, torch.cat(rows), data.prompt_len)
    n = sum(counts.values())
    return sum(training_loss(st.ddp, cfg, data, t, x, y, g) * (x.shape[0] / n) for t, (x, y) in picks.items())


def student_logprobs(st: Student, ids: torch.Tensor, cfg: DemoConfig) -> tuple[torch.Tensor, float]:
    """``[B, S]`` log π_θ(ids[:, t+1] | ids[:, :t+1]) at ``mopd.temperature`` (with grad) in the label
    layout of the teachers' targets (last column 0), and the compression C = ΣL / T of the packed
    batch (1.0 in ``plain`` mode)."""
    tau = cfg.mopd.temperature
    if cfg.mopd.forward == "tree":
        from harts.megatron import tree_logprobs

        res = tree_logprobs(st.ddp, ids, backend=cfg.mopd.attention_backend, temperature=tau)
        return res.logp, res.batch.compression
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = st.ddp(ids, pos, None).float() / tau
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (0, 1)), 1.0


def build_pool(cfg: DemoConfig, data: TaskData, folders: dict, *, urls: dict | None = None, device=None):
    """The routed teachers in a TeacherPool: one frozen Megatron host (the teacher architecture,
    read from a Hugging Face ``config.json``) shared by the Megatron-served teachers, and an
    :class:`mopd.backends.HTTPTeacher` per HTTP-served domain (``urls``: domain → server URL).
    ``folders``: each teacher's Hugging Face checkpoint folder."""
    from examples.demo.tasks import VOCAB
    from examples.demo.teacher_server import http_teacher
    from mcore_distill.hf import megatron_model_from_hf
    from mopd import TeacherPool, TeacherPoolConfig, TeacherTreeConfig
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost

    urls = urls or {}
    backends = {TEACHER_OF[t]: http_teacher(cfg, TEACHER_OF[t], urls[t], VOCAB) for t in DOMAINS if t in urls}
    local = [t for t in DOMAINS if t not in urls]
    if local:
        n = cfg.mopd.prompts_per_step * cfg.mopd.group_size
        # the host's architecture from a teacher's Hugging Face config.json (weights: each teacher's folder)
        host_model = megatron_model_from_hf(folders[local[0]], make_vocab_size_divisible_by=1, load=False)[0]
        host = MegatronTeacherHost(host_model.to(device or "cpu"), micro_batch_size=n)
        # teachers score the student's rollouts with the same kernels as the student: harts tree packing
        # (each GRPO group's prompt once) and the tree-aware chunked LM head when the student runs trees
        tree = TeacherTreeConfig(enabled=cfg.mopd.forward == "tree", backend=cfg.mopd.attention_backend, align=16,
                                 token_cap=8192)
        for t in local:
            backends[TEACHER_OF[t]] = MegatronTeacher(TEACHER_OF[t], host, folders[t],
                                                      temperature=cfg.mopd.temperature, tree=tree)
    return TeacherPool(backends, config=TeacherPoolConfig())
