"""Rank bodies for the colocate multi-rank tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, destroy_megatron, init_megatron


def _megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out = model(tokens, pos, None)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def convert_roundtrip(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case build the tiny Megatron Qwen3 at (tp, ep), gather + convert to HF, load
    into a config-built ``transformers`` model and compare logits with Megatron's."""
    from colocate.convert import check_params, hf_param_specs
    from colocate.engines import build_hf_model, hf_checkpoint_views
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron

    results = []
    for case in cases:
        init_megatron(tp=case["tp"], ep=case.get("ep", 1), seed=case.get("seed", 7))
        cfg = TinyGPTConfig(tensor_model_parallel_size=case["tp"], num_moe_experts=case.get("experts"),
                            tie_embeddings=case.get("tied", False), num_layers=2, hidden_size=48,
                            num_attention_heads=6, num_query_groups=2, kv_channels=10, ffn_hidden_size=40,
                            vocab_size=96, extra=case.get("extra", {}))
        model = build_tiny_gpt(cfg).eval()
        # Make norms non-trivial so a norm mapped to the wrong place cannot pass.
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for n, p in model.named_parameters():
                if "layernorm" in n or n.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        spec = model_spec_from_megatron(model)
        hf = dict(iter_hf_weights([model], spec=spec))
        check_params({n: (tuple(t.shape), t.dtype) for n, t in hf.items()}, hf_param_specs(spec, dtype=torch.float32))
        tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
        ref = _megatron_logits(model, tokens)
        ref_model = build_hf_model(spec, dtype=torch.float32)
        views = hf_checkpoint_views(ref_model)
        check_params({n: (tuple(t.shape), t.dtype) for n, t in hf.items()},
                     {n: (tuple(v.shape), v.dtype) for n, v in views.items()})
        with torch.no_grad():
            for n, t in hf.items():
                views[n].copy_(t)
            out = ref_model(input_ids=tokens).logits
        results.append({"case": case["id"], "max_abs": (out - ref).abs().max().item(),
                        "ref_scale": ref.abs().max().item(), "names": sorted(hf),
                        "logits_equal_shape": tuple(out.shape) == tuple(ref.shape)})
        destroy_megatron()
    return results


