"""The control plane over its RPC (Unix socket and TCP): typed errors, one producer per node,
readers in threads. The teacher here is a plain function of the tokens (the Megatron teacher runs in
test_features.py / test_multiprocess.py); this test is about the protocol."""

from __future__ import annotations

import threading
from dataclasses import asdict

import pytest
import torch

from shared_teacher import (
    CompatKey,
    IncompatibleSubscriptionError,
    NodeLimits,
    SharedTeacherSource,
    ShmStore,
    SourceConfig,
    SourceServer,
    StudentReader,
    StudentSpec,
    run_producer,
)
from shared_teacher.refs import epoch_order, sample_id
from shared_teacher.rpc import SourceClient

KEY = CompatKey(teacher_fingerprint="fn", tokenizer="ids", signals=["logprobs"], max_length=16, seed=2)
DATA = [torch.arange(3 + i % 7) for i in range(20)]


def teacher(seqs):
    return [{"tokens": s.clone(), "logprobs": -torch.arange(s.numel() - 1, dtype=torch.float32)} for s in seqs]


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_rpc_per_node_producers_and_readers(tcp):
    nodes = {n: NodeLimits(high_samples=4, low_samples=3) for n in ("n0", "n1")}
    students = [StudentSpec(name="x", ranks_per_node={"n0": 1, "n1": 1}, micro_batch_size=2),
                StudentSpec(name="y", ranks_per_node={"n0": 1, "n1": 1}, micro_batch_size=1, accumulation_steps=2)]
    cfg = SourceConfig(key=KEY, nodes=nodes, students=students, dataset_size=len(DATA), max_sample_bytes=1024,
                       max_seq_len=16, lease_timeout_s=30, watchdog_s=60)
    store = ShmStore()
    src = SharedTeacherSource(cfg, store)
    server = SourceServer(src, address=("127.0.0.1", 0) if tcp else None)
    info = server.connect_info
    seen: dict[tuple[str, int], list[str]] = {}
    errors: list[BaseException] = []

    def reader(name, rank):
        try:
            r = StudentReader(info, student=name, rank=rank, key=KEY, store_spec=store.spec(), timeout=30)
            ids = seen.setdefault((name, rank), [])
            for w in r:
                for m, mb in enumerate(w.micro_batches):
                    for ref, f in zip(mb, r.load(mb)):
                        assert ref.node == r.node and f["tokens"].numel() == ref.num_tokens
                        ids.append(ref.sample_id)
                    r.ack_read(w, m)
                r.ack_step(w)
            r.close()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    def producer(node):
        try:
            out[node] = run_producer(info, store_spec=store.spec(), teacher=teacher, dataset=DATA, key=KEY,
                                     nodes=[node], batch_size=3, deadline_s=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    out: dict[str, dict] = {}
    try:
        client = SourceClient(info)
        bad = CompatKey(**{**asdict(KEY), "tokenizer": "other", "max_length": 32})
        with pytest.raises(IncompatibleSubscriptionError) as exc:
            client.call("subscribe", student="x", rank=0, pid=1, key=asdict(bad))
        assert set(exc.value.fields) == {"tokenizer", "max_length"}
        with pytest.raises(ValueError, match="unknown control-plane method 'close'"):
            client.call("close")
        threads = [threading.Thread(target=reader, args=(s.name, r)) for s in students for r in range(2)]
        threads += [threading.Thread(target=producer, args=(n,)) for n in ("n0", "n1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads)
        assert sum(o["forward_samples"] for o in out.values()) == len(DATA)
        order = epoch_order(len(DATA), seed=KEY.seed, epoch=0)
        for name in ("x", "y"):
            got = seen[(name, 0)] + seen[(name, 1)]
            assert sorted(got) == sorted(sample_id(0, i) for i in order) and len(set(got)) == len(got)
            assert all(int(s.split("-i")[1]) in order[0::2] for s in seen[(name, 0)])  # node affinity
        assert store.objects() == [] and src.stats()["counters"]["freed"] == len(DATA)
        client.close()
    finally:
        server.close()
        src.close()
        store.close(remove=True)
