"""The colocated MOPD loop: one code path for the embedded engine (CPU) and SGLang (GPU).

Per step, on every rank (``colocate.ColocatedCycle`` orders the residency transitions)::

    generate        engine samples GRPO groups, or multi-turn agent episodes (``workload.kind``,
                    :mod:`examples.demo.workload`) (trainer weights, grads, optimizer released)
    release/resume  cycle.to_training(): engine releases kv_cache, weights, cuda_graph; trainer resumes
    teacher_scoring routed teachers score the rows (Megatron host, and the HTTP-served teacher)
    train           harts tree forward, MOPD loss on the model's tokens, backward, DP grad reduce-scatter
    optimizer       staged AdamW step (state in host slabs)
    [checkpoint]    every ``checkpoint_every`` steps: Megatron + optimizer, HF folder
    publish         cycle.publish(): trainer releases, engine resumes weights, Publisher, engine resumes
    verify          engine reports the version; every ``verify.every`` steps its greedy outputs on
                    fixed prompts equal the trainer's
    [eval]          every ``mopd.eval_every`` steps: held-out accuracy through the engine

Failures raise the typed errors of :mod:`examples.demo.errors`; :func:`examples.demo.pipeline.run_demo`
then stops every child and leaves the last complete checkpoint for ``resume=true``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from examples.demo import checkpoint
from examples.demo.config import DemoConfig
from examples.demo.engine import greedy, resident_bytes, sample
from examples.demo.errors import EngineCrashedError, PublishVerificationError, TeacherServerDownError
from examples.demo.student import (
    TEACHER_OF,
    Student,
    _set_lr,
    engine_accuracy,
    publish_in_cycle,
    routing_spec,
    student_logprobs,
    trainer_greedy,
)
from examples.demo.tasks import DOMAINS, TaskData, prompts_from_letters
from examples.demo.teachers import cosine_lr
from examples.demo.timeline import PhaseTimeline


@dataclass
class RunnerHooks:
    """Seams for fault-injection tests, called on every rank: ``before_step(step, job)`` and
    ``after_publish(step, job)``."""

    before_step: Callable | None = None
    after_publish: Callable | None = None


@dataclass
class Job:
    """The state of one MOPD run on this rank."""

    cfg: DemoConfig
    data: TaskData
    st: Student
    pool: object
    g: torch.Generator
    server: object = None
    hooks: RunnerHooks = field(default_factory=RunnerHooks)
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    accuracy: dict = field(default_factory=dict)
    step: int = 0
    last_good_version: int | None = None
    last_checkpoint: int | None = None
    greedy_checks: list = field(default_factory=list)
    trainer_state_bytes: int = 0
    engine_full_bytes: int | None = None
    timeline: PhaseTimeline = None


# ----- memory accounting ------------------------------------------------------------------------
def _ddp_storage_bytes(st: Student, attr: str) -> int:
    return sum(getattr(b, attr).untyped_storage().nbytes() for b in st.ddp.buffers if getattr(b, attr, None) is not None)


def trainer_resident_bytes(st: Student) -> int:
    """Bytes the trainer holds on its device now: DDP param and grad buffers (0 once a residency
    release resized them) and the staged optimizer's device slots."""
    from optim_staged.megatron import staged_leaves

    return (_ddp_storage_bytes(st, "param_data") + _ddp_storage_bytes(st, "grad_data")
            + sum(int(x.gpu_state_bytes) for x in staged_leaves(st.opt)))


def _slabs(leaf):
    """The host slabs of a staged optimizer, under Megatron's and optim_staged's wrappers (None before its first step)."""
    while leaf is not None and getattr(leaf, "slabs", None) is None:
        leaf = getattr(leaf, "optimizer", None)
    return None if leaf is None else leaf.slabs


def trainer_state_bytes(st: Student) -> int:
    """Params + grads + optimizer state (the host slabs: fp32 masters and moments), all resident."""
    from optim_staged.megatron import staged_leaves

    slabs = sum(int(s.nbytes) for s in map(_slabs, staged_leaves(st.opt)) if s is not None)
    return _ddp_storage_bytes(st, "param_data") + _ddp_storage_bytes(st, "grad_data") + slabs


