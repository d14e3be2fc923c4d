"""Publisher plan cache: reused while meta and the receiver's specs are unchanged, rebuilt (with
the same typed errors) when a name, shape, dtype, ``require_all`` or a storage changes."""

from __future__ import annotations

import pytest
import torch

from colocate import HFModelSpec, PublishConfig
from colocate.buckets import tensor_checksum
from colocate.convert import ParamMismatchError
from colocate.engines import HFEngine, build_hf_model, hf_checkpoint_views
from colocate.publish import PHASES, Publisher, PublishError

DENSE = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)
K = "model.layers.0.self_attn.k_proj.weight"


def _weights(seed):
    torch.manual_seed(seed)
    return {n: v.detach().clone() for n, v in hf_checkpoint_views(build_hf_model(DENSE)).items()}


def _meta(w):
    return {n: (tuple(t.shape), t.dtype) for n, t in w.items()}


def _one_storage(w, *, order=None):
    """``w`` as views of one buffer, laid out in ``order`` (default: w's order)."""
    names = order or list(w)
    flat = torch.empty(sum(w[n].numel() for n in names))
    out, off = {}, 0
    for n in names:
        out[n] = flat[off: off + w[n].numel()].view(w[n].shape)
        out[n].copy_(w[n])
        off += w[n].numel()
    return {n: out[n] for n in w}, flat