def publish_roundtrip(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Megatron (TP/EP on gloo) → lazy gather → Publisher (in-process) → HFEngine on rank 0.

    Every received tensor must equal the HF-layout reference bit for bit, and the engine's
    logits must equal the Megatron model's."""
    from colocate.config import PublishConfig
    from colocate.convert import hf_param_specs
    from colocate.engines import HFEngine
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron
    from colocate.publish import Publisher

    results = []
    for case in cases:
        init_megatron(tp=case["tp"], ep=case.get("ep", 1), seed=case.get("seed", 5))
        cfg = TinyGPTConfig(tensor_model_parallel_size=case["tp"], num_moe_experts=case.get("experts"),
                            tie_embeddings=case.get("tied", False), num_layers=2, hidden_size=48,
                            num_attention_heads=6, num_query_groups=2, kv_channels=10, ffn_hidden_size=40,
                            vocab_size=96, extra=case.get("extra", {}))
        model = build_tiny_gpt(cfg).eval()
        spec = model_spec_from_megatron(model)
        reference = {n: t.clone() for n, t in iter_hf_weights([model], spec=spec)}
        tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
        ref_logits = _megatron_logits(model, tokens)
        stream = iter_hf_weights([model], spec=spec)
        out = {"case": case["id"]}
        if rank == 0:
            engine = HFEngine(spec)
            pub = Publisher(engine, PublishConfig(transport="inprocess", bucket_bytes=64 << 10))
            rep = pub.publish(stream, version=1, meta=hf_param_specs(spec, dtype=torch.float32))
            out["buckets"] = rep.num_buckets
            out["bitwise_equal"] = all(torch.equal(engine.read(n), t) for n, t in reference.items())
            out["num_received"] = len(reference)
            out["max_abs"] = (engine.logits(tokens) - ref_logits).abs().max().item()
            out["version"] = engine.weight_version()
        else:
            for _ in stream:
                pass
        results.append(out)
        destroy_megatron()
    return results


class ShmProbe:
    """A receiver for the zero-copy test: reports each bucket's first bytes and writes a marker
    into the shared buffer (which the publisher process must then see)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.ptrs: list[int] = []

    def capabilities(self):
        return frozenset({"shm"})

    def load_bucket(self, entries, buffer):
        self.seen.append(buffer[:4].tolist())
        self.ptrs.append(buffer.untyped_storage().data_ptr())
        buffer[0] = 123

    def report(self):
        return self.seen, len(set(self.ptrs))


def slow_engine(spec, delay_s: float):
    """An HFEngine whose bucket loads take ``delay_s`` (receiver-timeout test)."""
    import time

    from colocate.engines import HFEngine

    class Slow(HFEngine):
        def load_bucket(self, entries, buffer):
            time.sleep(delay_s)
            super().load_bucket(entries, buffer)

    return Slow(spec)


def convert_and_publish(rank: int, world_size: int, cases: list[dict]):
    """Both round trips in one spawned run (multi-rank tests are expensive)."""
    return convert_roundtrip(rank, world_size, cases), publish_roundtrip(rank, world_size, cases)


def megatron_hf_weights(rank: int, world_size: int, case: dict) -> dict:
    """Build the tiny Megatron Qwen3 (GPU lane: NCCL; CPU: gloo) and return its HF state dict
    on CPU plus logits for a fixed batch (reference for engines fed from it)."""
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron

    init_megatron(tp=world_size, seed=case.get("seed", 9))
    cfg = TinyGPTConfig(tensor_model_parallel_size=world_size, num_moe_experts=case.get("experts"),
                        tie_embeddings=case.get("tied", False), num_layers=2, hidden_size=128,
                        num_attention_heads=4, num_query_groups=2, kv_channels=64, ffn_hidden_size=256,
                        vocab_size=512, max_sequence_length=256, rotary_base=10000)
    model = build_tiny_gpt(cfg)
    if torch.cuda.is_available():
        model = model.cuda()
    model.eval()
    spec = model_spec_from_megatron(model)
    weights = {n: t.detach().cpu().clone() for n, t in iter_hf_weights([model], spec=spec)}
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = _megatron_logits(model, tokens.to(next(model.parameters()).device)).float().cpu()
    destroy_megatron()
    return {"spec": spec, "weights": weights, "tokens": tokens, "logits": logits}


def trainer_residency_gpu(rank: int, world_size: int) -> dict:
    """GPU lane: a Megatron DDP + distributed-optimizer trainer releases optimizer, grads and
    weights; device free memory must grow by about the bytes reported, and the next step after
    resume must equal a run that never released."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from colocate.megatron import megatron_residency_hooks
    from colocate.residency import Residency
    from mcore_distill.testing import seed_all

    def run(release: bool) -> dict:
        init_megatron(tp=1, seed=3)
        seed_all(3)
        m = build_tiny_gpt(TinyGPTConfig(num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                                         ffn_hidden_size=4096, vocab_size=8192)).cuda()
        ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                     bf16=False, fp16=False), [ddp])
        tokens = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
        pos = torch.arange(64, device="cuda").expand_as(tokens)

        def step():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(tokens, pos, None, labels=tokens).float().mean().backward()
            ddp.finish_grad_sync()
            opt.step()

        step()
        out = {}
        if release:
            res = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            freed = res.release()
            out["freed"] = sum(freed.values())
            out["device_free_gain"] = torch.cuda.mem_get_info()[0] - free0
            res.resume()
        step()
        out["params"] = {n: p.detach().cpu() for n, p in ddp.named_parameters()}
        destroy_megatron()
        return out

    ref, got = run(False), run(True)
    return {"freed": got["freed"], "gain": got["device_free_gain"],
            "equal": all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])}


