"""The colocated cycle end to end on CPU: a real Megatron DDP trainer with a distributed
optimizer and the embedded engine take turns; after each publish the engine's logits equal the
trainer's, and training continues exactly as if nothing had been released."""

from __future__ import annotations

import pytest
import torch

from colocate import (
    BusyError,
    HFModelSpec,
    NotResidentError,
    PoisonedVersionError,
    PublishConfig,
    PublishError,
    Residency,
)
from colocate.convert import hf_param_specs
from colocate.cycle import ColocatedCycle
from colocate.engines import HFEngine
from colocate.publish import Publisher
from colocate.residency import TRAINER_TAGS


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


SPEC = HFModelSpec(arch="qwen3", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                   head_dim=8, ffn_hidden_size=24, vocab_size=32)


class _TracedEngine(HFEngine):
    """The embedded engine, recording every residency change (with the version it serves at
    that moment) and every commit into ``trace``."""

    def __init__(self, trace: list):
        super().__init__(SPEC)
        self.trace = trace

    def release_memory(self, tags=None):
        out = super().release_memory(tags)
        self.trace += [("engine release", t, self.weight_version()) for t in out]
        return out

    def resume_memory(self, tags=None):
        out = super().resume_memory(tags)
        self.trace += [("engine resume", t, self.weight_version()) for t in out]
        return out

    def end_update(self, version, checksums=None):
        super().end_update(version, checksums)
        self.trace.append(("engine commit", version, version))


def _cycle():
    trace: list = []

    def hook(op: str, tag: str):
        return lambda: trace.append((f"trainer {op}", tag, None))

    trainer = Residency({t: (hook("release", t), hook("resume", t)) for t in TRAINER_TAGS}, owner="trainer",
                        sync=lambda: None)
    engine = _TracedEngine(trace)
    return trace, trainer, engine, ColocatedCycle(trainer, engine, Publisher(engine, PublishConfig(bucket_bytes=4 << 10)))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, (s, _) in hf_param_specs(SPEC, dtype=torch.float32).items()}


def test_cuda_graph_and_kv_cache_resume_after_the_publish():
    """The publish half of the cycle resumes the engine's weights first, commits the new version,
    and only then resumes ``cuda_graph`` (graphs are captured over the published weights) and
    ``kv_cache``; rollout runs on that version."""
    trace, trainer, engine, cycle = _cycle()
    trainer.release()
    trace.clear()
    cycle.to_training()
    cycle.publish(_weights(1), version=1)
    assert trace == [("engine release", "kv_cache", None), ("engine release", "weights", None),
                     ("engine release", "cuda_graph", None),
                     ("trainer resume", "weights", None), ("trainer resume", "grads", None),
                     ("trainer resume", "optimizer", None),
                     ("trainer release", "optimizer", None), ("trainer release", "grads", None),
                     ("engine resume", "weights", None), ("engine commit", 1, 1),
                     ("trainer release", "weights", None),
                     ("engine resume", "cuda_graph", 1), ("engine resume", "kv_cache", 1)]
    assert len(engine.generate([[1, 2]], max_new_tokens=2).tokens[0]) == 2


def test_failed_publish_stops_the_cycle_where_the_docs_say():
    """A publish that fails leaves the trainer's weights resident (optimizer, grads released),
    the engine's weights resident and its ``kv_cache``/``cuda_graph`` released, the version
    poisoned and no version served; publishing a newer version then completes the cycle."""
    trace, trainer, engine, cycle = _cycle()
    trainer.release()
    cycle.to_training()
    cycle.publish(_weights(1), version=1)
    cycle.to_training()
    good = _weights(2)
    meta = {n: (tuple(t.shape), t.dtype) for n, t in good.items()}

    def broken():
        for i, (n, t) in enumerate(good.items()):
            yield (n, t[:1]) if i == 3 else (n, t)  # a converter bug: a wrong shape mid-stream

    with pytest.raises(PublishError, match="meta says") as ei:
        cycle.publish(broken(), version=2, meta=meta)
    assert ei.value.phase == "transfer" and cycle.publisher.poisoned == {2}
    assert trainer.released == {"optimizer", "grads"}
    assert engine.residency.released == {"kv_cache", "cuda_graph"} and engine.weight_version() is None
    with pytest.raises(NotResidentError):
        engine.generate([[1, 2]], max_new_tokens=1)
    with pytest.raises(PoisonedVersionError):
        cycle.publish(good, version=2)
    cycle.publish(good, version=3)
    assert trainer.released == {"optimizer", "grads", "weights"} and not engine.residency.released
    assert engine.weight_version() == 3 and all(torch.equal(engine.read(n), t) for n, t in good.items())
    assert trace[-2:] == [("engine resume", "cuda_graph", 3), ("engine resume", "kv_cache", 3)]
