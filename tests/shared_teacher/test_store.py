"""Feature stores: round trip of every dtype, atomic visibility, stale generations, release/abort/gc."""

from __future__ import annotations

import os

import pytest
import torch

from shared_teacher import FileStore, ShmStore, open_store
from shared_teacher.errors import StaleRefError, StoreError
from shared_teacher.refs import SampleRef, assert_no_tensors, parse_sample_id, sample_id


@pytest.fixture(params=["shm", "file"])
def store(request, tmp_path):
    s = ShmStore() if request.param == "shm" else FileStore(tmp_path / "pool")
    yield s
    s.close(remove=True)


def _put(store, tensors, sid="e0-i3", gen=1, node="n0"):
    return store.put(tensors, sample_id=sid, generation=gen, node=node, num_tokens=7, schema_key="k", epoch=0,
                     position=3)


def test_round_trip_all_dtypes_bitwise(store):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "bf16": torch.randn(7, 33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).half(),
        "i64": torch.randint(0, 151936, (7, 4), generator=g),
        "i32": torch.randint(-5, 5, (9,), generator=g, dtype=torch.int32),
        "bool": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
    }
    ref = _put(store, tensors)
    assert ref.nbytes == os.path.getsize(store._path("n0", "e0-i3", 1))
    back = store.get(ref)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    # a get returns private memory: releasing the object does not change what was read
    store.release(ref)
    assert torch.equal(back["f32"], tensors["f32"])


def test_stale_generation_release_abort_gc(store):
    ref1 = _put(store, {"x": torch.ones(3)}, gen=1)
    ref2 = _put(store, {"x": torch.full((3,), 2.0)}, gen=2)
    assert torch.equal(store.get(ref2)["x"], torch.full((3,), 2.0))
    store.release(ref1)
    with pytest.raises(StaleRefError, match="generation 1"):
        store.get(ref1)
    store.release(ref1)  # double / stale release is a no-op
    assert torch.equal(store.get(ref2)["x"], torch.full((3,), 2.0))
    store.abort(sample_id="e0-i3", generation=2, node="n0")
    with pytest.raises(StaleRefError):
        store.get(ref2)
    keep = _put(store, {"x": torch.ones(1)}, sid="e0-i5", gen=1)
    _put(store, {"x": torch.ones(1)}, sid="e0-i6", gen=1, node="n1")
    (store.root / "n1" / ".e0-i7.g1.tmp-1-host-999999").write_bytes(b"partial")  # a killed writer's temp
    (store.root / "n0" / ".e0-i8.g1.tmp-1-host-999999").write_bytes(b"partial")
    store.abort(sample_id="e0-i8", generation=1, node="n0")  # abort removes the temps of that put
    assert not (store.root / "n0" / ".e0-i8.g1.tmp-1-host-999999").exists()
    assert store.gc({(keep.sample_id, keep.generation)}) == 2
    assert store.objects() == [("n0", "e0-i5", 1)]
    assert store.pool_bytes("n0") == keep.nbytes and store.pool_bytes("n1") == 0


def test_reopen_from_spec_and_corruption(store):
    ref = _put(store, {"x": torch.arange(4)})
    other = open_store(store.spec())
    assert torch.equal(other.get(ref)["x"], torch.arange(4))
    store._path("n0", "e0-i3", 1).write_bytes(b"garbage!" + bytes(64))
    with pytest.raises(StoreError, match="bad magic"):
        store.get(ref)
    good = (store.root / "n0" / "e0-i3.g1")
    for garbled in (b"STSOBJ01" + (5).to_bytes(8, "little") + b"{nope" + bytes(64),  # header not JSON
                    b"STSOBJ01" + (2).to_bytes(8, "little") + b"{}" + bytes(64),  # no "tensors"
                    b"STSOBJ01\x01"):  # cut inside the header length
        good.write_bytes(garbled)
        with pytest.raises(StoreError, match="corrupt object header|truncated header"):
            store.get(ref)
    with pytest.raises(StoreError, match="unknown store kind 'rdma'"):
        open_store({"kind": "rdma"})
    with pytest.raises(StoreError, match="not storable"):
        _put(store, {"c": torch.zeros(2, dtype=torch.complex64)})


def test_refs_are_metadata_only():
    with pytest.raises(TypeError, match="metadata only"):
        SampleRef(sample_id=torch.zeros(2), generation=1, node="n0", nbytes=1, num_tokens=1, schema_key="k",
                  epoch=0, position=0)
    with pytest.raises(TypeError):
        assert_no_tensors(SampleRef(sample_id="e0-i1", generation=1, node="n0", nbytes=1, num_tokens=1,
                                    schema_key=[torch.ones(1)], epoch=0, position=0))
    assert parse_sample_id(sample_id(3, 17)) == (3, 17)


def test_pool_bytes_tolerates_files_vanishing_mid_scan(store, monkeypatch):
    """A writer renames its temp file (or a release unlinks) between listing and stat: the scan
    counts it as gone instead of raising (seen on the H200 bench's memory watcher)."""
    import pathlib

    keep = _put(store, {"x": torch.ones(8)})
    real_iterdir = pathlib.Path.iterdir

    def iterdir_with_ghost(self):
        yield from real_iterdir(self)
        yield self / ".e0-i9.g1.gone.tmp"  # listed, then gone before stat()

    monkeypatch.setattr(pathlib.Path, "iterdir", iterdir_with_ghost)
    assert store.pool_bytes("n0") == keep.nbytes
