"""Rank body for the AWEX bounded colocated transport test (module level for spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# (name, global shape); training shards rows over TP=2, inference shards columns over TP=2
PARAMS = [("model.layers.0.self_attn.o_proj.weight", (8, 6)),
          ("model.layers.0.mlp.experts.0.down_proj.weight", (4, 10)),
          ("model.layers.0.mlp.experts.1.down_proj.weight", (4, 10)),
          ("model.norm.weight", (6, 2))]


def _meta(name, shape, dim, world, offset_rank):
    from awex.meta.meta_resolver import ParameterMeta, ParameterReplicaMeta, ParameterShardMeta
    from awex.sharding.param_sharding import ShardingType

    shards = []
    for r in range(world):
        local = list(shape)
        local[dim] //= world
        off = [0] * len(shape)
        off[dim] = r * local[dim]
        shards.append(ParameterShardMeta(
            tp_rank=r, attn_tp_rank=r, pp_rank=0, ep_rank=0, ep_tp_rank=0, global_rank=offset_rank + r,
            world_size=world, engine_rank=0, name=name, shape=tuple(local), numel=int(torch.tensor(local).prod()),
            dtype=torch.float32, global_offset=tuple(off), sharding_type=ShardingType.TP_SHARDING, num_shards=world,
            sharding_dim=dim))
    return ParameterMeta(name=name, global_numel=int(torch.tensor(shape).prod()), global_shape=tuple(shape),
                         dtype=torch.float32, shards=shards, replicas=[ParameterReplicaMeta(shards=shards)])


def _truth(name, shape):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=g)


def bounded_exchange(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Process r is inference rank r and training rank 2 + r on the same (simulated) device;
    the plan comes from AWEX's TransferPlanBuilder, the transport from our reader subclass."""
    from awex.transfer.transfer_plan import TransferPlanBuilder

    from colocate.awex_transport import bounded_reader_class

    infer_meta = [_meta(n, s, 1, world_size, 0) for n, s in PARAMS]
    train_meta = [_meta(n, s, 0, world_size, 0) for n, s in PARAMS]
    builder = TransferPlanBuilder(infer_world_size=world_size, train_world_size=world_size, num_infer_engines=1)
    send_plan = builder.build_local_transfer_plan(infer_meta, train_meta, world_size + rank)
    recv_plan = builder.build_local_transfer_plan(infer_meta, train_meta, rank)
    send = {n: _truth(n, s).chunk(world_size, dim=0)[rank].contiguous().to(device) for n, s in PARAMS}
    recv = {n: torch.full((s[0], s[1] // world_size), float("nan"), device=device) for n, s in PARAMS}

    reader_cls = bounded_reader_class()
    reader = object.__new__(reader_cls)  # only the transport factory is exercised here
    reader.transfer_rank, reader.infer_world_size = rank, world_size
    transport = reader.create_colocate_transport()
    train_to_infer = {world_size + r: r for r in range(world_size)}
    transport.update_weights_in_colocate_mode(
        train_to_infer, {v: k for k, v in train_to_infer.items()}, rank, f"test-{rank}", world_size,
        send_plan, recv_plan, dist.group.WORLD, send, recv, step_id=1)
    exact = all(torch.equal(recv[n].cpu(), _truth(n, s).chunk(world_size, dim=1)[rank]) for n, s in PARAMS)
    return {"transport": type(transport).__name__, "exact": exact,
            "remote_ops": sum(len(v) for k, v in send_plan.operations.items() if k != rank),
            "local_ops": sum(len(v) for k, v in send_plan.operations.items() if k == rank),
            "packed_wire_ops": (getattr(transport, "_expert_pack_stats", None) or {}).get("packed_wire_ops", 0)}


def nccl_main(rank: int, world_size: int, port: int, queue) -> None:
    """GPU lane: one process per GPU, NCCL, the same exchange on CUDA tensors."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        queue.put((rank, bounded_exchange(rank, world_size, device=f"cuda:{rank}")))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        dist.destroy_process_group()
