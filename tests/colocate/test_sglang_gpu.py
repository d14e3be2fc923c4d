"""GPU lane, real SGLang (0.5.17 via ``.sgl/scripts/go.sh``): publish Megatron weights into an
in-process ``sglang.Engine`` (TP=1; TP=2 with Megatron TP=2 on a two-GPU machine) through the CUDA IPC bucket path, verify with the engine's
checksum against a disk load of the same weights and with logprobs against a reference HF model,
and run the full residency cycle with CUDA graphs on. Dense and MoE tiny Qwen3.

Run: ``bash .sgl/scripts/go.sh -m pytest -m sglang -x -q tests/colocate/test_sglang_gpu.py``
(≈3–5 min on a fresh H200: two engine starts).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from colocate import PublishConfig
from colocate.engines import build_hf_model, hf_checkpoint_views
from colocate.publish import Publisher

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [3, 100, 200, 300]]


def _save_checkpoint(spec, weights: dict | None, path: str, seed: int) -> None:
    """An HF folder (config.json + safetensors, bf16) with ``weights`` or random ones."""
    torch.manual_seed(seed)
    model = build_hf_model(spec, dtype=torch.bfloat16, device="cuda")
    if weights is not None:
        views = hf_checkpoint_views(model)
        with torch.no_grad():
            for n, t in weights.items():
                views[n].copy_(t)
    model.save_pretrained(path, safe_serialization=True)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(cfg_path, "w"), indent=1)


def _reference_prompt_logprobs(spec, weights, prompt) -> torch.Tensor:
    ref = build_hf_model(spec, dtype=torch.float32, device="cuda")
    views = hf_checkpoint_views(ref)
    with torch.no_grad():
        for n, t in weights.items():
            views[n].copy_(t.float())
        logits = ref(input_ids=torch.tensor([prompt], device="cuda")).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0].cpu()


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (Megatron TP=2 and SGLang tp_size=2)")


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [
    {"id": "dense"},
    {"id": "moe", "experts": 4, "tied": True},
    pytest.param({"id": "dense-tp2", "tp": 2}, marks=TWO_GPUS),
], ids=lambda c: c["id"])
def test_publish_megatron_into_sglang_with_residency_cycle(case, tmp_path):
    os.environ["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from colocate.sglang_engine import SGLangEngine, sglang_checksum
    from mcore_distill.testing import run_ranks

    from ._ranks import megatron_hf_weights

    tp = case.get("tp", 1)
    got = run_ranks(megatron_hf_weights, tp, case, backend="nccl", timeout=240)[0]
    spec = got["spec"]
    weights = {n: t.to(torch.bfloat16) for n, t in got["weights"].items()}
    init_dir, same_dir = str(tmp_path / "init"), str(tmp_path / "same")
    _save_checkpoint(spec, None, init_dir, seed=123)  # SGLang starts from other (random) weights
    _save_checkpoint(spec, weights, same_dir, seed=0)

    eng = SGLangEngine.launch(
        spec=spec, model_path=init_dir, skip_tokenizer_init=True, attention_backend="triton",
        sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.3, max_total_tokens=65536,
        dtype="bfloat16", random_seed=0, log_level="error", enable_memory_saver=True, disable_cuda_graph=False,
        tp_size=tp,
        cuda_graph_bs_decode=[1, 2, 4], disable_prefill_cuda_graph=True)
    try:
        c0 = sglang_checksum(eng.engine)
        pub = Publisher(eng, PublishConfig(transport="auto", bucket_bytes=4 << 20))
        assert pub.transport == "cuda_ipc"
        stream = ((n, t.cuda()) for n, t in weights.items())
        rep = pub.publish(stream, version=1, meta={n: (tuple(t.shape), t.dtype) for n, t in weights.items()})
        assert rep.verify == "version-only" and eng.weight_version() == 1
        c1 = eng.last_checksum
        assert c1 != c0
        # independent path: SGLang's own disk loader on the same weights gives the same checksum
        eng.restore_from_disk(same_dir, version=1)
        assert sglang_checksum(eng.engine) == c1

        ref = _reference_prompt_logprobs(spec, weights, PROMPTS[0])
        got_lp = torch.tensor(eng.prompt_logprobs(PROMPTS[0]))
        diff = (got_lp - ref).abs()
        assert diff.max().item() <= 0.1 and diff.mean().item() <= 0.02, (got_lp, ref)  # bf16 engine vs fp32 ref

        g1 = [o["output_ids"] for o in eng.generate(PROMPTS, max_new_tokens=8)]
        freed = eng.release_memory(["kv_cache", "weights", "cuda_graph"])
        assert freed["kv_cache"] > 0 and freed["weights"] > 0, freed
        assert eng.release_memory() == {}  # idempotent
        eng.resume_memory(["weights"])
        stream = ((n, t.cuda()) for n, t in weights.items())
        pub.publish(stream, version=2, meta={n: (tuple(t.shape), t.dtype) for n, t in weights.items()})
        eng.resume_memory(["cuda_graph", "kv_cache"])
        assert eng.last_checksum == c1
        assert [o["output_ids"] for o in eng.generate(PROMPTS, max_new_tokens=8)] == g1
        assert eng.resume_memory() == {}
    finally:
        eng.shutdown()
