"""Control plane records: metadata-only references to sample objects, and the epoch order.

A :class:`SampleRef` is what travels between the source, the producer and the students; the
features themselves stay in a :class:`~shared_teacher.store.FeatureStore`. Records never hold
tensors (:func:`assert_no_tensors`), so the control plane can be a small RPC server.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["SampleRef", "sample_id", "parse_sample_id", "epoch_order", "node_position", "node_of", "assert_no_tensors"]


def sample_id(epoch: int, index: int) -> str:
    """Stable id of dataset row ``index`` in ``epoch`` (the unit of exactly-once accounting)."""
    return f"e{epoch}-i{index}"


def parse_sample_id(sid: str) -> tuple[int, int]:
    """Inverse of :func:`sample_id`: ``(epoch, index)``."""
    e, i = sid.split("-")
    if not (e.startswith("e") and i.startswith("i")):
        raise ValueError(f"not a sample id: {sid!r}")
    return int(e[1:]), int(i[1:])


def epoch_order(dataset_size: int, *, seed: int, epoch: int, order: str = "permute") -> list[int]:
    """Dataset indices in the deterministic order of ``epoch`` (same on every process and restart)."""
    if order == "sequential":
        return list(range(dataset_size))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=g).tolist()


def node_position(s: int, node_index: int, num_nodes: int, node_size: int) -> tuple[int, int]:
    """Node stream index ``s`` of node ``node_index`` → ``(epoch, epoch position)``.

    Node ``i`` holds epoch positions ``i, i + N, i + 2N, …`` (``node_size`` of them per epoch).
    """
    epoch, j = divmod(s, node_size)
    return epoch, j * num_nodes + node_index


def node_of(position: int, nodes: list[str]) -> str:
    """Node that produces and holds epoch position ``position`` (round-robin, deterministic)."""
    return nodes[position % len(nodes)]


@dataclass(frozen=True, kw_only=True)
class SampleRef:
    """Metadata of one stored sample object (one sample = one object = one pin unit)."""

    sample_id: str
    """``e{epoch}-i{index}``: unique per epoch, the de-dup key of every student ledger."""
    generation: int
    """Production attempt; a ref of an older generation is stale (gets fail, releases are no-ops)."""
    node: str
    """Node whose pool holds the object (readers on that node read it)."""
    nbytes: int
    """Stored bytes of the object."""
    num_tokens: int
    """Tokens of the sequence (what packed students count)."""
    schema_key: str
    """:meth:`CompatKey.schema_key` of the producing source."""
    epoch: int
    """Epoch of the sample."""
    position: int
    """Position in the epoch order (the dispatch order)."""

    def __post_init__(self) -> None:
        assert_no_tensors(self)


def assert_no_tensors(record: object) -> None:
    """Raise ``TypeError`` if a control-plane record carries a tensor (features belong in the store)."""
    values = [getattr(record, f.name) for f in fields(record)] if hasattr(record, "__dataclass_fields__") else [record]
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            raise TypeError(f"{type(record).__name__} must be metadata only, found a tensor of shape {tuple(v.shape)}")
        if isinstance(v, (list, tuple, set)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
