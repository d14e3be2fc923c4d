"""Reader (student rank) and producer sides of the shared teacher source.

:class:`StudentReader` — one per student rank: subscribes with the student's compatibility key,
heartbeats its lease on a thread, fetches its share of each window, reads the features from the
store into private tensors, fast-acks each micro-batch and durable-acks the window after the
optimizer step (the returned :class:`StudentCursor` goes into the student's checkpoint).

:func:`run_producer` — the teacher side: asks admission for the next positions of each node,
scores the admitted sequences with a :data:`~shared_teacher.features.TeacherFeatureFn` in one
batch, puts one object per sample and publishes the refs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from shared_teacher.config import CompatKey
from shared_teacher.errors import SharedTeacherError, WaitTimeoutError
from shared_teacher.features import TeacherFeatureFn
from shared_teacher.ledger import StudentCursor
from shared_teacher.refs import SampleRef, epoch_order, node_position
from shared_teacher.rpc import SourceClient
from shared_teacher.store import open_store

__all__ = ["Window", "StudentReader", "run_producer"]


@dataclass(kw_only=True)
class Window:
    """This rank's share of one optimizer step: ``micro_batches[m]`` is a list of refs."""

    index: int
    epoch: int
    micro_batches: list[list[SampleRef]]


class StudentReader:
    """Reader of one student rank (see module docstring).

    Args:
        connect_info: :attr:`SourceServer.connect_info`.
        student: the student's name in the source config.
        rank: this rank within the student (node-major).
        key: the compatibility key the student needs.
        store_spec: :meth:`FeatureStore.spec` of the source's store.
        resume: the cursor from the student's checkpoint (``None``: fresh start).
        heartbeat_s: heartbeat period (well below the source's ``lease_timeout_s``).
        timeout: default wait for a window / an ack (then :class:`WaitTimeoutError`); ``None`` waits
            as long as the source is healthy (a lag-capped student may legitimately wait for a slow
            one): it asks again every 30 s, and any other error (the watchdog's
            :class:`SourceStalledError` when the producer died, a closed source, a dead control plane)
            ends the wait.
    """

    def __init__(self, connect_info: dict, *, student: str, rank: int, key: CompatKey, store_spec: dict,
                 resume: dict | None = None, heartbeat_s: float = 0.5, timeout: float | None = None) -> None:
        self.student, self.rank, self.timeout = student, rank, timeout
        self.client = SourceClient(connect_info)
        try:
            info = self.client.call("subscribe", student=student, rank=rank, pid=os.getpid(), key=asdict(key),
                                    resume=resume)
        except BaseException:
            self.client.close()
            raise
        self.lease = info["lease"]
        self.world_size = info["world_size"]
        self.node = info["node"]
        self.store = open_store(store_spec)
        self._stop = threading.Event()
        self._hb_client = SourceClient(connect_info)
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True)
        self._hb.start()

    def _beat(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self._hb_client.call("heartbeat", lease=self.lease)
            except (SharedTeacherError, OSError, EOFError, TimeoutError):  # ConnectionError is an OSError
                return

    def _blocking(self, method: str, timeout: float | None, **kwargs):
        """Call a blocking control-plane method; without a timeout, wait in 30 s slices."""
        limit = timeout if timeout is not None else self.timeout
        if limit is not None:
            return self.client.call(method, lease=self.lease, timeout=limit, **kwargs)
        while True:
            try:
                return self.client.call(method, lease=self.lease, timeout=30.0, **kwargs)
            except WaitTimeoutError:
                continue  # only "the source waited 30 s, healthy": every other error (stall, close) propagates

    def next_window(self, timeout: float | None = None) -> Window | None:
        """This rank's next window, or ``None`` at the end of the stream."""
        d = self._blocking("next_window", timeout)
        if d is None:
            return None
        return Window(index=d["window"], epoch=d["epoch"],
                      micro_batches=[[SampleRef(**r) for r in mb] for mb in d["micro_batches"]])

    def load(self, refs: list[SampleRef]) -> list[dict[str, torch.Tensor]]:
        """Features of ``refs`` as private tensors (safe after the pins are dropped)."""
        return [self.store.get(r) for r in refs]

    def ack_read(self, window: Window, micro: int) -> None:
        """Fast ack of micro-batch ``micro`` (its features are read)."""
        self.client.call("ack_read", lease=self.lease, window=window.index, micro=micro)

    def ack_step(self, window: Window, timeout: float | None = None) -> StudentCursor:
        """Durable ack after the optimizer step; returns the cursor to store in the checkpoint."""
        return StudentCursor.from_dict(self._blocking("ack_step", timeout, window=window.index))

    def leave(self, reason: str = "left") -> None:
        """Stop consuming (step limit reached); the source fences this student once its processes exit."""
        self.client.call("leave", lease=self.lease, reason=reason)

    def __iter__(self):
        while (w := self.next_window()) is not None:
            yield w

    def close(self) -> None:
        self._stop.set()
        self._hb.join(timeout=2)
        self.client.close()
        self._hb_client.close()


def run_producer(connect_info: dict, *, store_spec: dict, teacher: TeacherFeatureFn, dataset: Sequence[torch.Tensor],
                 key: CompatKey, batch_size: int = 4, poll_s: float = 0.05, plan_timeout: float = 120.0,
                 deadline_s: float | None = None, nodes: list[str] | None = None) -> dict:
    """Produce the stream: admit → teacher forward (one batch per node and round) → put → publish.

    ``nodes``: the nodes this producer serves (default all); run one producer per node for
    node-local features, each with its teacher and its node's store.

    ``key`` must equal the source's key (checked by ``plan``: seed, order and ``max_length`` decide
    what the producer scores). Returns ``{"forward_samples", "forward_batches", "skipped",
    "put_bytes"}``. Raises :class:`WaitTimeoutError` if the stream is not finished after ``deadline_s``
    (``None``: no deadline; the source's watchdog turns a stall into ``SourceStalledError``).
    """
    client = SourceClient(connect_info)
    store = open_store(store_spec)
    try:
        plan = client.call("plan", key=asdict(key), timeout=plan_timeout)
        all_nodes, sizes = plan["nodes"], plan["sizes"]
        unknown = set(nodes or []) - set(all_nodes)
        if unknown:
            raise SharedTeacherError(f"run_producer: nodes {sorted(unknown)} are not in the source ({all_nodes})")
        mine = list(nodes or all_nodes)
        pos = {n: plan["start"][n] for n in mine}
        end = {n: plan["num_epochs"] * sizes[n] for n in mine}
        orders: dict[int, list[int]] = {}
        stats = {"forward_samples": 0, "forward_batches": 0, "skipped": 0, "put_bytes": 0}
        limit = time.monotonic() + deadline_s if deadline_s is not None else float("inf")

        def index_of(n: str, s: int) -> int:
            epoch, p = node_position(s, all_nodes.index(n), len(all_nodes), sizes[n])
            if epoch not in orders:
                orders[epoch] = epoch_order(len(dataset), seed=key.seed, epoch=epoch, order=key.epoch_order)
            return orders[epoch][p]

        while any(pos[n] < end[n] for n in mine):
            if time.monotonic() > limit:
                raise WaitTimeoutError(f"run_producer: stream not finished after {deadline_s}s; positions {pos} of "
                                       f"{end}")
            for n in mine:
                if pos[n] >= end[n]:
                    continue
                nxt = range(pos[n], min(pos[n] + batch_size, end[n]))
                lengths = [min(len(dataset[index_of(n, s)]), key.max_length) for s in nxt]
                decisions = client.call("admit", node=n, lengths=lengths, timeout=poll_s)
                if not decisions:
                    continue
                if decisions[0]["s"] != pos[n]:
                    raise SharedTeacherError(f"producer out of sync on node {n!r}: expected position {pos[n]}, "
                                             f"source admitted {decisions[0]['s']}")
                pos[n] = decisions[-1]["s"] + 1
                todo = [d for d in decisions if d["produce"]]
                stats["skipped"] += len(decisions) - len(todo)
                if not todo:
                    continue
                seqs = [dataset[d["index"]][: key.max_length] for d in todo]
                feats = teacher(seqs)
                stats["forward_samples"] += len(seqs)
                stats["forward_batches"] += 1
                refs = []
                for d, f, seq in zip(todo, feats, seqs):
                    p = node_position(d["s"], all_nodes.index(n), len(all_nodes), sizes[n])[1]
                    ref = store.put(f, sample_id=d["sample_id"], generation=d["generation"], node=n,
                                    num_tokens=len(seq), schema_key=plan["schema_key"], epoch=d["epoch"], position=p)
                    stats["put_bytes"] += ref.nbytes
                    refs.append(asdict(ref))
                client.call("publish", refs=refs)
        return stats
    finally:
        client.close()
