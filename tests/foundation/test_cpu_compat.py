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
    before = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type, torch.cuda.Stream)
    first = cpu_compat.enable()
    assert cpu_compat.enable() is first  # idempotent
    cpu_compat.disable()
    cpu_compat.disable()  # a no-op when not enabled
    after = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type, torch.cuda.Stream)
    assert before == after
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert not cpu_compat.is_enabled()


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.enable() is None
    assert not cpu_compat.is_enabled()
