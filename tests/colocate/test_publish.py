"""Publisher: in-process, shared-memory (other process, zero-copy), disk; verification,
poisoned versions, mismatch/timeout/dead-receiver errors with the previous weights kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from colocate import HFModelSpec, PublishConfig
from colocate.buckets import tensor_checksum
from colocate.convert import ParamMismatchError
from colocate.engines import HFEngine, UpdateError, build_hf_model, hf_checkpoint_views
from colocate.publish import PoisonedVersionError, Publisher, PublishError
from colocate.transports import ReceiverDied, ReceiverTimeout, TransportError, spawn_receiver

from ._ranks import ShmProbe, slow_commit_engine, slow_engine
from .test_workers import _gone

ROOT = Path(__file__).resolve().parents[2]

DENSE = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)
MOE = HFModelSpec(arch="qwen3_moe", num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=1,
                  head_dim=8, ffn_hidden_size=48, vocab_size=64, num_experts=3, tie_embeddings=True,
                  rope_theta=10000.0)


def _weights(spec, seed):
    torch.manual_seed(seed)
    return {n: v.detach().clone() for n, v in hf_checkpoint_views(build_hf_model(spec)).items()}


@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe-tied"])
def test_inprocess_versions_logits_and_poisoning(spec):
    engine = HFEngine(spec)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    assert pub.transport == "inprocess"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for version, seed in ((1, 10), (2, 11)):
        w = _weights(spec, seed)
        rep = pub.publish(w, version=version)
        assert rep.num_buckets > 1 and rep.nbytes == sum(t.numel() * t.element_size() for t in w.values())
        assert set(rep.timings) == {"convert", "begin", "plan", "bucket", "transfer", "load", "release", "verify"}
        assert engine.weight_version() == version
        ref = build_hf_model(spec)
        views = hf_checkpoint_views(ref)
        with torch.no_grad():
            for n, t in w.items():
                views[n].copy_(t)
            ref_logits = ref(input_ids=ids).logits
        assert (engine.logits(ids) - ref_logits).abs().max().item() <= 1e-5
        assert engine.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
    with pytest.raises(PoisonedVersionError, match="not newer"):
        pub.publish(w, version=2)


def test_mismatch_and_corruption_poison_and_keep_previous_weights():
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    good = _weights(DENSE, 1)
    pub.publish(good, version=1)
    before = engine.checksums()
    bad = dict(good)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    bad["bogus.weight"] = torch.zeros(2)
    with pytest.raises(PublishError) as ei:
        pub.publish(bad, version=2)
    assert isinstance(ei.value.cause, ParamMismatchError) and ei.value.phase == "check"
    assert "k_proj.weight: sent (8, 32) torch.float32, receiver expects (16, 32) torch.float32" in str(ei.value)
    assert 2 in pub.poisoned and engine.weight_version() == 1 and engine.checksums() == before
    with pytest.raises(PoisonedVersionError):
        pub.publish(good, version=2)

    class Corrupting(HFEngine):
        def load_bucket(self, entries, buffer):
            buffer[entries[-1].offset] ^= 1  # flip one bit of the last tensor of each bucket
            super().load_bucket(entries, buffer)

    engine2 = Corrupting(DENSE)
    pub2 = Publisher(engine2, PublishConfig(bucket_bytes=16 << 10))
    prev = engine2.checksums()
    with pytest.raises(PublishError) as ei:
        pub2.publish(_weights(DENSE, 2), version=1)
    assert isinstance(ei.value.cause, UpdateError) and "checksum mismatch" in str(ei.value)
    assert engine2.weight_version() is None and engine2.checksums() == prev
    engine2.begin_update(5)  # the failed update was aborted: a new one can open
    engine2.abort_update(5)

    class WrongVersion(HFEngine):  # commits, then reports another version: must be rolled back
        def weight_version(self):
            v = super().weight_version()
            return None if v is None else v + 100

    engine3 = WrongVersion(DENSE)
    pub3 = Publisher(engine3, PublishConfig(bucket_bytes=16 << 10))
    prev = engine3.checksums()
    with pytest.raises(PublishError) as ei:
        pub3.publish(_weights(DENSE, 3), version=1)
    assert ei.value.phase == "verify" and "weight_version 101" in str(ei.value)
    assert engine3.checksums() == prev


@pytest.mark.timeout(120)
def test_shared_memory_zero_copy_across_processes():
    recv = spawn_receiver(ShmProbe, timeout_s=30)
    try:
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1024, max_in_flight=2, verify="none"))
        assert pub.transport == "shm"
        buf = pub._buffer(0, 1024)
        assert buf.is_shared()
        recv.attach_buffer(0, buf)
        for value in (7, 9):
            buf[:4] = value
            recv.submit_slot(0, [])
            recv.wait_one(10)
            assert buf[0].item() == 123  # the receiver's write is visible here: same memory
        seen, distinct = recv.call("report")
        assert seen == [[7, 7, 7, 7], [9, 9, 9, 9]] and distinct == 1
    finally:
        recv.close()


def _in_one_storage(w: dict[str, torch.Tensor], *, separate: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w`` rebuilt as views of one shared-memory buffer, except the first ``separate`` tensors."""
    names = list(w)
    flat = torch.empty(sum(w[n].numel() for n in names[separate:]), dtype=torch.float32).share_memory_()
    out, off = {n: w[n].clone() for n in names[:separate]}, 0
    for n in names[separate:]:
        out[n] = flat[off: off + w[n].numel()].view(w[n].shape)
        out[n].copy_(w[n])
        off += w[n].numel()
    return out, flat


