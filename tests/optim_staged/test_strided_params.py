"""Non-contiguous parameters (transposed, permuted, strided slices): staged optimizers accept them
as torch.optim.AdamW does, and give the same result (issue #19 item 4)."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import assert_close
from optim_staged import SlotConfig, StagedAdamW, StagedMuon
from optim_staged.flat import flat_range_blocks, read_flat_range, write_flat_range
from optim_staged.reference import identity_orthogonalize


def _strided(g: torch.Generator, dtype=torch.float32) -> list[torch.Tensor]:
    """Leaf tensors whose memory is not row-major: a transpose, a 3-D permute, channels_last, a
    slice with gaps (not even dense), and one contiguous tensor between them."""
    return [
        torch.randn(40, 33, generator=g, dtype=dtype).t(),
        torch.randn(5, 6, 7, generator=g, dtype=dtype).permute(2, 0, 1),
        torch.randn(3, 4, 5, 6, generator=g, dtype=dtype).contiguous(memory_format=torch.channels_last),
        torch.randn(17, 9, generator=g, dtype=dtype),
        torch.randn(30, 50, generator=g, dtype=dtype)[::2, 3:47:3],
    ]


def _like(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same strides (gaps included)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps (some permutation of it is contiguous)."""
    expect = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda x: x[1]):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def test_flat_range_blocks_cover_every_range_in_order():
    g = torch.Generator().manual_seed(0)
    for t in _strided(g):
        flat = t.reshape(-1)
        n = flat.numel()
        cuts = sorted({0, n, *torch.randint(0, n + 1, (12,), generator=g).tolist()})
        for s in cuts:
            for e in cuts:
                if e <= s:
                    continue
                blocks = flat_range_blocks(t, s, e)
                assert len(blocks) <= 2 * t.dim() - 1 or t.is_contiguous()
                got = torch.cat([v.reshape(-1) for v, _ in blocks])
                assert torch.equal(got, flat[s:e]), (tuple(t.shape), t.stride(), s, e)
                assert [o for _, o in blocks] == [sum(v.numel() for v, _ in blocks[:i]) for i in range(len(blocks))]
                out = torch.empty(e - s)
                read_flat_range(t, s, out)
                assert torch.equal(out, flat[s:e])
                w = _like(t)
                src = torch.randn(e - s, generator=g)
                write_flat_range(w, s, src)
                want = flat.clone()
                want[s:e] = src
                assert torch.equal(w.reshape(-1), want)


LANES = {"slots": {}, "host_half": {"host_fraction": 0.5}, "offload_grads": {"offload_gradients": True}}


@pytest.mark.parametrize("lane", list(LANES))
@pytest.mark.parametrize("slot_numel", [1024, 1500, 1 << 16], ids=lambda n: f"slot{n}")
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_staged_adamw_non_contiguous_params_match_torch(slot_numel, impl, lane):
    """Units split the strided parameters (slot 1024/1500) or hold them whole; gradients keep the
    parameters' strides (autograd's layout contract) or, for the gap-strided slice, are
    contiguous. Slot lane, host lane (half the elements) and gradients offloaded in the backward
    pass. Before the fix: ``RuntimeError: view size is not compatible ...``."""
    g = torch.Generator().manual_seed(1)
    base = _strided(g)
    out = [_like(t).requires_grad_() for t in base]
    # torch 2.11's fused CPU AdamW computes wrong values on a parameter with gaps (it is off by
    # 3e-2 after 3 steps vs foreach and vs fused on a contiguous copy): the fused reference
    # steps a contiguous copy of that one.
    ref = [(_like(t) if impl == "foreach" or _dense(t) else t.contiguous()).requires_grad_()
           for t in base]
    assert any(not p.is_contiguous() for p in out)
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, **{impl: True})
    o_out = StagedAdamW(out, lr=1e-2, weight_decay=0.1, impl=impl,
                        slots=SlotConfig(slot_numel=slot_numel, num_slots=2), **LANES[lane])
    w = [torch.randn(p.shape, generator=g) for p in out]
    for _ in range(5):
        for ps in (ref, out):
            for p in ps:
                p.grad = None
            sum((p * wi).square().sum() for p, wi in zip(ps, w)).backward()
        if lane != "offload_grads":  # (offloaded gradients are consumed and freed in the backward pass)
            assert out[0].grad.stride() == out[0].stride()  # strided gradients reach the kernel
        o_ref.step()
        o_out.step()
    o_out.drain(release=False)
    # foreach: the same op sequence on the same values -> bitwise; fused CPU kernel: chunk views
    # move its vector/scalar tails (as in test_adamw.py), 1e-6 relative.
    rtol = 0.0 if impl == "foreach" else 1e-6
    for i, (a, b) in enumerate(zip(ref, out)):
        assert b.stride() == base[i].stride()
        assert_close(f"param{i}", a, b, atol=0, rtol=rtol)
        assert_close(f"master{i}", a, o_out.state[b]["master_param"], atol=0, rtol=rtol)
        assert_close(f"exp_avg{i}", o_ref.state[a]["exp_avg"], o_out.state[b]["exp_avg"], atol=0, rtol=rtol)
        assert_close(f"exp_avg_sq{i}", o_ref.state[a]["exp_avg_sq"], o_out.state[b]["exp_avg_sq"],
                     atol=1e-12 * (impl == "fused"), rtol=rtol)


def test_staged_adamw_bf16_transposed_param():
    """bf16 transposed parameter: the master is written back through the strided blocks."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(64, 48, generator=g).to(torch.bfloat16).t().requires_grad_()
    opt = StagedAdamW([p], lr=1e-2, slots=SlotConfig(slot_numel=1024), impl="foreach")
    for _ in range(3):
        p.grad = torch.randn(64, 48, generator=g).to(torch.bfloat16).t()
        opt.step()
    opt.drain(release=False)
    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


def test_staged_muon_transposed_params_match_tensor_parallel_muon():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    g = torch.Generator().manual_seed(3)
    base = [torch.randn(40, 33, generator=g).t(), torch.randn(30, 50, generator=g)[::2, 3:47:3]]
    ref = [_like(t).requires_grad_() for t in base]
    out = [_like(t).requires_grad_() for t in base]
    for identity in (True, False):
        o_ref = TensorParallelMuon(ref, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True)
        o_out = StagedMuon.from_tensor_parallel_muon(
            TensorParallelMuon(out, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True),
            slots=SlotConfig(slot_numel=2048, num_slots=2))
        if identity:
            o_ref.scaled_orthogonalize_fn = lambda grad, tp_group, partition_dim=None: grad
            o_out.orthogonalize = lambda p, u, **kw: identity_orthogonalize(u)
        for _ in range(3):
            for a, b in zip(ref, out):
                gr = torch.randn(a.shape, generator=g)
                a.grad, b.grad = gr.clone(), gr.clone()
            o_ref.step()
            o_out.step()
        o_out.drain(release=False)
        for i, (a, b) in enumerate(zip(ref, out)):
            assert_close(f"param{i} identity={identity}", a, b, atol=0)
            assert_close(f"momentum{i}", o_ref.state[a]["momentum_buffer"], o_out.state[b]["momentum_buffer"], atol=0)
