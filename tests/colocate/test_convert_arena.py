"""ConversionArena: the converter's created tensors (q/k/v split, casts, hybrid regroupings and
norm shifts) written into one persistent buffer. Bit-identical to the fresh-tensor path, every
output a view of the Megatron storage or the arena, same storage and offsets on every pass, typed
capacity errors, and the publisher sending both storages in place over shared memory (no bucket)."""

from __future__ import annotations

import math

import pytest
import torch

from colocate import HFModelSpec, PublishConfig
from colocate.buckets import tensor_checksum
from colocate.convert import (
    ArenaCapacityError,
    ConversionArena,
    ConversionError,
    Qwen3HybridSpec,
    arena_nbytes,
    hf_param_specs,
    megatron_to_hf,
)
from colocate.errors import ConfigError
from colocate.publish import Publisher

from ._hybrid_ranks import GDN, build_hybrid

DENSE = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)
MOE = HFModelSpec(arch="qwen3_moe", num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                  head_dim=4, ffn_hidden_size=24, vocab_size=32, num_experts=3, moe_ffn_hidden_size=8,
                  router_dtype="fp32", has_expert_bias=True, tie_embeddings=True)
MHA1 = HFModelSpec(arch="qwen3", num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=1,
                   head_dim=4, ffn_hidden_size=24, vocab_size=32)
_HYB = dict(num_layers=3, hidden_size=24, num_attention_heads=4, num_query_groups=2, head_dim=8, ffn_hidden_size=20,
            vocab_size=40, layer_types=["linear_attention", "full_attention", "linear_attention"], **GDN)
SPECS = {
    "dense": DENSE, "moe": MOE, "mha-one-group": MHA1,
    "hybrid-next": Qwen3HybridSpec(arch="qwen3", **_HYB),
    "hybrid-3.5-te-gamma": Qwen3HybridSpec(arch="qwen3", gdn_layout="qwen3_5", megatron_zero_centered_gamma=True,
                                           **_HYB),
    "hybrid-next-moe": Qwen3HybridSpec(arch="qwen3_moe", num_experts=2, moe_ffn_hidden_size=6,
                                       shared_expert_ffn_hidden_size=10, router_dtype="bf16", **_HYB),
}