def engine_resident_fraction(job: Job, freed: dict[str, int], *, whole_process: bool = False) -> float | None:
    """Share of the engine's weights + KV cache + graphs still held after it released for
    training. HF engine: its tensors' bytes now over their bytes while generating. SGLang:
    Σ_t max(0, H_t − F_t) / Σ_t H_t over the tags t (weights, kv_cache, cuda_graph), H_t the tag's
    bytes by SGLang's own accounting at start (:meth:`colocate.SGLangEngine.tag_bytes`) and F_t
    the bytes its release returned (free device memory before/after the tag; a tag cannot make up
    for another). ``whole_process``: (E − Σ_t F_t) / E over the device memory E the engine's start
    took instead (its CUDA context included: what stays while the process lives)."""
    now = resident_bytes(job.st.engine)
    if now is not None:
        return now / job.engine_full_bytes if job.engine_full_bytes else None
    if whole_process:
        whole = getattr(job.st.engine, "footprint_bytes", None)
        return max(0, whole - sum(freed.values())) / whole if whole else None
    held = getattr(job.st.engine, "held_bytes", None)
    if not held or not sum(held.values()):
        return None
    return sum(max(0, h - freed.get(t, 0)) for t, h in held.items()) / sum(held.values())


# ----- one step ----------------------------------------------------------------------------------
def _rollout(job: Job, k: int):
    """This rank's prompts (alternating domains) and the engine's rows for them: a GRPO group per
    prompt, or agent episodes (:func:`examples.demo.workload.run_episodes`, the engine acting each turn)."""
    from examples.demo.workload import model_turns, run_episodes

    cfg, m, rank = job.cfg, job.cfg.mopd, dist.get_rank()
    tasks = [DOMAINS[(i + rank + k - 1) % len(DOMAINS)] for i in range(m.prompts_per_step)]
    xs = torch.cat([job.data.sample(t, 1, job.g) for t in tasks])
    prompts = [prompts_from_letters(t, x[None])[0].tolist() for t, x in zip(tasks, xs, strict=True)]
    rep = torch.tensor([p for p in prompts for _ in range(m.group_size)])
    truth = torch.cat([job.data.answer(t, x[None]) for t, x in zip(tasks, xs, strict=True)]).repeat_interleave(
        m.group_size, 0)

    def act(ctx: torch.Tensor, turn: int):
        seed = (cfg.seed * 1_000_003 + (k - 1) * 9973 + rank * 101 + turn * 7919) % (1 << 62)
        try:
            tokens, logps = sample(job.st.engine, ctx.tolist(), n_new=cfg.length, temperature=m.temperature, seed=seed)
        except Exception as e:  # noqa: BLE001 - whatever the engine raised, the step failed in the engine
            raise EngineCrashedError(k, e) from e
        return torch.tensor(tokens), torch.tensor(logps)

    return tasks, xs, run_episodes(rep, truth, model_turns(cfg), act)


def _score(job: Job, k: int, batch, routes, old, mask):
    from mopd.errors import TeacherServerError, TeacherStateError, TeacherTimeoutError
    from mopd.routing import score_routed

    try:
        targets, _ = score_routed(job.pool, batch, routes, routing_spec(), old_logp=old, loss_mask=mask)
        return targets
    except (TeacherServerError, TeacherTimeoutError, TeacherStateError) as e:
        http = [TEACHER_OF[t] for t in job.cfg.teacher.http_routes]
        if http and f"'{http[0]}'" in str(e):  # the HTTP teacher's failure (its messages name it)
            raise TeacherServerDownError(k, http[0], e) from e
        raise


def _verify_prompts(job: Job) -> torch.Tensor:
    n = job.cfg.verify.prompts
    return torch.cat([prompts_from_letters(t, job.data.held_out[t][:n]) for t in DOMAINS])


@dataclass
class Rollout:
    """One step's samples on this rank, in the teachers' label layout."""

    tasks: list[str]
    xs: torch.Tensor          # [prompts, L] letters of each prompt
    answers: list             # per model turn [B, L] sampled answers (one turn for GRPO)
    batch: object             # mopd.TokenBatch of the rows [B, S] (prompt, answers, observations)
    old: torch.Tensor         # [B, S] behaviour log-probs: old[:, t] ↔ ids[:, t + 1]
    mask: torch.Tensor        # [B, S] the labels of the model's tokens (every turn's answer)
    turn_masks: list          # per turn [B, S] its answer labels
    routes: list[str]


