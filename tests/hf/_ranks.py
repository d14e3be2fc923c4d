"""Rank bodies of the multi-rank HF checkpoint tests (module level, so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def megatron_logits(chunks, tokens: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Full-vocabulary logits ``[B, L, vocab]`` on the last pipeline stage (None elsewhere):
    Megatron's forward-only schedule, vocab-parallel outputs gathered over TP, padding dropped."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    B, L = tokens.shape

    def step(data, model):
        t = next(data)
        out = model(t, torch.arange(L).expand_as(t), None)

        def collect(output, non_loss_data=True):
            return output

        return out, collect

    res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=chunks[0],
                                      num_microbatches=1, seq_length=L, micro_batch_size=B, forward_only=True,
                                      collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    out = res[0].contiguous()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out, group=group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def load_save_load(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case: ``megatron_model_from_hf`` at (tp, pp, ep, etp), logits; ``save_hf_checkpoint``
    into ``case["out"]``; load that folder into a fresh model: every parameter bitwise equal."""
    from megatron.core import parallel_state as ps

    from mcore_distill.hf import load_hf_checkpoint, megatron_model_from_hf, save_hf_checkpoint
    from mcore_distill.testing import seed_all

    from .models import VOCAB, use_torch_gdn

    use_torch_gdn()
    results = []
    for case in cases:
        ps.initialize_model_parallel(tensor_model_parallel_size=case.get("tp", 1),
                                     pipeline_model_parallel_size=case.get("pp", 1),
                                     virtual_pipeline_model_parallel_size=case.get("vpp"),
                                     expert_model_parallel_size=case.get("ep", 1),
                                     expert_tensor_parallel_size=case.get("etp"))
        seed_all(3)
        try:
            chunks = megatron_model_from_hf(case["path"])
            for c in chunks:
                c.eval()
            logits = None
            if case.get("vpp") is None:  # (interleaved chunks: checked through the saved folder instead)
                with torch.no_grad():
                    logits = megatron_logits(chunks, case["tokens"], VOCAB)
            bytes_read = load_hf_checkpoint(chunks, case["path"]).bytes_read  # again, for the count
            report = save_hf_checkpoint(chunks, case["out"], max_shard_bytes=case.get("max_shard_bytes", 5 << 30))
            again = megatron_model_from_hf(case["out"])
            first = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
            bitwise = len(again) == len(chunks) and all(
                torch.equal(first[(i, n)], p) for i, c in enumerate(again) for n, p in c.named_parameters())
            results.append({"id": case["id"], "logits": logits, "bitwise": bitwise, "files": report.files, "bytes_read": bytes_read,
                            "params": len(first), "vocab_rows": chunks[0].vocab_size})
        finally:
            ps.destroy_model_parallel()
    return results


def peer_failure(rank: int, world_size: int, good: str, bad: str) -> dict:
    """Data parallel (TP = PP = 1): rank 1 loads a checkpoint with a tensor missing, rank 0 a
    good one. Both must raise before writing anything: rank 1 its own error, rank 0
    :class:`PeerRankError`."""
    from megatron.core import parallel_state as ps

    from mcore_distill.hf import load_hf_checkpoint, megatron_model_from_hf

    ps.initialize_model_parallel()
    try:
        chunks = megatron_model_from_hf(good)
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.add_(1.0)  # differ from both checkpoints: a load would show
            before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
        try:
            load_hf_checkpoint(chunks, good if rank == 0 else bad)
            error = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            error = f"{type(err).__name__}: {err}"
        untouched = all(torch.equal(p, before[n]) for n, p in chunks[0].named_parameters())
        return {"error": error, "untouched": untouched}
    finally:
        ps.destroy_model_parallel()


def all_cases(rank: int, world_size: int, cases: list[dict], good: str, bad: str) -> tuple[list[dict], dict]:
    """Both bodies in one spawned run (spawning ranks is the expensive part)."""
    return load_save_load(rank, world_size, cases), peer_failure(rank, world_size, good, bad)
