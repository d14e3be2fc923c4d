"""The mapping tables and layouts: the tables name exactly the tensors ``transformers`` writes,
every layout's TP shards (read from safetensors slices) merge back to the whole tensor, and
``to_hf`` inverts ``from_hf`` — for every rule of every architecture, at TP = 1, 2, 4."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_distill.hf import hf_arch
from mcore_distill.hf.errors import ConversionError
from mcore_distill.hf.layouts import VOCAB, Dims
from mcore_distill.hf.mapping import QWEN3, QWEN3_HYBRID, table_for
from mcore_distill.hf.safetensors_io import SliceReader, open_checkpoint

from .models import KINDS, hf_config, hf_model


@pytest.mark.parametrize("kind", KINDS)
def test_tables_name_every_tensor_transformers_writes(tmp_path, kind):
    hf_model(kind).save_pretrained(tmp_path)
    written = {n: tuple(t.shape) for f in tmp_path.glob("*.safetensors") for n, t in load_file(f).items()}
    d = Dims.of(hf_arch(tmp_path))
    assert table_for(d).expected(d) == written


def _dims(kind: str, **kw) -> Dims:
    """Sizes divisible by 4 so every layout can be split 1, 2 and 4 ways."""
    cfg = {**hf_config(kind).to_dict(), "num_key_value_heads": 4, "num_attention_heads": 8, "vocab_size": 50}
    if "linear_num_key_heads" in cfg:
        cfg.update(linear_num_key_heads=4, linear_num_value_heads=8)
    arch = hf_arch(cfg)
    return Dims.of(arch) if not kw else Dims(**{**Dims.of(arch).__dict__, **kw})


@pytest.mark.parametrize("kind,extra", [("dense", {}), ("tied", {}), ("moe", {}), ("next-moe", {}),
                                        ("qwen3.5", {}), ("next", {"zero_centered": True})],
                         ids=["dense", "tied", "moe", "next-moe", "qwen3.5", "next-zero-centred"])
def test_shards_from_slices_merge_back_and_to_hf_inverts(tmp_path, kind, extra):
    d = _dims(kind, **extra)
    table = table_for(d)
    g = torch.Generator().manual_seed(0)
    entries = list(table.entries(d))
    # values on a grid of 1/8: the ±1 norm shifts are exact, so every comparison is bitwise
    hf = {n: torch.randint(-16, 16, s, generator=g).float() / 8 for _, m in entries for n, s in zip(m.hf, m.shapes)}
    save_file(hf, tmp_path / "model.safetensors")
    reader = SliceReader(open_checkpoint(tmp_path))
    checked = 0
    for name, m in entries:
        srcs = [hf[n] for n in m.hf]
        full = m.layout.from_hf(srcs, d)
        for size in (1, 2, 4):
            if m.layout.tp == "replicated" and size > 1:
                continue
            rows = 128 // size if m.layout is VOCAB else None
            shards = [m.layout.from_hf([reader.source(n) for n in m.hf], d, rank=r, size=size, rows=rows)
                      for r in range(size)]
            again = [m.layout.from_hf(srcs, d, rank=r, size=size, rows=rows) for r in range(size)]
            assert all(torch.equal(a, b) for a, b in zip(shards, again)), (name, size)  # slices == tensors
            merged = m.layout.merge(shards, d)
            if rows is not None:  # padded vocabulary: zeros beyond the HF rows
                assert torch.count_nonzero(merged[d.V:]) == 0
                merged = merged[:d.V]
            assert torch.equal(merged, full), (name, size)
            checked += 1
        back = m.layout.to_hf(full, d, names=m.hf)
        assert all(torch.equal(b, s) for b, s in zip(back, srcs)), name
    reader.close()
    assert checked > 3 * len(entries) // 2


def test_vocab_rows_are_padded_per_rank():
    d = _dims("dense")
    emb = torch.arange(50 * 3, dtype=torch.float32).reshape(50, 3)
    r0, r1 = (VOCAB.from_hf([emb], d, rank=r, size=2, rows=64) for r in range(2))
    assert torch.equal(r0[:50], emb) and torch.count_nonzero(r0[50:]) == 0 and torch.count_nonzero(r1) == 0
    assert VOCAB.to_hf(torch.cat([r0, r1]), d)[0].shape == (50, 3)


def test_aliases_and_expert_names_resolve_to_one_tensor():
    d = _dims("moe")
    te = QWEN3.resolve("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", d)
    assert te.hf == ("model.layers.1.input_layernorm.weight",)
    grouped = QWEN3.resolve("decoder.layers.2.mlp.experts.linear_fc1.weight3", d)
    local = QWEN3.resolve("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight", d)
    assert grouped.hf == local.hf == ("model.layers.2.mlp.experts.3.gate_proj.weight",
                                      "model.layers.2.mlp.experts.3.up_proj.weight")
    assert local.expert == 3 and local.layer == 2
    tied = QWEN3.resolve("output_layer.weight", Dims(**{**d.__dict__, "tied": True}))
    assert tied.hf == ("model.embed_tokens.weight",) and not tied.save
    with pytest.raises(ConversionError, match="not used by this model's configuration"):
        QWEN3.resolve("decoder.layers.0.mlp.linear_fc1.weight", d)  # a dense MLP in an MoE model
    h = _dims("next-moe")
    with pytest.raises(ConversionError, match=r"a linear_attention parameter, but layer_types\[2\]"):
        QWEN3_HYBRID.resolve("decoder.layers.2.self_attention.in_proj.weight", h)
    with pytest.raises(ConversionError, match="expert 4 outside num_experts=4"):
        QWEN3_HYBRID.resolve("decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight", h)
