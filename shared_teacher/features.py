"""Teacher features from logits, batched (the producer's path), and the producer interface.

A teacher feature function scores a batch of token sequences and returns one dict of tensors per
sequence (:data:`TeacherFeatureFn`); the source never looks inside. Keys used here:
``tokens [L]`` (int64), ``logprobs [L-1]`` (``log p(x_{t+1} | x_{≤t})``), ``topk_logprobs [L, k]``,
``topk_ids [L, k]`` (int64) and ``hidden.<layer> [L, H]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

__all__ = ["TeacherFeatureFn", "features_from_logits", "fingerprint_state_dict", "max_object_bytes", "storage_dtype"]

TeacherFeatureFn = Callable[[list[torch.Tensor]], list[dict[str, torch.Tensor]]]
"""``fn(sequences)`` with ``sequences[i]`` an int64 ``[L_i]`` tensor → per-sequence feature dicts."""


def storage_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def features_from_logits(logits: torch.Tensor, tokens: torch.Tensor, lengths: list[int], *, signals: list[str],
                         top_k: int, dtype: torch.dtype, chunk: int = 1024) -> list[dict[str, torch.Tensor]]:
    """Per-sequence features of a right-padded batch.

    Args:
        logits: ``[B, S, V]`` teacher logits (any float dtype; reduced in fp32, or fp64 if given fp64).
        tokens: ``[B, S]`` int64 ids, right-padded.
        lengths: valid length of each row (``≤ S``).
        signals: subset of ``logprobs``, ``topk``.
        top_k: top log-probs per position.
        dtype: storage dtype of the float outputs.
        chunk: positions per log-softmax chunk (bounds the ``[chunk, V]`` temporary).

    ``logprobs[t] = logits[t, x_{t+1}] − logsumexp(logits[t])``; top-k from ``log_softmax(logits[t])``.
    """
    b, s, v = logits.shape
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out: list[dict[str, torch.Tensor]] = []
    for i in range(b):
        n = lengths[i]
        feats: dict[str, torch.Tensor] = {"tokens": tokens[i, :n].to(torch.int64).cpu()}
        lp_parts, val_parts, id_parts = [], [], []
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            logp = torch.log_softmax(logits[i, start:stop].to(acc), dim=-1)
            if "logprobs" in signals:
                hi = min(stop, n - 1)
                if hi > start:
                    tgt = tokens[i, start + 1:hi + 1].to(torch.int64)
                    lp_parts.append(logp[: hi - start].gather(-1, tgt[:, None]).squeeze(-1))
            if "topk" in signals:
                vals, ids = torch.topk(logp, top_k, dim=-1, sorted=True)
                val_parts.append(vals)
                id_parts.append(ids)
        if "logprobs" in signals:
            feats["logprobs"] = (torch.cat(lp_parts) if lp_parts else torch.zeros(0, dtype=acc)).to(dtype).cpu()
        if "topk" in signals:
            feats["topk_logprobs"] = torch.cat(val_parts).to(dtype).cpu()
            feats["topk_ids"] = torch.cat(id_parts).to(torch.int64).cpu()
        out.append(feats)
    return out


def fingerprint_state_dict(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 (first 16 hex) over sorted names, dtypes, shapes and bytes of the tensors."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def max_object_bytes(key, *, hidden_size: int, header: int = 4096) -> int:
    """Upper bound of one stored sample object for ``key`` (use as ``SourceConfig.max_sample_bytes``).

    Per token: int64 token, ``logprobs`` (storage dtype), ``top_k`` × (value + int64 id), one
    ``hidden_size`` vector per tap; plus 64-byte alignment per tensor and a JSON header.
    """
    item = storage_dtype(key.dtype).itemsize
    per_token = 8
    if "logprobs" in key.signals:
        per_token += item
    if "topk" in key.signals:
        per_token += key.top_k * (item + 8)
    if "hidden" in key.signals:
        per_token += len(key.hidden_taps) * hidden_size * item
    tensors = 1 + ("logprobs" in key.signals) + 2 * ("topk" in key.signals) + len(key.hidden_taps)
    return key.max_length * per_token + 64 * tensors + header