def _generate(job: Job, k: int) -> Rollout:
    from mopd import TokenBatch
    from mopd.routing import stamp_routes

    st, tl, P = job.st, job.timeline, job.data.prompt_len
    with tl.phase("generate"):
        tasks, xs, ep = _rollout(job, k)
        tl.set("trainer_resident_fraction", trainer_resident_bytes(st) / max(job.trainer_state_bytes, 1))
        job.engine_full_bytes = resident_bytes(st.engine) or job.engine_full_bytes
    B, S = ep.ids.shape
    batch = TokenBatch(ep.ids.to(st.device), torch.full((B,), S, device=st.device),
                       torch.full((B,), P - 1, device=st.device))
    routes = stamp_routes([{"task": t} for t in tasks for _ in range(job.cfg.mopd.group_size)], routing_spec())
    return Rollout(tasks, xs, ep.answers, batch, ep.old.to(st.device), ep.mask.to(st.device), ep.turn_masks, routes)


def _handover_to_training(job: Job) -> None:
    """``ColocatedCycle.to_training`` timed as two phases (engine release, trainer resume), with
    the bytes each side reported and the engine's resident fraction afterwards."""
    st, tl = job.st, job.timeline
    engine_events = len(st.engine.residency.events)
    t0 = time.perf_counter()
    handover = st.cycle.to_training()
    total = time.perf_counter() - t0
    released_s = sum(e.seconds for e in st.engine.residency.events[engine_events:])
    tl.add_seconds("release", released_s)
    tl.add_seconds("resume", total - released_s)
    tl.add_bytes("release", {f"engine/{t}": n for t, n in handover.engine_released.items()})
    tl.add_bytes("resume", {f"trainer/{t}": n for t, n in handover.trainer_resumed.items()})
    tl.set("engine_resident_fraction", engine_resident_fraction(job, handover.engine_released))
    if getattr(st.engine, "footprint_bytes", None):
        tl.set("engine_process_resident_fraction",
               engine_resident_fraction(job, handover.engine_released, whole_process=True))


def _train(job: Job, k: int, r: Rollout, targets) -> tuple[torch.Tensor, float, float]:
    """MOPD loss on the harts tree batch, backward, DP grad sync, staged optimizer step;
    returns (ℓθ [B, S], compression C, gradient norm)."""
    from mopd import MOPDLossConfig
    from mopd.objectives import mopd_pg_loss

    st, tl, m = job.st, job.timeline, job.cfg.mopd
    with tl.phase("train"):
        st.ddp.train()
        st.ddp.zero_grad_buffer()
        st.opt.zero_grad()
        _set_lr(st.opt, cosine_lr(k - 1, m.steps, m.lr, 0.1))
        lp, compression = student_logprobs(st, r.batch.input_ids, job.cfg)   # [B, S], the targets' layout
        out = mopd_pg_loss(lp, r.old, targets, r.mask, config=MOPDLossConfig(is_cap=m.is_cap, adv_clip=m.adv_clip))
        out.loss.backward()
        st.ddp.finish_grad_sync()
    with tl.phase("optimizer"):
        _, gnorm, _ = st.opt.step()
    return lp.detach(), compression, float(gnorm or 0.0)


def _publish(job: Job) -> None:
    """``ColocatedCycle.publish`` of the next version, with the bytes both sides moved."""
    st, tl = job.st, job.timeline
    marks = [(owner, res, len(res.events)) for owner, res in (("trainer", st.residency), ("engine", st.engine.residency))]
    with tl.phase("publish"):
        report = publish_in_cycle(st)
        tl.set("publish_ms", 1e3 * sum(report.timings.values()) if report is not None else None)
    for owner, res, n in marks:
        tl.add_bytes("publish", {f"{owner}/{e.op}/{e.tag}": e.nbytes for e in res.events[n:]})


def unexplained_rows(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     tie_margin: float) -> torch.Tensor:
    """Rows ``[N]`` of the engine's greedy outputs ``got [N, n]`` that the trainer's greedy path
    ``want`` = (tokens, runner-up, margin), see :func:`examples.demo.student.trainer_greedy`, does
    not explain. A row is explained when it equals the trainer's tokens, or when it first differs
    at a position j where the engine took the trainer's runner-up and the trainer's margin
    ``log p(top-1) - log p(top-2)`` at j is at most ``tie_margin`` nats (a near-tie that a bf16
    engine may flip; after j the two paths condition on different prefixes and are not compared)."""
    tokens, runner_up, margin = want
    diff = got != tokens
    j = diff.float().argmax(1, keepdim=True)                          # first differing position
    tie = (got.gather(1, j) == runner_up.gather(1, j)) & (margin.gather(1, j) <= tie_margin)
    return diff.any(1) & ~tie.squeeze(1)


