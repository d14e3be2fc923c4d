"""The colocated cycle end to end on CPU: a real Megatron DDP trainer with a distributed
optimizer and the embedded engine take turns; after each publish the engine's logits equal the
trainer's, and training continues exactly as if nothing had been released."""

from __future__ import annotations

import pytest
import torch

from colocate import BusyError, PublishConfig, Residency
from colocate.cycle import ColocatedCycle
from colocate.engines import HFEngine
from colocate.publish import Publisher


def _train_and_publish(cycles: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from colocate.megatron import megatron_residency_hooks, model_spec_from_megatron, publish_megatron
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(5)
    m = build_tiny_gpt(TinyGPTConfig(num_layers=2, num_moe_experts=4))
    ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                 bf16=False, fp16=False), [ddp])
    spec = model_spec_from_megatron(ddp)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand_as(tokens)
    engine = HFEngine(spec)
    trainer = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
    cycle = ColocatedCycle(trainer, engine, Publisher(engine, PublishConfig(bucket_bytes=32 << 10)))
    diffs, losses = [], []
    for step in range(3):
        if cycles:
            cycle.to_training()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
        if cycles:
            with torch.no_grad():
                want = ddp(tokens, pos, None)
            rep = publish_megatron([ddp], cycle.publish, version=step + 1, spec=spec)
            assert rep.version == step + 1 and engine.weight_version() == step + 1
            assert trainer.released == {"optimizer", "grads", "weights"} and not engine.residency.released
            diffs.append((engine.logits(tokens) - want).abs().max().item())
            assert len(engine.generate([[1, 2, 3]], max_new_tokens=3).tokens[0]) == 3
    return losses, diffs, cycle


@pytest.mark.timeout(120)
def test_cycle_publishes_exact_weights_and_training_continues(cpu_megatron):
    ref_losses, _, _ = _train_and_publish(False)
    losses, diffs, cycle = _train_and_publish(True)
    assert losses == ref_losses  # release/resume of optimizer, grads, weights changed nothing
    assert max(diffs) <= 1e-5, diffs
    with cycle.engine.residency.busy(), pytest.raises(BusyError):
        cycle.to_training()  # the engine is generating: no release
    assert not cycle.engine.residency.released
