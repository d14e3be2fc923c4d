"""GPU lane: stream ordering, bounded device memory, bitwise parity with torch's fused AdamW."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import assert_close
from optim_staged import SlotConfig, StagedAdamW

pytestmark = pytest.mark.gpu

SHAPES = [(7, 13), (1031,), (3, 5, 11), (640, 333), (1,)]


def _pair(slot_numel: int, num_slots: int, dtype=torch.float32, keep_resident: bool = True):
    g = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, generator=g, device="cuda", dtype=dtype) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    o_out = StagedAdamW(out, lr=1e-2, weight_decay=0.1, impl="fused",
                        slots=SlotConfig(slot_numel=slot_numel, num_slots=num_slots, keep_resident=keep_resident))
    return g, ref, out, o_ref, o_out


@pytest.mark.parametrize("slot_numel,num_slots,keep", [(1024, 2, True), (1500, 3, True), (1500, 3, False),
                                                        (1 << 20, 2, True), (4096, 1, True)])
def test_bitwise_vs_fused_adamw(slot_numel, num_slots, keep):
    g, ref, out, o_ref, o_out = _pair(slot_numel, num_slots, keep_resident=keep)
    for step in range(10):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g, device="cuda")
            a.grad, b.grad = gr.clone(), gr.clone()
        if step == 5:
            for o in (o_ref, o_out):
                for grp in o.param_groups:
                    grp["lr"], grp["weight_decay"] = 3e-3, 0.02
        o_ref.step()
        o_out.step()
    o_out.drain()
    assert o_out.gpu_state_bytes == 0
    for i, (a, b) in enumerate(zip(ref, out)):
        assert torch.equal(a, b), f"param{i}"
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(o_ref.state[a][k].cpu(), o_out.state[b][k]), f"{k}{i}"
        assert o_out.state[b][k].device.type == "cpu"
    assert o_out.residency["pinned"]


def test_bf16_params_equal_bf16_master():
    g = torch.Generator(device="cuda").manual_seed(1)
    ps = [torch.randn(s, generator=g, device="cuda").bfloat16().requires_grad_() for s in SHAPES]
    opt = StagedAdamW(ps, lr=1e-2, slots=SlotConfig(slot_numel=4096, num_slots=2))
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, device="cuda").bfloat16()
        opt.step()
    opt.drain(release=False)
    for i, p in enumerate(ps):
        assert torch.equal(p.detach().cpu(), opt.state[p]["master_param"].bfloat16()), f"param{i}"


def test_late_gradient_on_side_stream_is_awaited():
    """The gradient is written by a side stream after a long GPU sleep; the caller joins that
    stream (standard PyTorch contract) and calls step() without any host synchronization."""
    g, ref, out, o_ref, o_out = _pair(1024, 2)
    side = torch.cuda.Stream()
    for _ in range(3):
        grads = [torch.randn(a.shape, generator=g, device="cuda") for a in ref]
        for a, gr in zip(ref, grads):
            a.grad = gr.clone()
        o_ref.step()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the grads land
            late = [gr.clone() for gr in grads]
        torch.cuda.current_stream().wait_stream(side)
        for b, gr in zip(out, late):
            b.grad = gr
            gr.record_stream(torch.cuda.current_stream())
        o_out.prefetch()  # state H2D needs no gradients: starts during the sleep
        o_out.step()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(ref, out)):
        assert torch.equal(a, b), f"param{i}"


@pytest.mark.parametrize("numel", [10**6, 10**8], ids=["1e6", "1e8"])
def test_gpu_state_memory_bounded_by_slots(numel):
    slots = SlotConfig(slot_numel=1 << 20, num_slots=2)
    p = torch.zeros(numel, device="cuda", requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = StagedAdamW([p], lr=1e-3, slots=slots)
    opt.initialize_state()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # slots x (m, v) x slot_numel x fp32: an fp32 param is its own master, fp32 grads are read in place
    slot_bytes = 2 * 2 * (1 << 20) * 4
    assert opt.gpu_state_bytes == slot_bytes
    assert peak <= slot_bytes + (1 << 20), f"peak {peak} bytes > slots {slot_bytes} (+1 MiB) for {numel} params"
    opt.drain()
    assert opt.gpu_state_bytes == 0
    assert_close("param", torch.full((8,), -1e-3 * 2, dtype=torch.float32), p[:8].detach().cpu(), atol=1e-6, rtol=1e-3)


def test_staged_muon_bf16_newton_schulz_vs_native():
    """bf16-precision NS (fp32_matmul_prec='medium') on GPU: <= 2e-3 vs native Muon after 3 steps."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from optim_staged.muon import StagedMuon

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(256, 512), (384, 128), (96, 96)]
    init = [torch.randn(s, generator=g, device="cuda") * 0.02 for s in shapes]
    ref = [w.clone().requires_grad_() for w in init]
    out = [w.clone().requires_grad_() for w in init]
    o_ref = TensorParallelMuon(ref, lr=0.02, weight_decay=0.1, fp32_matmul_prec="medium")
    o_out = StagedMuon.from_tensor_parallel_muon(
        TensorParallelMuon(out, lr=0.02, weight_decay=0.1, fp32_matmul_prec="medium"),
        slots=SlotConfig(slot_numel=256 * 512, num_slots=2))
    for _ in range(3):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g, device="cuda")
            a.grad, b.grad = gr.clone(), gr.clone()
        o_ref.step()
        o_out.step()
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b, atol=2e-3)