def _verify(job: Job, k: int, want: tuple | None) -> None:
    """The engine serves the published version and, when ``want`` (the trainer's greedy path on
    the verification prompts) is given, greedy outputs that path explains (:func:`unexplained_rows`);
    else :class:`PublishVerificationError`."""
    st, cfg = job.st, job.cfg
    with job.timeline.phase("verify"):
        got_version = st.engine.weight_version()
        if got_version != st.version:
            raise PublishVerificationError(st.version, "verify", RuntimeError(
                f"engine reports weight version {got_version}, published {st.version}"))
        if want is None:
            return
        got = greedy(st.engine, _verify_prompts(job).tolist(), n_new=cfg.length)
        diff = got != want[0]
        flipped = diff.any(1)
        exact = float(flipped.float().mean())
        bad = float(unexplained_rows(got, want, cfg.verify.tie_margin).float().mean())
        first = diff.float().argmax(1, keepdim=True)  # first differing position of each row
        job.greedy_checks.append({"step": k, "mismatch": exact, "unexplained": bad, "flip_margins": [
            round(float(x), 4) for x in want[2].gather(1, first).squeeze(1)[flipped]]})
        job.timeline.set("verify/greedy_mismatch", exact)
        job.timeline.set("verify/greedy_unexplained", bad)
        if bad > cfg.verify.max_mismatch:
            raise PublishVerificationError(st.version, "verify", RuntimeError(
                f"engine greedy outputs differ from the trainer's on {bad:.1%} of {got.shape[0]} fixed prompts "
                f"beyond near-ties of verify.tie_margin={cfg.verify.tie_margin} nats "
                f"(verify.max_mismatch={cfg.verify.max_mismatch}; {exact:.1%} differ at all)"))


def _metrics(job: Job, r: Rollout, targets, lp: torch.Tensor, compression: float, gnorm: float) -> dict:
    """Rank-local sums: tokens, reverse-KL estimate, exact samples per domain (the last turn's
    answer; per turn too for agent episodes); the engine/trainer gap."""
    g = job.cfg.mopd.group_size
    mask, old, lp = r.mask.cpu(), r.old.cpu(), lp.cpu()
    kl_tok = (old - targets.logp_sum.cpu()) * mask                        # sampled reverse-KL estimate per token
    seq_task = torch.tensor([DOMAINS.index(t) for t in r.tasks]).repeat_interleave(g)
    ok = [torch.stack([job.data.correct(t, x[None].expand(g, -1), y[i * g:(i + 1) * g])
                       for i, (t, x) in enumerate(zip(r.tasks, r.xs, strict=True))]).reshape(-1) for y in r.answers]
    B, S = mask.shape
    out = {"tokens": float(B * S), "compact_tokens": float(B * S / compression), "gnorm": gnorm,
           "engine_trainer_max_abs": float(((lp - old) * mask).abs().max())}
    for i, t in enumerate(DOMAINS):
        rows = seq_task == i
        out[f"{t}/kl_sum"] = float(kl_tok[rows].sum())
        out[f"{t}/tokens"] = float(mask[rows].sum())
        out[f"{t}/correct"] = float(ok[-1][rows].sum())
        out[f"{t}/samples"] = float(rows.sum())
        if len(r.answers) > 1:
            for j, tm in enumerate(r.turn_masks):
                out[f"turn{j + 1}/{t}/kl_sum"] = float(kl_tok[rows][tm[rows]].sum())
                out[f"turn{j + 1}/{t}/tokens"] = float(tm[rows].sum())
                out[f"turn{j + 1}/{t}/correct"] = float(ok[j][rows].sum())
    if len(r.answers) > 1:  # what a trainer that runs every turn's context as its own row would process
        out["turn_tokens"] = float(sum(B * (int(tm[0].nonzero().max()) + 2) for tm in r.turn_masks))
    return out


