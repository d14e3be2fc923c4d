"""HF checkpoints at TP=2, PP=2, EP=2 (and TP=2·EP=2 with ETP=1, PP=2 with two virtual stages) on
2 gloo ranks: the logits of ``megatron_model_from_hf`` equal the ``transformers`` forward (fp32,
≤ 1e-5), a collective
``save_hf_checkpoint`` (each rank reading only its slices, each stage / EP rank writing its own
files) loads back bit for bit, and ``transformers`` loads the saved folder strictly with the
same logits."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import run_ranks

from ._ranks import all_cases
from .models import hf_logits, hf_model, load_transformers

CASES = [
    {"id": "dense-tp2-small-shards", "kind": "dense", "tp": 2, "max_shard_bytes": 8192},
    {"id": "tied-tp2", "kind": "tied", "tp": 2},
    {"id": "tied-pp2", "kind": "tied", "pp": 2},
    {"id": "dense-pp2-vpp2", "kind": "dense", "pp": 2, "vpp": 2},
    {"id": "moe-tp2-etp2", "kind": "moe", "tp": 2},
    {"id": "moe-ep2", "kind": "moe", "ep": 2},
    {"id": "moe-tp2-ep2-etp1", "kind": "moe", "tp": 2, "ep": 2, "etp": 1},
    {"id": "next-tp2", "kind": "next", "tp": 2},
    {"id": "next-moe-ep2", "kind": "next-moe", "ep": 2},
    {"id": "next-moe-tp2", "kind": "next-moe", "tp": 2},
    {"id": "qwen3.5-pp2", "kind": "qwen3.5", "pp": 2},
]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_tp_pp_ep_logits_roundtrip_and_transformers_load(tmp_path):
    tokens = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(7))
    models, refs = {}, {}
    for case in CASES:
        kind = case["kind"]
        if kind not in models:
            models[kind] = hf_model(kind, seed=len(models))
            models[kind].save_pretrained(tmp_path / kind)
            refs[kind] = hf_logits(models[kind], tokens)
        case.update(path=str(tmp_path / kind), out=str(tmp_path / f"saved-{case['id']}"), tokens=tokens)
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    models["dense"].save_pretrained(bad)
    (f,) = bad.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    runs = run_ranks(all_cases, 2, CASES, str(tmp_path / "dense"), str(bad), timeout=580)
    by_rank, peer = [r[0] for r in runs], [r[1] for r in runs]
    # nothing loaded half-way across ranks: the rank with the good checkpoint refuses too
    assert peer[1]["error"].startswith("CheckpointMismatchError") and "model.layers.3.mlp.down_proj" in peer[1]["error"]
    assert peer[0]["error"].startswith("PeerRankError") and "rank 1 failed" in peer[0]["error"], peer
    assert peer[0]["untouched"] and peer[1]["untouched"]
    total = sum(t.numel() * t.element_size() for t in models["dense"].state_dict().values())
    for i, case in enumerate(CASES):
        got = [r[i] for r in by_rank]
        assert all(g["bitwise"] for g in got), case["id"]  # load → save → load: every parameter, every rank
        last = [g["logits"] for g in got if g["logits"] is not None]
        assert last or case.get("vpp"), case["id"]
        ref = refs[case["kind"]]
        assert ref.abs().max().item() > 0.1
        for lg in last:
            err = (lg - ref).abs().max().item()
            assert err <= 1e-5, f"{case['id']}: max |megatron − transformers| = {err:.3e}"
        saved, info = load_transformers(case["out"], case["kind"])
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
        err = (hf_logits(saved, tokens) - ref).abs().max().item()
        assert err <= 1e-5, f"{case['id']} saved folder in transformers: {err:.3e}"
        if case["id"] == "dense-tp2-small-shards":
            assert got[0]["files"] > 4 and got[0]["vocab_rows"] == 256  # 50 padded to 128·TP
            # each TP rank reads only its slices (plus the replicated norms; rank 0 holds all 50 vocab rows)
            assert all(g["bytes_read"] < 0.6 * total for g in got) and sum(g["bytes_read"] for g in got) >= total