def _megatron_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """Megatron-Core names and shapes (TP = 1, local norms) of ``spec``'s model."""
    H, Q, G, D = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    hybrid = isinstance(spec, Qwen3HybridSpec)
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.vocab_size, H)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        if hybrid and spec.layer_types[i] == "linear_attention":
            nk, nv, dk, dv = (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim,
                              spec.linear_value_head_dim)
            out.update({p + "self_attention.in_proj.weight": (2 * nk * dk + 2 * nv * dv + 2 * nv, H),
                        p + "self_attention.conv1d.weight": (2 * nk * dk + nv * dv, 1, spec.linear_conv_kernel_dim),
                        p + "self_attention.A_log": (nv,), p + "self_attention.dt_bias": (nv,),
                        p + "self_attention.out_norm.weight": (dv,), p + "self_attention.out_proj.weight": (H, nv * dv)})
        else:
            rows = (2 * Q + 2 * G) * D if hybrid else (Q + 2 * G) * D
            out.update({p + "self_attention.linear_qkv.weight": (rows, H), p + "self_attention.q_layernorm.weight": (D,),
                        p + "self_attention.k_layernorm.weight": (D,), p + "self_attention.linear_proj.weight": (H, Q * D)})
        out[p + "pre_mlp_layernorm.weight"] = (H,)
        if spec.num_experts:
            F = spec.moe_ffn_hidden_size
            out[p + "mlp.router.weight"] = (spec.num_experts, H)
            if spec.has_expert_bias:
                out[p + "mlp.router.expert_bias"] = (spec.num_experts,)
            for e in range(spec.num_experts):
                out.update({f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * F, H),
                            f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight": (H, F)})
            S = getattr(spec, "shared_expert_ffn_hidden_size", None)
            if S:
                out.update({p + "mlp.shared_experts.linear_fc1.weight": (2 * S, H),
                            p + "mlp.shared_experts.linear_fc2.weight": (H, S),
                            p + "mlp.shared_experts.gate_weight": (1, H)})
        else:
            out.update({p + "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size, H),
                        p + "mlp.linear_fc2.weight": (H, spec.ffn_hidden_size)})
    out["decoder.final_layernorm.weight"] = (H,)
    if not spec.tie_embeddings:
        out["output_layer.weight"] = (spec.vocab_size, H)
    return out


def _buffer(spec: HFModelSpec, dtype: torch.dtype, *, seed: int = 0, shared: bool = False, device: str = "cpu"
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All Megatron parameters as views of one buffer (as a DDP param buffer holds them), random
    (drawn on the CPU, the same values on every ``device``)."""
    shapes = _megatron_shapes(spec)
    flat = torch.randn(sum(math.prod(s) for s in shapes.values()), generator=torch.Generator().manual_seed(seed)
                       ).to(device=device, dtype=dtype)
    if shared:
        flat.share_memory_()
    params, off = {}, 0
    for n, s in shapes.items():
        params[n] = flat[off: off + math.prod(s)].view(s)
        off += math.prod(s)
    return flat, params


def _convert(params: dict[str, torch.Tensor], spec: HFModelSpec, arena: ConversionArena | None = None):
    if arena is not None:
        arena.reset()
    for n, t in params.items():
        if n.endswith("expert_bias"):
            t = t.to(torch.bfloat16)  # not fp32 (Megatron's is): the cast to fp32 must create a tensor
        yield from megatron_to_hf(n, t, spec=spec, arena=arena)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", list(SPECS))
def test_arena_outputs_equal_fresh_ones_and_view_two_storages(which, dtype):
    spec = SPECS[which]
    flat, params = _buffer(spec, dtype)
    ref = {n: t.clone() for n, t in _convert(params, spec)}
    arena = ConversionArena.for_spec(spec, dtype=dtype)
    got = dict(_convert(params, spec, arena))
    expected = hf_param_specs(spec, dtype=dtype)
    assert {n: (tuple(t.shape), t.dtype) for n, t in got.items()} == expected
    for n, t in got.items():
        assert torch.equal(t, ref[n]), n
        assert _ptr(t) in (_ptr(flat), _ptr(arena.buffer)), f"{n} is a fresh tensor"
    in_arena = {n for n, t in got.items() if _ptr(t) == _ptr(arena.buffer)}
    if spec.num_query_groups > 1:
        assert {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(spec.num_layers) for p in "qkv"
                if not isinstance(spec, Qwen3HybridSpec) or spec.layer_types[i] == "full_attention"} <= in_arena
    # sized exactly: every byte used (the MoE's bf16 expert bias is cast, so counted bytes are used too)
    assert arena.used == arena.capacity == arena_nbytes(spec, dtype=dtype)
    assert (arena.capacity == 0) == (which == "mha-one-group")  # one KV group: q/k/v are views

    # a second pass: same storage, same offsets, the trainer's new values
    ptrs = {n: t.data_ptr() for n, t in got.items()}
    flat.neg_()
    again = dict(_convert(params, spec, arena))
    assert {n: t.data_ptr() for n, t in again.items()} == ptrs
    ref2 = dict(_convert(params, spec))
    assert all(torch.equal(again[n], ref2[n]) for n in ref2)


def test_arena_capacity_and_device_errors_are_typed():
    flat, params = _buffer(DENSE, torch.float32)
    need = arena_nbytes(DENSE, dtype=torch.float32)
    assert need == 2 * (32 + 16 + 16) * 32 * 4  # 2 layers × (q 32 + k 16 + v 16 rows) × H 32 × 4 bytes, 256-aligned
    small = ConversionArena(need - 1)
    with pytest.raises(ArenaCapacityError) as ei:
        list(_convert(params, DENSE, small))
    e = ei.value
    assert isinstance(e, ConversionError) and e.capacity == need - 1
    assert e.name == "model.layers.1.self_attn.v_proj.weight" and e.requested == 16 * 32 * 4
    assert f"needs {16 * 32 * 4} bytes at offset {need - 16 * 32 * 4}, but capacity is {need - 1} bytes" in str(e)
    # without reset() a second pass runs out: the message says so
    full = ConversionArena.for_spec(DENSE, dtype=torch.float32)
    for n, t in params.items():
        megatron_to_hf(n, t, spec=DENSE, arena=full)
    with pytest.raises(ArenaCapacityError, match="call reset"):
        megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight",
                       params["decoder.layers.0.self_attention.linear_qkv.weight"], spec=DENSE, arena=full)
    with pytest.raises(ConversionError, match="tensor on cpu, ConversionArena on meta"):
        megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight",
                       params["decoder.layers.0.self_attention.linear_qkv.weight"], spec=DENSE,
                       arena=ConversionArena(need, device="meta"))
    with pytest.raises(ConfigError, match="nbytes must be an int >= 0, got -1"):
        ConversionArena(-1)


@pytest.mark.timeout(180)
def test_publisher_sends_buffer_and_arena_in_place_over_shm():
    """Dense Qwen3 whose only created tensors are q/k/v: with an arena in shared memory nothing is
    packed (0 buckets), both storages go in place, kept mapped (no handle after the first
    publish), and the receiver process holds the reference bytes; without one, q/k/v are packed."""
    from colocate.engines import HFEngine
    from colocate.transports import spawn_receiver

    flat, params = _buffer(DENSE, torch.float32, seed=1, shared=True)
    arena = ConversionArena.for_spec(DENSE, dtype=torch.float32, share_memory=True)
    assert arena.buffer.is_shared()
    meta = hf_param_specs(DENSE, dtype=torch.float32)
    recv = spawn_receiver(HFEngine, DENSE, timeout_s=60)
    try:
        plain = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1 << 20), share_min_bytes=4096)
        rep = plain.publish(_convert(params, DENSE), version=1, meta=meta)
        assert rep.num_buckets == 1 and rep.num_shared == 1, rep
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1 << 20), share_min_bytes=4096,
                        keep_shared=True)
        pub.last_good = 1
        handles = []
        for version in (2, 3):
            rep = pub.publish(_convert(params, DENSE, arena), version=version, meta=meta)
            assert rep.num_buckets == 0 and rep.num_shared == 2 and rep.verify == "checksum", rep
            handles.append(rep.handles)
            want = {n: tensor_checksum(t) for n, t in _convert(params, DENSE)}
            assert recv.checksums() == want
            flat.mul_(-0.5)  # the trainer steps: the next publish must carry the new values
        assert handles == [2, 0]
        pub.release_staging()
    finally:
        recv.close()


@pytest.mark.parametrize("case", ["dense", "moe-router-bf16", "hybrid"])
def test_iter_hf_weights_with_arena_matches_without(cpu_megatron, case):
    """A real tiny Megatron model (in-process gloo, TP = 1): ``iter_hf_weights(arena=)`` yields the
    same tensors as without, converter outputs in the arena, and a second pass reuses it."""
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(5)
    if case == "hybrid":
        model = build_hybrid("GAG", vocab=40)
        spec = Qwen3HybridSpec(arch="qwen3", num_layers=3, hidden_size=24, num_attention_heads=4, num_query_groups=2,
                               head_dim=8, ffn_hidden_size=20, vocab_size=40,
                               layer_types=["linear_attention", "full_attention", "linear_attention"], **GDN)
    else:
        model = build_tiny_gpt(TinyGPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                             kv_channels=8, ffn_hidden_size=48, vocab_size=64,
                                             num_moe_experts=2 if case != "dense" else None,
                                             moe_ffn_hidden_size=16 if case != "dense" else None)).eval()
        spec = model_spec_from_megatron(model, router_dtype="bf16" if case != "dense" else None)
    ref = {n: t.clone() for n, t in iter_hf_weights([model], spec=spec)}
    arena = ConversionArena.for_spec(spec, dtype=torch.float32)
    got = dict(iter_hf_weights([model], spec=spec, arena=arena))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
    in_arena = {n for n, t in got.items() if _ptr(t) == _ptr(arena.buffer)}
    assert {_ptr(t) for t in got.values()} <= {_ptr(p) for p in model.parameters()} | {_ptr(arena.buffer)}
    assert "model.layers.1.self_attn.k_proj.weight" in in_arena
    assert ("model.layers.0.mlp.gate.weight" in in_arena) == (case == "moe-router-bf16")
    assert arena.used == arena.capacity
    ptrs = {n: t.data_ptr() for n, t in got.items() if n in in_arena}
    again = dict(iter_hf_weights([model], spec=spec, arena=arena))  # reset at the start of the pass
    assert {n: again[n].data_ptr() for n in ptrs} == ptrs