def run_step(job: Job, k: int) -> dict:
    """Step ``k`` (1-based) on this rank, in the order of the module docstring; returns its
    rank-local metrics (the timeline accumulates in ``job.timeline``)."""
    cfg, st = job.cfg, job.st
    if job.hooks.before_step:
        job.hooks.before_step(k, job)
    r = _generate(job, k)
    _handover_to_training(job)
    with job.timeline.phase("teacher_scoring"):
        targets = _score(job, k, r.batch, r.routes, r.old, r.mask)
    lp, compression, gnorm = _train(job, k, r, targets)
    want = None
    if k % cfg.verify.every == 0 or k == cfg.mopd.steps:
        with job.timeline.phase("verify"):
            want = trainer_greedy(st, _verify_prompts(job), cfg.length)  # the weights about to be published
    if checkpoint.due(cfg, k):
        with job.timeline.phase("checkpoint"):
            checkpoint.save_weights(st, cfg, k)
    _publish(job)
    if job.hooks.after_publish:
        job.hooks.after_publish(k, job)
    _verify(job, k, want)
    job.last_good_version = st.version
    return _metrics(job, r, targets, lp, compression, gnorm)


def reduce_row(k: int, m: dict, timeline_row: dict, wall: float, device: torch.device) -> dict:
    """The step's history row: sums over ranks, max of the engine/trainer gap and wall time,
    this rank's (rank 0's) timeline and memory."""
    keys = sorted(x for x in m if x not in ("engine_trainer_max_abs", "gnorm"))
    v = torch.tensor([m[x] for x in keys], dtype=torch.float64, device=device)
    dist.all_reduce(v)
    mx = torch.tensor([m["engine_trainer_max_abs"], wall], dtype=torch.float64, device=device)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    s = dict(zip(keys, v.tolist(), strict=True))
    row = {"step": k, "tokens_per_s": s["tokens"] / float(mx[1]), "sharing_ratio": s["tokens"] / s["compact_tokens"],
           "engine_trainer_max_abs": float(mx[0]), "gnorm": m["gnorm"], "step_s": float(mx[1])}
    for d in DOMAINS:
        row[f"reward/{d}"] = -s[f"{d}/kl_sum"] / max(s[f"{d}/tokens"], 1.0)
        row[f"kl/{d}"] = s[f"{d}/kl_sum"] / max(s[f"{d}/tokens"], 1.0)
        row[f"sample_accuracy/{d}"] = s[f"{d}/correct"] / max(s[f"{d}/samples"], 1.0)
        for j in range(1, 1 + sum(1 for x in s if x.startswith("turn") and x.endswith(f"/{d}/kl_sum"))):
            row[f"turn{j}/reward/{d}"] = -s[f"turn{j}/{d}/kl_sum"] / max(s[f"turn{j}/{d}/tokens"], 1.0)
            row[f"turn{j}/sample_accuracy/{d}"] = s[f"turn{j}/{d}/correct"] / max(s[f"{d}/samples"], 1.0)
    if "turn_tokens" in s:
        row["sharing_ratio_turns"] = s["turn_tokens"] / s["compact_tokens"]
    row.update(timeline_row)
    return row


def runner_state(job: Job) -> dict:
    return {"step": job.step, "version": job.st.version, "rng": checkpoint.rng_state(job.g),
            "history": job.history, "evals": job.evals, "accuracy": job.accuracy, "greedy_checks": job.greedy_checks}


def run_mopd(job: Job, *, bar=None, log=None) -> None:
    """Steps ``job.step + 1 .. mopd.steps``; ``log(row)`` receives every history row (rank 0)."""
    cfg = job.cfg
    for k in range(job.step + 1, cfg.mopd.steps + 1):
        t0 = time.perf_counter()
        m = run_step(job, k)
        row = reduce_row(k, m, job.timeline.flush(), time.perf_counter() - t0, job.st.device)
        job.history.append(row)
        job.step = k
        if k % cfg.mopd.eval_every == 0 or k == cfg.mopd.steps:
            job.evals.append({"step": k, **engine_accuracy(job.st, cfg, job.data)})
            row.update({f"accuracy/{d}": v for d, v in job.evals[-1].items() if d != "step"})
        if checkpoint.due(cfg, k):
            checkpoint.finalize(cfg, k, runner_state(job))
            job.last_checkpoint = k
        if log is not None:
            log(row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({**{f"acc/{d[:3]}": f"{job.evals[-1][d]:.2f}" for d in DOMAINS},
                             **{f"r/{d[:3]}": f"{row[f'reward/{d}']:+.2f}" for d in DOMAINS},
                             "C": f"{row['sharing_ratio']:.2f}"})