@pytest.mark.parametrize("num_slots,keep", [(2, True), (3, False), (1, True)])
def test_staged_muon_identity_exact_vs_native_streams(num_slots, keep):
    """Identity orthogonalizer: the update is elementwise fp32 on both sides, so staged == native
    bitwise. More matrices than slots and bf16 grads (scratch path): exercises the split H2D
    (momentum first, master awaited after the orthogonalization), the early momentum D2H and the
    slot cache across steps with alternating walk order."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from optim_staged.muon import StagedMuon

    g = torch.Generator(device="cuda").manual_seed(2)
    shapes = [(512, 256), (256, 256), (1024, 128), (64, 512), (300, 200), (512, 512), (128, 96)]
    init = [torch.randn(s, generator=g, device="cuda") for s in shapes]
    ref = [w.clone().requires_grad_() for w in init]
    out = [w.clone().requires_grad_() for w in init]
    o_ref = TensorParallelMuon(ref, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=False)
    o_ref.scaled_orthogonalize_fn = lambda grad, tp_group, partition_dim=None: grad
    o_out = StagedMuon(out, lr=0.02, momentum=0.9, nesterov=False, weight_decay=0.1,
                       orthogonalize=lambda p, u, **kw: u.clone(),
                       slots=SlotConfig(slot_numel=512 * 512, num_slots=num_slots, keep_resident=keep))
    for step in range(6):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g, device="cuda").bfloat16().float()
            a.grad = gr.clone()
            b.grad = gr.clone() if step % 2 else None
            if b.grad is None:
                b.decoupled_grad = gr.clone().bfloat16()  # bf16 grads go through the scratch buffer
            else:
                b.decoupled_grad = None
        o_ref.step()
        o_out.step()
    o_out.drain()
    assert o_out.gpu_state_bytes == 0
    for i, (a, b) in enumerate(zip(ref, out)):
        assert torch.equal(a, b), f"param{i}"
        assert torch.equal(o_ref.state[a]["momentum_buffer"].cpu(), o_out.state[b]["momentum_buffer"]), f"mom{i}"


_BUSY_CYCLES = 20_000_000  # torch.cuda._sleep: ~10 ms of GPU time at H200 clocks


@pytest.mark.parametrize("hazard", ["nan_fill", "block_reuse"])
def test_fresh_slots_not_raced_by_busy_caller_stream(hazard):
    """Regression for the intermittent DP=2 NCCL failure (NaN params, then master != param after
    reload). Slots are allocated at the first prefetch and again after every drain(release=True)
    (offload_to_cpu). Allocated on the caller's stream, the first H2D into them was not ordered
    after the caller's queued work: with deterministic algorithms ``torch.empty`` queues a NaN
    fill there (``nan_fill``), and the caching allocator may return a block whose pending
    writes are still queued there (``block_reuse``). The caller's stream is held busy by a sleep
    (as behind a backward pass or an NCCL all-gather waiting for a peer) so that, unordered,
    those writes land after the H2D. Six fresh allocations, bitwise vs torch's fused AdamW."""
    g, ref, out, o_ref, o_out = _pair(1024, 2)
    o_out.initialize_state()  # host layout now: its blocking copies would sync the caller in the loop
    was_det, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if hazard == "nan_fill":
            torch.use_deterministic_algorithms(True, warn_only=True)
        for it in range(6):
            for a, b in zip(ref, out):
                gr = torch.randn(a.shape, generator=g, device="cuda")
                a.grad, b.grad = gr.clone(), gr.clone()
            o_ref.step()
            torch.cuda._sleep(_BUSY_CYCLES)  # caller stream busy
            if hazard == "block_reuse":
                junk = [torch.empty(1024, device="cuda") for _ in range(8)]  # slot-sized blocks
                for j in junk:
                    j.fill_(7.0)  # queued behind the sleep
                del junk  # freed by the host while their fills are still pending
            o_out.prefetch()  # allocates fresh slots and starts their H2D
            o_out.step()
            o_out.drain(release=True)  # next iteration allocates again
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(ref, out)):
                assert torch.isfinite(b).all(), f"iter {it} param{i}: non-finite (slot overwritten after its H2D)"
                assert torch.equal(a, b), f"iter {it} param{i}: max diff {(a - b).abs().max().item():.3e}"
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
    for i, (a, b) in enumerate(zip(ref, out)):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(o_ref.state[a][k].cpu(), o_out.state[b][k]), f"{k}{i}"


