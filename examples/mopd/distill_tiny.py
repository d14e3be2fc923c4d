"""End-to-end MOPD on a tiny Megatron GPT: on-policy rollouts, routed teachers, Megatron step.

Two frozen Megatron teachers ("math_t", "code_t") share one resident model and are swapped in
place; each prompt has a task type (math, code, or mixed = a 50/50 blend of both teachers).
Each step: the student samples continuations (recording behaviour log-probs), the pool scores
each sample with exactly its route's teachers, and Megatron's schedule trains the student with
``mopd_loss_func`` (Megatron DDP + Adam). Every 10 steps it prints the exact full-vocabulary
reverse KL to the route's teachers at the first sampled token of each route's prompts.

What to expect: a slow, noisy decline of that KL (about 10% in 80 steps at ``--lr 3e-2``): the
sampled-token estimator has no baseline and the random teachers depend on the whole context.
This is an integration example, not a recipe.

Run (CPU, ~1 min): ``python examples/mopd/distill_tiny.py --steps 80``; on a GPU it uses CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_distill import cpu_compat  # noqa: E402
from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron, seed_all  # noqa: E402
from mopd import MOPDLossConfig, RoutingSpec, TeacherPool, TeacherPoolConfig, TokenBatch  # noqa: E402
from mopd.routing import score_routed, stamp_routes  # noqa: E402

CFG = TinyGPTConfig(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, max_sequence_length=32)
SPEC = RoutingSpec(field="task_type", routes={"math": {"math_t": 1.0}, "code": {"code_t": 1.0},
                                              "mixed": {"math_t": 0.5, "code_t": 0.5}})
ROUTES = sorted(SPEC.routes)
PROMPT, GEN, TAU = 4, 10, 1.0


@torch.no_grad()
def rollout(model, prompts: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample GEN tokens per prompt at temperature TAU; return ids [B, P+G] and behaviour logp [B, P+G]
    in Megatron's label layout (logp[:, t] is the log-prob of ids[:, t+1])."""
    ids = prompts
    old = torch.zeros(ids.shape[0], PROMPT + GEN, device=ids.device)
    for t in range(PROMPT - 1, PROMPT + GEN - 1):
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logp = torch.log_softmax(model(ids, pos, None)[:, -1].float() / TAU, -1)
        nxt = torch.multinomial(logp.exp().cpu(), 1, generator=g).to(ids.device)
        old[:, t] = logp.gather(-1, nxt)[:, 0]
        ids = torch.cat([ids, nxt], 1)
    return ids, old


@torch.no_grad()
def exact_reverse_kl(student, teachers, prompts: torch.Tensor, route: str) -> float:
    """Σ_j w_j KL(π_θ ‖ π_Tj) of the next-token distribution after each prompt (full vocabulary)."""
    from mopd import DivergenceConfig, full_vocab_divergence

    pos = torch.arange(prompts.shape[1], device=prompts.device).expand_as(prompts)
    s_logits = student(prompts, pos, None)[:, -1].float()
    total = 0.0
    for tid, w in SPEC.routes[route].items():
        t_logp = torch.log_softmax(teachers[tid](prompts, pos, None)[:, -1].float() / TAU, -1)
        kl, n = full_vocab_divergence(s_logits, t_logp, config=DivergenceConfig(kind="reverse_kl", temperature=TAU))
        total += w * float(kl) / int(n)
    return total


def forward_step(micro, loss_cfg, data_iterator, model):
    from mopd.megatron import mopd_loss_func

    ids = next(data_iterator)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, pos, None), partial(mopd_loss_func, micro, config=loss_cfg, route_names=ROUTES,
                                          temperature=TAU)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=6, help="size of the fixed prompt pool")
    ap.add_argument("--lr", type=float, default=3e-2)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        cpu_compat.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1, seed=0)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, MOPDMicroBatch, save_teacher_checkpoint

    tmp = tempfile.mkdtemp(prefix="mopd_example_")
    reference_teachers = {}  # kept only for the exact-KL diagnostic
    for name, seed in (("math_t", 1), ("code_t", 2)):  # two different, peaky teachers
        seed_all(seed)
        t = build_tiny_gpt(CFG).to(dev).eval()
        with torch.no_grad():
            t.output_layer.weight.mul_(10.0)
        save_teacher_checkpoint(t, f"{tmp}/{name}")
        reference_teachers[name] = t
    seed_all(3)
    host = MegatronTeacherHost(build_tiny_gpt(CFG).to(dev), micro_batch_size=args.batch)
    pool = TeacherPool({n: MegatronTeacher(n, host, f"{tmp}/{n}", temperature=TAU) for n in ("math_t", "code_t")},
                       config=TeacherPoolConfig())

    seed_all(4)
    student = build_tiny_gpt(CFG).to(dev)
    ddp = DistributedDataParallel(student.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), student)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, bf16=False, fp16=False), [ddp])
    loss_cfg = MOPDLossConfig(is_cap=5.0)
    g = torch.Generator().manual_seed(0)
    prompt_pool = torch.randint(0, CFG.vocab_size, (args.prompts, PROMPT), generator=g)
    prompt_route = [ROUTES[i % len(ROUTES)] for i in range(args.prompts)]  # each prompt has one task type
    fb = get_forward_backward_func()

    def own(route):
        return prompt_pool[[i for i, r in enumerate(prompt_route) if r == route]].to(dev)

    for step in range(args.steps):
        pick = torch.randint(0, len(prompt_pool), (args.batch,), generator=g)
        samples = [{"task_type": prompt_route[i]} for i in pick.tolist()]
        routes = stamp_routes(samples, SPEC)
        prompts = prompt_pool[pick].to(dev)
        ids, old = rollout(student, prompts, g)
        lengths = torch.full((args.batch,), PROMPT + GEN, device=dev)
        batch = TokenBatch(ids, lengths, torch.full_like(lengths, PROMPT - 1))
        mask = batch.label_mask()
        targets, _ = score_routed(pool, batch, routes, SPEC, old_logp=old, loss_mask=mask)
        route_ids = torch.tensor([ROUTES.index(r) for r in routes], device=dev)[:, None].expand_as(mask)
        labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        micro = MOPDMicroBatch(labels=labels, loss_mask=mask, old_logp=old, targets=targets, route_ids=route_ids)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=partial(forward_step, micro, loss_cfg), data_iterator=iter([ids]), model=ddp,
                 num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=args.batch, forward_only=False)
        ok, gnorm, _ = opt.step()
        m = out[0]
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  exact reverse KL at the first sampled token, per route: "
                  + "  ".join(f"{r}: {exact_reverse_kl(student, reference_teachers, own(r), r):.4f}"
                              for r in ROUTES), flush=True)
        per_route = "  ".join(f"{r}: reward {float(m[f'mopd/{r}/reward'][0] / m[f'mopd/{r}/reward'][1]):+.3f}"
                              for r in ROUTES)
        print(f"step {step:3d}  {per_route}  gnorm {gnorm:.3g}  capped {float(m['mopd/is_capped_frac'][0] / m['mopd/is_capped_frac'][1]):.2f}",
              flush=True)
    pool.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
