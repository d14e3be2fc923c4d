"""Publisher replay: a publish that went wholly in place (trainer storages + a recorded
ConversionArena) is repeated without reading the stream, and the receiver gets the trainer's
*current* bytes, bit for bit; every condition that makes a repeat unsafe falls back to the full
publish; a failing replay poisons its version and the next publish reads the stream again."""

from __future__ import annotations

import pytest
import torch

from colocate import PublishConfig
from colocate.buckets import tensor_checksum
from colocate.convert import (
    ConversionArena,
    arena_nbytes,
    hf_param_specs,
    megatron_to_hf,
)
from colocate.errors import ConfigError
from colocate.publish import Publisher, PublishError
from colocate.receivers import TensorReceiver

from .test_convert_arena import DENSE, SPECS, _buffer, _convert


class DictReceiver(TensorReceiver):
    """:class:`colocate.TensorReceiver` that can be told to fail its next load."""

    def __init__(self, specs: dict):
        super().__init__(specs)
        self.fail_next = False

    def load_views(self, views):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("receiver failed mid-update")
        super().load_views(views)


def _never():
    raise AssertionError("the stream was read although the publish should have been replayed")
    yield  # unreachable: makes this a generator


def _stream(params, spec, arena=None):
    """The converter over views of the buffer (``_convert`` without its bf16 expert-bias cast)."""
    if arena is not None:
        arena.reset()
    for n, t in params.items():
        yield from megatron_to_hf(n, t, spec=spec, arena=arena)


def _want(params, spec) -> dict[str, int]:
    return {n: tensor_checksum(t) for n, t in _stream(params, spec)}


@pytest.mark.parametrize("transport", ["inprocess", "shm"])
@pytest.mark.parametrize("which", ["dense", "moe", "hybrid-next"])
def test_replay_sends_current_values_without_reading_the_stream(which, transport):
    """dense: q/k/v split copies; moe: + expert names; hybrid-next: + GDN regroupings and the
    zero-centred norm shifts (``torch.add`` into the arena). After each trainer step the replay
    carries the new values (the arena re-filled from the live parameters)."""
    from colocate.transports import spawn_receiver

    spec = SPECS[which]
    flat, params = _buffer(spec, torch.float32, seed=3, shared=transport == "shm")
    arena = ConversionArena.for_spec(spec, dtype=torch.float32, share_memory=transport == "shm")
    meta = hf_param_specs(spec, dtype=torch.float32)
    recv = DictReceiver(meta) if transport == "inprocess" else spawn_receiver(DictReceiver, meta, timeout_s=60)
    try:
        pub = Publisher(recv, PublishConfig(transport=transport, verify="none"), share_min_bytes=1, keep_shared=True,
                        replay_sources=[flat], arena=arena)
        first = pub.publish(_stream(params, spec, arena), version=1, meta=meta)
        assert not first.replayed and first.num_buckets == 0 and first.num_shared == 2, first
        for version in (2, 3):
            flat.mul_(-0.5).add_(0.25)  # the optimizer step, in place
            rep = pub.publish(_never(), version=version, meta=meta)
            assert rep.replayed and rep.num_shared == 2 and rep.num_buckets == 0 and rep.nbytes == first.nbytes, rep
            assert rep.handles == 0  # kept mapped: no new handle
            assert recv.checksums() == _want(params, spec)
        assert pub.replays == 2 and recv.weight_version() == 3
        pub.release_staging()
        flat.mul_(3.0)
        rep = pub.publish(_stream(params, spec, arena), version=4, meta=meta)  # release_staging: no recipe
        assert not rep.replayed and recv.checksums() == _want(params, spec)
    finally:
        if transport == "shm":
            recv.close()


def _unrecorded(params, spec, arena):
    """The converter's stream with q of layer 0 rewritten into the arena by a writer that does not
    record itself (as an all-gather into the arena is not)."""
    for n, t in _stream(params, spec, arena):
        if n == "model.layers.0.self_attn.q_proj.weight":
            out = arena.take(tuple(t.shape), t.dtype, name=n)
            out.copy_(t)
            t = out
        yield n, t


@pytest.mark.parametrize("reason", ["sources-elsewhere", "packed", "verify-checksum", "unrecorded-arena-write",
                                    "fill-from-temporary", "meta-changed", "storage-moved", "no-meta"])