def test_reload_masters_while_ring_streams_are_busy():
    """Megatron's reload_model_params path (``set_scaled_state(p, 'master_param', float(p))``)
    with the ring's compute and D2H streams held busy: the bf16 param writes of the step and the
    write-backs of evicted/cached slots land late. The caller then halves the params on its own
    stream and reloads the masters. Each reloaded master must equal float(param) exactly, and
    the next steps must start from it: checked bitwise against torch's fused AdamW on fp32
    copies that are reset to the same values at each reload. Five rounds; slot cache on."""
    g = torch.Generator(device="cuda").manual_seed(3)
    init = [torch.randn(s, generator=g, device="cuda").bfloat16() for s in SHAPES]
    ps = [w.clone().requires_grad_() for w in init]
    ref = [w.float().requires_grad_() for w in init]
    opt = StagedAdamW(ps, lr=1e-2, weight_decay=0.1, impl="fused", slots=SlotConfig(slot_numel=1024, num_slots=2))
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt.initialize_state()
    ring = opt._ring
    for rnd in range(5):
        for _ in range(2):
            for p, r in zip(ps, ref):
                gr = torch.randn(p.shape, generator=g, device="cuda").bfloat16()
                p.grad, r.grad = gr, gr.float()
            o_ref.step()
            with torch.cuda.stream(ring.compute_stream):
                torch.cuda._sleep(_BUSY_CYCLES)  # the step's param writes land late
            with torch.cuda.stream(ring.d2h_stream):
                torch.cuda._sleep(2 * _BUSY_CYCLES)  # and its write-backs of evicted slots later still
            opt.step()
        for i, (p, r) in enumerate(zip(ps, ref)):
            assert torch.equal(p, r.detach().bfloat16()), f"round {rnd} param{i}: bf16 param != bf16(master)"
        with torch.no_grad():
            for p, r in zip(ps, ref):
                p.mul_(0.5)  # caller stream, right after step() returned
                r.copy_(p.float())
        for p in ps:  # as StagedDistributedOptimizer._copy_model_params_to_main_params
            opt.set_scaled_state(p, "master_param", p.detach().float())
        for i, p in enumerate(ps):
            master = opt.get_unscaled_state(p, "master_param")
            assert torch.equal(master, p.detach().float().cpu()), f"round {rnd} param{i}: master != float(param)"
    opt.drain()
    for i, (p, r) in enumerate(zip(ps, ref)):
        assert torch.equal(opt.state[p]["master_param"], r.detach().cpu()), f"master{i}"
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], o_ref.state[r][k].cpu()), f"{k}{i}"


def test_scratch_grown_from_caller_stream_is_ordered():
    """Resident units (``staged_fraction < 1``) compute on the caller's stream and may grow the
    ring's fp32 scratch (bf16 grads of a whole resident param). The scratch is allocated on the
    compute stream, so its deterministic-mode NaN fill runs there; with the compute stream busy
    the caller's write must still land after it. Then a full resident+staged bf16 run vs fused
    AdamW on fp32 copies."""
    was_det, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        g = torch.Generator(device="cuda").manual_seed(4)
        init = [torch.randn(s, generator=g, device="cuda").bfloat16() for s in SHAPES]
        ps = [w.clone().requires_grad_() for w in init]
        ref = [w.float().requires_grad_() for w in init]
        opt = StagedAdamW(ps, lr=1e-2, weight_decay=0.1, impl="fused", staged_fraction=0.005,
                          slots=SlotConfig(slot_numel=1024, num_slots=2))
        o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
        opt.initialize_state()
        assert opt.residency["resident_numel"] > 200_000  # the (640, 333) param is resident
        ring = opt._ring
        x = torch.randn(300_000, generator=g, device="cuda")
        with torch.cuda.stream(ring.compute_stream):
            torch.cuda._sleep(_BUSY_CYCLES)
        buf = ring.scratch(x.numel())  # grows, called from the caller's stream
        buf.copy_(x)
        torch.cuda.synchronize()
        assert torch.equal(buf, x), "scratch written by the caller before its allocation's fill ran"
        for _ in range(3):
            for p, r in zip(ps, ref):
                gr = torch.randn(p.shape, generator=g, device="cuda").bfloat16()
                p.grad, r.grad = gr, gr.float()
            o_ref.step()
            with torch.cuda.stream(ring.compute_stream):
                torch.cuda._sleep(_BUSY_CYCLES)
            opt.step()
        for i, (p, r) in enumerate(zip(ps, ref)):
            assert torch.equal(p, r.detach().bfloat16()), f"param{i}"
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
