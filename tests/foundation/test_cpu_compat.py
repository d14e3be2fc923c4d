"""The CPU compatibility layer: explicit, reversible, and exactly as wide as documented."""

from __future__ import annotations

import pytest
import torch

from mcore_distill import cpu_compat


@pytest.fixture
def compat(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    handle = cpu_compat.enable()
    yield handle
    cpu_compat.disable()


def test_not_enabled_on_import():
    assert not cpu_compat.is_enabled()


def test_redirects_device_arguments(compat):
    assert cpu_compat.is_enabled()
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.arange(4)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device="cuda:0").device.type == "cpu"
    assert torch.empty(3, pin_memory=True).device.type == "cpu"
    # CPU targets are untouched
    assert x.to(torch.float64).dtype == torch.float64


def test_type_strings_for_megatron_asserts(compat):
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    # with an argument, .type() still casts
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64


def test_rng_state_maps_to_cpu_generator(compat):
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(4))


def test_streams_and_events_are_inert(compat):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        e = torch.cuda.Event()
        e.record()
    torch.cuda.current_stream().wait_event(e)
    assert e.query()
    torch.cuda.synchronize()


def test_disable_restores_everything(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from torch.autograd.function import BackwardCFunction

    before = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type, torch.cuda.Stream,
              BackwardCFunction.apply)
    first = cpu_compat.enable()
    assert cpu_compat.enable() is first  # idempotent
    cpu_compat.disable()
    cpu_compat.disable()  # a no-op when not enabled
    after = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type, torch.cuda.Stream,
             BackwardCFunction.apply)
    assert before == after
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert not cpu_compat.is_enabled()


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.enable() is None
    assert not cpu_compat.is_enabled()


class _DoubleWithCudaScratch(torch.autograd.Function):
    """Allocates on "cuda" in backward, as Megatron's recomputation does."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full_like(grad, 2.0, device="cuda")


def test_redirect_is_active_inside_custom_backward(compat):
    x = torch.ones(3, requires_grad=True)
    _DoubleWithCudaScratch.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