@pytest.mark.timeout(180)
def test_remote_engine_shm_disk_sampled_and_death():
    recv = spawn_receiver(HFEngine, DENSE, timeout_s=60)
    try:
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=24 << 10, max_in_flight=2))
        w1 = _weights(DENSE, 1)
        rep = pub.publish(w1, version=1)
        assert rep.num_buckets > 2 and rep.handles == 2  # one handle per staging buffer
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w1.items()}
        w2 = _weights(DENSE, 2)
        assert pub.publish(w2, version=2).handles == 0  # buffers reused, no new handles
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w2.items()}

        disk = Publisher(recv, PublishConfig(transport="disk", bucket_bytes=64 << 10, verify="sampled"))
        w3 = _weights(DENSE, 3)
        assert disk.publish(w3, version=3).verify == "sampled"
        assert recv.weight_version() == 3 and recv.checksums() == {n: tensor_checksum(t) for n, t in w3.items()}
        out = recv.call("generate", [[1, 2, 3]], timeout=60)
        assert len(out.tokens[0]) == 16

        # in place: every tensor but two lives in one shared-memory storage (a DDP-like buffer);
        # that storage crosses once, unpacked, and only the two separate tensors are packed
        inplace = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=24 << 10), share_min_bytes=4096)
        inplace.last_good = 3
        for version, seed in ((4, 5), (5, 6)):
            w, views = _in_one_storage(_weights(DENSE, seed), separate=2)
            rep = inplace.publish(w, version=version)
            assert rep.num_shared == 1 and rep.num_buckets == 1 and rep.verify == "checksum", rep
            # the storage is unmapped after each publish (the trainer may free it), so it crosses again
            assert rep.handles == (2 if version == 4 else 1) and not inplace._shared_slots  # + 1 staging buffer
            assert recv.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
        keep = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=24 << 10), share_min_bytes=4096,
                         keep_shared=True)
        keep.last_good = 5
        assert [keep.publish(w, version=v).handles for v in (6, 7)] == [2, 0]
        views.add_(1)  # in place: the next publish sends the trainer's current values
        assert keep.publish(w, version=8).handles == 0
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
        keep.release_staging()
        pub.last_good = 8

        def dying():
            for i, item in enumerate(_weights(DENSE, 4).items()):
                if i == 5:
                    recv.process.kill()
                yield item

        with pytest.raises(PublishError) as ei:
            pub.publish(dying(), version=9, meta={n: (tuple(t.shape), t.dtype) for n, t in w3.items()})
        assert isinstance(ei.value.cause, ReceiverDied) and 9 in pub.poisoned and ei.value.phase == "transfer"
        with pytest.raises(TransportError):
            recv.weight_version()
    finally:
        recv.close()


@pytest.mark.timeout(120)
def test_receiver_timeout_is_typed_and_poisons():
    recv = spawn_receiver(slow_engine, DENSE, 3.0, timeout_s=30)
    try:
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1 << 20, timeout_s=0.5))
        recv.timeout_s = 0.5  # every wait of this publish: far below the 3 s bucket load
        with pytest.raises(PublishError) as ei:
            pub.publish(_weights(DENSE, 1), version=1)
        assert isinstance(ei.value.cause, ReceiverTimeout) and 1 in pub.poisoned
        # The late answers to the abandoned update are recognised and dropped; a newer
        # version supersedes the abandoned one on the receiver.
        recv.timeout_s = 20
        pub.config.timeout_s = 20
        w = _weights(DENSE, 2)
        assert pub.publish(w, version=2).version == 2
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
    finally:
        recv.close(timeout=1)