class MutableSpecs(HFEngine):
    """An engine whose reported specs the test edits in place (same dict object every call)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.specs = super().param_specs()

    def param_specs(self):
        return self.specs


def test_plan_reused_and_results_identical():
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    for version in (1, 2, 3):
        w = _weights(version)
        rep = pub.publish(w, version=version, meta=_meta(w) if version == 3 else None)  # equal, new dicts
        assert set(rep.timings) == set(PHASES) and rep.num_tensors == len(w)
        assert engine.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
        if version == 1:
            entries = dict(pub._plan.entries)
    assert pub.plan_reused == 2
    assert all(pub._plan.entries[n] is e for n, e in entries.items())  # same frozen Entry objects


def test_plan_inplace_new_storage_and_new_offsets():
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=1)
    w = _weights(1)
    a, _ = _one_storage(w)
    assert pub.publish(a, version=1).num_shared == 1
    b, _ = _one_storage(_weights(2), order=list(reversed(w)))  # another storage, other offsets
    rep = pub.publish(b, version=2)
    assert pub.plan_reused == 1 and rep.num_shared == 1
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in b.items()}
    name = next(iter(w))
    assert pub._plan.entries[name].offset == b[name].storage_offset() * 4 != a[name].storage_offset() * 4


def _edit(change, w, meta):
    """``(weights, meta edited in place, expected mismatch line)`` for one kind of change."""
    bad = dict(w)
    if change == "shape":
        bad[K] = torch.zeros(8, 32)
        want = "k_proj.weight: sent (8, 32) torch.float32, receiver expects (16, 32) torch.float32"
    elif change == "dtype":
        bad[K] = w[K].to(torch.bfloat16)
        want = "k_proj.weight: sent (16, 32) torch.bfloat16, receiver expects (16, 32) torch.float32"
    elif change == "name":
        bad["bogus.weight"] = torch.zeros(2)
        want = "bogus.weight: sent (2,) torch.float32, receiver has no such parameter"
    else:  # removed
        del bad[K]
        want = "k_proj.weight: not sent, receiver expects (16, 32) torch.float32"
    meta.clear()
    meta.update(_meta(bad))
    return bad, meta, want


@pytest.mark.parametrize("change", ["shape", "dtype", "name", "removed"])
def test_changed_meta_rebuilds_plan_with_the_same_errors(change):
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    w = _weights(1)
    meta = _meta(w)
    pub.publish(w, version=1, meta=meta)
    bad, meta, want = _edit(change, w, meta)  # the same dict object, edited: the plan kept a copy
    with pytest.raises(PublishError) as ei:
        pub.publish(bad, version=2, meta=meta)
    assert isinstance(ei.value.cause, ParamMismatchError) and ei.value.phase == "check" and want in str(ei.value)
    assert pub.publish(w, version=3, meta=_meta(w)).version == 3 and pub.plan_reused == 0  # planned again
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in w.items()}


def test_require_all_is_part_of_the_plan():
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    partial = {n: t for n, t in _weights(1).items() if n != K}
    pub.publish(partial, version=1, require_all=False)
    with pytest.raises(PublishError, match="k_proj.weight: not sent, receiver expects"):
        pub.publish(partial, version=2)
    pub.publish(partial, version=3, require_all=False)
    pub.publish(partial, version=4, require_all=False)
    assert pub.plan_reused == 1


def test_receiver_specs_edited_in_place_are_seen():
    engine = MutableSpecs(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    w = _weights(1)
    pub.publish(w, version=1)
    engine.specs[K] = ((8, 32), torch.float32)  # the plan keeps a copy: the change must be caught
    with pytest.raises(PublishError, match=r"k_proj.weight: sent \(16, 32\) torch.float32, receiver expects "
                                           r"\(8, 32\) torch.float32"):
        pub.publish(w, version=2)
    assert pub.plan_reused == 0


def test_yielded_tensors_still_checked_against_a_reused_plan():
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    w = _weights(1)
    meta = _meta(w)
    pub.publish(w, version=1, meta=meta)

    first = next(iter(w))

    def stream(edit):
        yield from edit(list(w.items()))

    cases = [
        (lambda it: [(n, t.to(torch.bfloat16) if n == K else t) for n, t in it],
         f"weights yielded {K!r} as (16, 32) torch.bfloat16, meta says (16, 32) torch.float32"),
        (lambda it: [(n, torch.zeros(8, 32) if n == K else t) for n, t in it],
         f"weights yielded {K!r} as (8, 32) torch.float32, meta says (16, 32) torch.float32"),
        (lambda it: it + [("bogus.weight", torch.zeros(2))], "weights yielded 'bogus.weight', which is not in meta"),
        (lambda it: it + [it[0]], f"weights yielded {first!r} twice"),
        (lambda it: it[:-1], "weights ended before 1 planned tensor(s)"),
    ]
    for version, (edit, want) in enumerate(cases, start=2):
        with pytest.raises(PublishError) as ei:
            pub.publish(stream(edit), version=version, meta=meta)
        assert isinstance(ei.value.cause, ValueError) and want in str(ei.value), str(ei.value)
        assert engine.weight_version() == 1
    assert pub.plan_reused == len(cases)


def test_odd_meta_values_fall_back_to_a_fresh_check():
    """Shapes as lists (allowed by check_params) never match the plan's int tuples: each publish
    checks again instead of reusing, with the same outcome."""
    engine = HFEngine(DENSE)
    pub = Publisher(engine, PublishConfig(bucket_bytes=16 << 10))
    w = _weights(1)
    meta = {n: (list(t.shape), t.dtype) for n, t in w.items()}
    for version in (1, 2):
        pub.publish(w, version=version, meta=meta)
    assert pub.plan_reused == 0 and engine.checksums() == {n: tensor_checksum(t) for n, t in w.items()}


def test_pack_bucket_round_trip_mixed_dtypes_and_strides():
    """pack_bucket equals per-entry copies: mixed dtypes, a non-contiguous source, and the same
    error for a tensor that does not match its entry."""
    from colocate.buckets import pack_bucket, plan_buckets, unpack_bucket

    g = torch.Generator().manual_seed(0)
    ts = {"a": torch.randn(5, 3, generator=g).t(), "b": torch.randn(7, generator=g).to(torch.bfloat16),
          "c": torch.randint(0, 100, (4, 2), generator=g, dtype=torch.int64), "d": torch.randn(1, generator=g)}
    (entries,) = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in ts.items()], bucket_bytes=1 << 20)
    buf = torch.zeros(entries[-1].offset + 256, dtype=torch.uint8)
    pack_bucket(ts, entries, buf)
    got = unpack_bucket(buf, entries)
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in ts.items())
    with pytest.raises(ValueError, match=r"pack_bucket: b is \(7,\) torch.float32, planned \(7,\) torch.bfloat16"):
        pack_bucket({**ts, "b": ts["b"].float()}, entries, buf)
    pack_bucket({}, [], buf)  # an empty bucket is a no-op


@pytest.mark.parametrize("foreach_max_bytes", [0, 40, 1 << 20])
def test_copy_tensors_split_between_foreach_and_plain_copies(foreach_max_bytes):
    """copy_tensors equals copy_ pair by pair whether a pair goes through the batched
    ``_foreach_copy_`` (under the threshold) or its own copy (0: all plain; 40 B: mixed; 1 MiB: all
    batched), incl. a strided source and a bf16 destination of an fp32 source (cast like copy_)."""
    from colocate.buckets import copy_tensors

    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(6, 4, generator=g).t(), torch.randn(3, generator=g), torch.randn(50, generator=g),
            torch.randint(0, 9, (5,), generator=g)]
    dsts = [torch.empty(4, 6), torch.empty(3, dtype=torch.bfloat16), torch.empty(50), torch.empty(5, dtype=torch.int64)]
    copy_tensors(dsts, srcs, foreach_max_bytes=foreach_max_bytes)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))
    with pytest.raises(ValueError):
        copy_tensors(dsts, srcs[:2])