def arena_gathers(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case build the tiny model at (tp, ep, etp) with its parameters as views of one
    flat buffer (as a DDP param buffer holds them), then compare ``iter_hf_weights`` with an
    arena sized by ``megatron_arena`` against the default path: equality, the storages yielded,
    offsets on a second pass, a publish on rank 0 (rank 1 without an arena: same collectives),
    and the typed capacity error."""
    from megatron.core import parallel_state as ps

    from colocate.config import PublishConfig
    from colocate.convert import ArenaCapacityError, ConversionArena, Qwen3HybridSpec, hf_param_specs
    from colocate.engines import HFEngine
    from colocate.megatron import (
        iter_hf_weights,
        megatron_arena,
        megatron_arena_nbytes,
        model_spec_from_megatron,
    )
    from colocate.publish import Publisher
    from mcore_distill.testing import seed_all

    from ._hybrid_ranks import GDN, build_hybrid

    results = []
    for case in cases:
        ps.initialize_model_parallel(tensor_model_parallel_size=case["tp"], expert_model_parallel_size=case.get("ep", 1),
                                     expert_tensor_parallel_size=case.get("etp"))
        seed_all(7)
        if case.get("hybrid"):
            model = build_hybrid("GAG", vocab=40, tp=case["tp"])
            spec = Qwen3HybridSpec(arch="qwen3", num_layers=3, hidden_size=24, num_attention_heads=4,
                                   num_query_groups=2, head_dim=8, ffn_hidden_size=20, vocab_size=40,
                                   layer_types=["linear_attention", "full_attention", "linear_attention"], **GDN)
        else:
            cfg = TinyGPTConfig(tensor_model_parallel_size=case["tp"], num_moe_experts=case.get("experts"),
                                tie_embeddings=case.get("tied", False), num_layers=2, hidden_size=48,
                                num_attention_heads=6, num_query_groups=2, kv_channels=10, ffn_hidden_size=40,
                                vocab_size=96, extra=case.get("extra", {}))
            model = build_tiny_gpt(cfg).eval()
            spec = model_spec_from_megatron(model, router_dtype=case.get("router_dtype"))
        params = [p for _, p in model.named_parameters()]
        flat = torch.empty(sum(p.numel() for p in params))
        off = 0
        for p in params:  # one storage for all parameters, per-rank random values
            p.data = flat[off: off + p.numel()].view(p.shape).copy_(torch.randn(p.shape))
            off += p.numel()
        out = {"case": case["id"]}
        ref = {n: t.clone() for n, t in iter_hf_weights([model], spec=spec)}
        arena = megatron_arena([model], spec=spec)
        got = list(iter_hf_weights([model], spec=spec, arena=arena))
        storages = {t.untyped_storage().data_ptr() for _, t in got}
        out["names_equal"] = [n for n, _ in got] == list(ref)
        out["equal"] = all(torch.equal(t, ref[n]) for n, t in got)
        out["storages_ok"] = storages <= {flat.untyped_storage().data_ptr(), arena.buffer.untyped_storage().data_ptr()}
        out["arena_used"], out["arena_capacity"] = arena.used, arena.capacity
        out["nbytes"] = megatron_arena_nbytes([model], spec=spec)
        ptrs = [t.data_ptr() for _, t in got]
        flat.neg_()  # the trainer steps
        ref2 = {n: t.clone() for n, t in iter_hf_weights([model], spec=spec)}
        again = list(iter_hf_weights([model], spec=spec, arena=arena))
        out["same_ptrs"] = [t.data_ptr() for _, t in again] == ptrs
        out["equal_again"] = all(torch.equal(t, ref2[n]) for n, t in again)
        if case.get("router_dtype") or case.get("hybrid"):
            pass  # HFEngine has no hybrid and builds its gate in the training dtype: no publish here
        elif rank == 0:  # rank 1 takes part without an arena: the collectives are the same
            engine = HFEngine(spec)
            pub = Publisher(engine, PublishConfig(transport="inprocess", bucket_bytes=64 << 10), share_min_bytes=1)
            rep = pub.publish(iter_hf_weights([model], spec=spec, arena=arena), version=1,
                              meta=hf_param_specs(spec, dtype=torch.float32))
            out["buckets"], out["shared"] = rep.num_buckets, rep.num_shared
            out["received_equal"] = all(torch.equal(engine.read(n), t) for n, t in ref2.items())
        else:
            for _ in iter_hf_weights([model], spec=spec):
                pass
        try:  # every rank fails at the same take, before its collective
            list(iter_hf_weights([model], spec=spec, arena=ConversionArena(arena.capacity - 1)))
        except ArenaCapacityError as e:
            out["capacity_error"] = (e.name, e.requested, e.used, e.capacity)
        results.append(out)
        ps.destroy_model_parallel()
    return results


def slow_commit_engine(spec, delay_s: float, slow_from: int):
    """An HFEngine whose ``end_update`` of versions >= ``slow_from`` takes ``delay_s`` before it
    verifies and commits (a load that outlives the publisher's timeout)."""
    import time

    from colocate.engines import HFEngine

    class SlowCommit(HFEngine):
        def end_update(self, version, checksums=None):
            if version >= slow_from:
                time.sleep(delay_s)
            super().end_update(version, checksums)

    return SlowCommit(spec)


def busy_engine(spec, delay_s: float):
    """An HFEngine that stays busy for ``delay_s`` in every bucket load (owner-death test)."""
    import time

    from colocate.engines import HFEngine

    class Busy(HFEngine):
        def load_bucket(self, entries, buffer):
            time.sleep(delay_s)
            super().load_bucket(entries, buffer)

    return Busy(spec)