def test_inprocess_inplace_storage_verified_against_sender_checksums():
    """In place (the engine copies from the trainer's storage when the group is flushed): the
    bytes are checked against checksums taken when each tensor was yielded, so a storage that
    changes in between is caught and the previous weights stay."""
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=16 << 10)  # the 3 separate: packed
    w1, _ = _in_one_storage(_weights(DENSE, 1), separate=3)
    rep = pub.publish(w1, version=1)
    assert rep.num_shared == 1 and rep.num_buckets == 1 and rep.verify == "checksum"
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in w1.items()}

    w2, flat = _in_one_storage(_weights(DENSE, 2), separate=3)

    def changes_after_yield():
        yield from w2.items()
        flat.mul_(2)  # the trainer writes to the buffer before the publisher flushed it

    with pytest.raises(PublishError, match="checksum") as ei:
        pub.publish(changes_after_yield(), version=2, meta={n: (tuple(t.shape), t.dtype) for n, t in w2.items()})
    assert ei.value.phase == "load" and 2 in pub.poisoned
    assert engine.weight_version() == 1 and engine.checksums() == {n: tensor_checksum(t) for n, t in w1.items()}


def test_inplace_rejects_a_reused_buffer():
    """A generator that yields successive tensors through one reused buffer would leave the
    receiver reading only the last contents: refused before anything is handed over."""
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=1)
    w = _weights(DENSE, 1)
    scratch = torch.empty(max(t.numel() for t in w.values()))

    def reused():
        for n, t in w.items():
            out = scratch[: t.numel()].view(t.shape)
            out.copy_(t)
            yield n, out

    with pytest.raises(PublishError, match="overlapping views of one storage"):
        pub.publish(reused(), version=1, meta={n: (tuple(t.shape), t.dtype) for n, t in w.items()})
    assert engine.weight_version() is None


@pytest.mark.timeout(120)
def test_publish_timeout_bounds_the_load_wait():
    """``PublishConfig.timeout_s`` bounds the wait for ``end_update`` (verify + commit) of a
    receiver in another process, not the proxy's own 600 s default."""
    recv = spawn_receiver(slow_commit_engine, DENSE, 8.0, 2, timeout_s=600)
    try:
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1 << 20, timeout_s=60))
        pub.publish(_weights(DENSE, 1), version=1)
        pub.config.timeout_s = 0.5
        t0 = time.monotonic()
        with pytest.raises(PublishError) as ei:
            pub.publish(_weights(DENSE, 2), version=2)
        assert time.monotonic() - t0 < 5.0, "the publish waited for the 8 s commit"
        assert isinstance(ei.value.cause, ReceiverTimeout) and ei.value.phase == "load" and 2 in pub.poisoned
    finally:
        recv.close(timeout=1)


@pytest.mark.timeout(120)
def test_a_version_committed_after_the_timeout_is_never_served():
    """The receiver finishes committing a version after the publisher gave up on it (and poisoned
    it); the abort that follows it in the receiver's queue rolls it back, so the engine serves the
    previous version and its weights, never the poisoned one."""
    recv = spawn_receiver(slow_commit_engine, DENSE, 3.0, 2, timeout_s=0.5)
    try:
        pub = Publisher(recv, PublishConfig(transport="shm", bucket_bytes=1 << 20, timeout_s=30))
        w1 = _weights(DENSE, 1)
        pub.publish(w1, version=1)
        pub.config.timeout_s = 0.5
        with pytest.raises(PublishError) as ei:
            pub.publish(_weights(DENSE, 2), version=2)
        assert isinstance(ei.value.cause, ReceiverTimeout) and ei.value.phase == "load"
        recv.timeout_s = 30  # the next requests wait behind the late commit and the abort
        assert recv.weight_version() == 1
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w1.items()}
        pub.config.timeout_s = 30
        w3 = _weights(DENSE, 3)
        assert pub.publish(w3, version=3).version == 3 and recv.weight_version() == 3
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w3.items()}
    finally:
        recv.close(timeout=1)


@pytest.mark.timeout(120)
def test_spawned_receiver_exits_with_its_killed_owner():
    """An owner SIGKILLed while its receiver is busy inside a 120 s load: the receiver goes too
    (it never reads the pipe's EOF while busy)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "tests.colocate._receiver_owner"], env=env, capture_output=True,
                         text=True, timeout=90, cwd=ROOT)
    assert out.returncode == -9, out.stderr[-2000:]
    assert _gone(int(out.stdout.split()[0]), timeout=15), "the receiver outlived its owner"
