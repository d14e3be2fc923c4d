"""Smallest real end-to-end run: a tiny Qwen3-style Megatron GPT learns string reversal on CPU.

Megatron-Core DDP + distributed optimizer over gloo, launched by torchrun on 2 ranks. Prints a
progress bar, then held-out exact-match accuracy of greedy decoding. ``make demo`` runs the full
distillation demo (``examples/demo``); adding mcore-distill to a loop like this one is
``examples/megatron_integration`` (docs/integration.md).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.train_tiny_gpt
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mcore_distill import cpu_compat
from mcore_distill.lifetime import end_with_launcher
from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, init_megatron

LETTERS = 16  # token ids 3..18 are letters; 0 pad, 1 BOS, 2 SEP
PAD, BOS, SEP = 0, 1, 2


def make_batch(n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Rows ``BOS x1..xL SEP xL..x1`` with letters drawn uniformly."""
    x = torch.randint(3, 3 + LETTERS, (n, length), generator=gen)
    bos, sep = torch.full((n, 1), BOS), torch.full((n, 1), SEP)
    return torch.cat([bos, x, sep, x.flip(1)], dim=1)


def loss_on_answers(model, rows: torch.Tensor, length: int) -> torch.Tensor:
    """Mean cross entropy of the reversed half (the answer) given the prompt."""
    pos = torch.arange(rows.shape[1]).expand_as(rows)
    per_token = model(rows, pos, None, labels=torch.roll(rows, -1, dims=1))
    return per_token[:, length + 1: -1].float().mean()


@torch.no_grad()
def greedy_accuracy(model, rows: torch.Tensor, length: int) -> float:
    seq = rows[:, : length + 2].clone()
    for _ in range(length):
        pos = torch.arange(seq.shape[1]).expand_as(seq)
        logits = model(seq, pos, None)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return (seq[:, length + 2:] == rows[:, length + 2:]).all(dim=1).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--length", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    end_with_launcher()  # this rank ends if torchrun is killed
    cpu_compat.enable()  # no-op on a CUDA machine
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    init_megatron(seed=args.seed)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tqdm import tqdm

    cfg = TinyGPTConfig(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=256, max_sequence_length=2 * args.length + 2)
    model = build_tiny_gpt(cfg)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr * 0.1, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=True, bf16=False, fp16=False),
        [ddp],
    )
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 * args.seed + rank)
    held_out = make_batch(256, args.length, torch.Generator().manual_seed(123456))
    start = time.perf_counter()
    bar = tqdm(range(args.steps), disable=rank != 0, desc=f"reversal, {n_params / 1e6:.2f}M params, {world} ranks")
    for step in bar:
        for group in opt.param_groups:  # cosine decay to 10%
            group["lr"] = args.lr * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(step / args.steps * torch.pi)).item()))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = loss_on_answers(ddp, make_batch(args.batch, args.length, gen), args.length)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    acc = greedy_accuracy(model, held_out, args.length)
    if rank == 0:
        print(f"\nheld-out exact match (reverse {args.length} letters, greedy): {acc:.1%}  "
              f"final loss {loss.item():.4f}  wall {time.perf_counter() - start:.1f}s")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