def test_replay_falls_back_to_the_full_publish(reason):
    """Each condition under which repeating the hand-overs could send stale or wrong bytes: the
    next publish reads the stream (replayed False) and the receiver still matches the trainer.
    ``fill-from-temporary``: MoE whose expert_bias reaches the converter as a bf16 copy, so its
    fp32 cast into the arena reads a temporary. ``no-meta``: without ``meta`` the stream is drained
    before the arena could record its fills."""
    spec = SPECS["moe"] if reason == "fill-from-temporary" else DENSE
    flat, params = _buffer(spec, torch.float32, seed=4)
    arena = ConversionArena(arena_nbytes(spec, dtype=torch.float32) + (1 << 16))  # room for _unrecorded
    meta = hf_param_specs(spec, dtype=torch.float32)
    recv = DictReceiver(meta)
    cfg = PublishConfig(transport="inprocess", verify="checksum" if reason == "verify-checksum" else "none")
    sources = [torch.zeros(4)] if reason == "sources-elsewhere" else [flat]
    pub = Publisher(recv, cfg, share_min_bytes=1 << 40 if reason == "packed" else 1, replay_sources=sources,
                    arena=arena)
    stream = {"unrecorded-arena-write": _unrecorded, "fill-from-temporary": _convert}.get(reason, _stream)
    pub.publish(stream(params, spec, arena), version=1, meta=None if reason == "no-meta" else meta)
    flat.add_(1.0)
    kw = {"meta": meta}
    if reason == "meta-changed":
        kw = {"meta": {n: v for n, v in meta.items() if n != "lm_head.weight"}, "require_all": False}
    if reason == "storage-moved":
        st = flat.untyped_storage()
        st.resize_(st.nbytes() + 64)  # re-allocated (as a released/restored buffer may be)
    rep = pub.publish((kv for kv in stream(params, spec, arena) if kv[0] in kw["meta"]), version=2, **kw)
    assert not rep.replayed and pub.replays == 0
    want = {n: tensor_checksum(t) for n, t in (_convert if reason == "fill-from-temporary" else _stream)(params, spec)}
    assert recv.checksums(kw["meta"]) == {n: c for n, c in want.items() if n in kw["meta"]}


def test_failed_replay_poisons_the_version_and_the_next_publish_reads_the_stream():
    flat, params = _buffer(DENSE, torch.float32, seed=5)
    arena = ConversionArena.for_spec(DENSE, dtype=torch.float32)
    meta = hf_param_specs(DENSE, dtype=torch.float32)
    recv = DictReceiver(meta)
    pub = Publisher(recv, PublishConfig(transport="inprocess", verify="none"), share_min_bytes=1,
                    replay_sources=[flat], arena=arena)
    pub.publish(_stream(params, DENSE, arena), version=1, meta=meta)
    flat.add_(1.0)
    recv.fail_next = True
    with pytest.raises(PublishError, match="receiver failed mid-update") as err:
        pub.publish(_never(), version=2, meta=meta)
    assert err.value.phase == "transfer" and 2 in pub.poisoned and recv.weight_version() == 1
    rep = pub.publish(_stream(params, DENSE, arena), version=3, meta=meta)
    assert not rep.replayed and recv.checksums() == _want(params, DENSE)


def test_arena_without_replay_sources_is_a_config_error():
    recv = DictReceiver(hf_param_specs(DENSE, dtype=torch.float32))
    with pytest.raises(ConfigError, match="arena= is for replay: pass replay_sources="):
        Publisher(recv, PublishConfig(transport="inprocess"), arena=ConversionArena(16))


def test_replay_with_iter_hf_weights_of_a_real_megatron_model(cpu_megatron):
    """Real tiny Megatron GPT (CPU, gloo, TP = 1) into the HF engine: the first publish reads
    ``iter_hf_weights(arena=)``; after an in-place update of every parameter the second is a
    replay (the generator is never started) and the engine holds exactly the fresh conversion."""
    from colocate.engines import HFEngine
    from colocate.megatron import iter_hf_weights, model_spec_from_megatron
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(7)
    model = build_tiny_gpt(TinyGPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                         kv_channels=8, ffn_hidden_size=48, vocab_size=64)).eval()
    spec = model_spec_from_megatron(model)
    arena = ConversionArena.for_spec(spec, dtype=torch.float32)
    meta = hf_param_specs(spec, dtype=torch.float32)
    engine = HFEngine(spec)
    pub = Publisher(engine, PublishConfig(transport="inprocess", verify="none"), share_min_bytes=1,
                    replay_sources=model.parameters(), arena=arena)
    assert not pub.publish(iter_hf_weights([model], spec=spec, arena=arena), version=1, meta=meta).replayed
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9).add_(0.01)
    started = []

    def stream():
        started.append(True)
        yield from iter_hf_weights([model], spec=spec, arena=arena)

    rep = pub.publish(stream(), version=2, meta=meta)
    assert rep.replayed and not started
    want = {n: tensor_checksum(t) for n, t in iter_hf_weights([model], spec=spec)}
    assert engine.checksums() == want
