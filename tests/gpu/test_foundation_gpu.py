"""GPU lane: the tiny Megatron GPT on CUDA matches the CPU run; DDP + distributed optimizer on GPUs.

The CPU reference runs in a spawned process with ``CUDA_VISIBLE_DEVICES=""`` (so the CPU
compatibility layer is active there, exactly as in CI); the CUDA run uses NCCL.
"""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, init_megatron, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SEQ, VOCAB = 16, 128


def _train(rank: int, world: int, steps: int, distributed: bool):
    """Build the tiny GPT (CPU init, seed 7), train ``steps`` DDP steps; return logits, losses, params."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_megatron(seed=7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_tiny_gpt(TinyGPTConfig()).to(device)
    tokens = torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(3)).to(device)
    pos = torch.arange(SEQ, device=device).expand(2, SEQ)
    with torch.no_grad():
        logits = model(tokens[:2], pos, None).float().cpu()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, use_distributed_optimizer=distributed,
                        clip_grad=1.0, bf16=False, fp16=False),
        [ddp],
    )
    losses = []
    mine = tokens[2 * rank: 2 * rank + 2]
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(mine, pos, None, labels=torch.roll(mine, -1, 1))[:, :-1].float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        losses.append(loss.item())
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    return {"logits": logits, "losses": losses, "params": params, "device": device}


def test_tiny_gpt_cuda_matches_cpu_and_distopt_steps_on_one_gpu():
    cpu = run_ranks(_train, 1, 3, True, timeout=240, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    gpu = run_ranks(_train, 1, 3, True, timeout=240, backend="nccl")[0]
    assert cpu["device"] == "cpu" and gpu["device"] == "cuda"
    assert_close("logits CUDA vs CPU (fp32, TF32 off)", cpu["logits"], gpu["logits"], atol=1e-4, rtol=1e-4)
    assert gpu["losses"][-1] < gpu["losses"][0]
    for a, b in zip(cpu["losses"], gpu["losses"]):
        assert a == pytest.approx(b, rel=1e-4)
    assert_close("params after 3 distopt steps", cpu["params"], gpu["params"], atol=1e-4)


@pytest.mark.multirank
def test_distopt_dp2_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()} (run on nvidia-h200-x2)")
    out = run_ranks(_train, 2, 3, True, timeout=240, backend="nccl")
    assert torch.equal(out[0]["params"], out[1]["params"]), "DP replicas diverged"
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in out)
