"""HF checkpoints in and out of Megatron on CPU (one rank): exactness against ``transformers`` for
every supported architecture, load → save → load bitwise, the saved folder in ``transformers``
with strict loading, and every bad input failing with a typed error before a parameter is
written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_distill.errors import ConfigError, McoreDistillError
from mcore_distill.hf import (
    CheckpointFileError,
    CheckpointMismatchError,
    ConfigMismatchError,
    UnsupportedConfigError,
    VocabSizeError,
    load_hf_checkpoint,
    megatron_model_from_hf,
    save_hf_checkpoint,
)

from .models import KINDS, VOCAB, hf_logits, hf_model, load_transformers

TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB]


def _snapshot(chunks):
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def _untouched(chunks, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in chunks[0].named_parameters())


@pytest.fixture
def saved(tmp_path):
    """``saved(kind)``: folder of a random ``transformers`` model of ``kind`` and the model."""

    def make(kind: str, seed: int = 0):
        model = hf_model(kind, seed=seed)
        path = tmp_path / f"hf-{kind}-{seed}"
        model.save_pretrained(path)
        return path, model

    return make


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_roundtrip_is_bitwise(cpu_megatron, saved, tmp_path, kind):
    """fp32, ≤ 1e-5 (measured ≤ 2e-7: same math, different summation order; the hybrids' GDN
    recurrence is token by token in Megatron's CPU path, chunked in transformers')."""
    path, hf = saved(kind)
    chunks = megatron_model_from_hf(path)
    ref = hf_logits(hf, TOKENS)
    out = _logits(chunks[0].eval())
    err = (out - ref).abs().max().item()
    print(f"{kind}: max |megatron − transformers| = {err:.3e} (max |logit| {ref.abs().max().item():.3f})")
    assert ref.abs().max().item() > 0.1 and err <= 1e-5
    assert chunks[0].vocab_size == 128  # 50 padded to a multiple of 128 (TP = 1)
    emb = chunks[0].embedding.word_embeddings.weight
    assert torch.count_nonzero(emb[VOCAB:]) == 0  # padded rows load as zeros

    out_dir = tmp_path / "saved"
    report = save_hf_checkpoint(chunks, out_dir)
    assert (out_dir / "config.json").is_file() and (out_dir / "model.safetensors.index.json").is_file()
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert report.files == len(set(index["weight_map"].values())) and report.tensors == len(index["weight_map"])
    again = megatron_model_from_hf(out_dir)
    first = _snapshot(chunks)
    assert all(torch.equal(first[n], p) for n, p in again[0].named_parameters())  # load → save → load

    theirs, info = load_transformers(out_dir, kind)  # strict: nothing missing, unexpected or mismatched
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert (hf_logits(theirs, TOKENS) - ref).abs().max().item() <= 1e-5
    original = {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()}
    ours = {n: t for f in sorted(out_dir.glob("*.safetensors")) for n, t in load_file(f).items()}
    assert ours.keys() == original.keys()
    for n, t in ours.items():
        if kind in ("next", "next-moe", "qwen3.5") and "norm" in n and "linear_attn.norm" not in n:
            # zero-centred HF norms: w → γ = w + 1 → γ − 1 rounds w to the spacing of numbers near 1
            assert (t - original[n]).abs().max().item() <= 2 ** -23, n
        else:
            assert torch.equal(t, original[n]), n


def test_sharded_save_respects_max_shard_bytes_and_copies_tokenizer(cpu_megatron, saved, tmp_path):
    path, _ = saved("dense")
    chunks = megatron_model_from_hf(path)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (tok / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    report = save_hf_checkpoint(chunks, out, max_shard_bytes=16 << 10, tokenizer=tok, dtype=torch.bfloat16)
    files = sorted(out.glob("model-*.safetensors"))
    assert report.files == len(files) > 3
    assert all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    biggest = max(os.path.getsize(f) for f in files)
    assert biggest <= (16 << 10) + 8192 or len(load_file(max(files, key=os.path.getsize))) == 1
    assert (out / "tokenizer.json").read_text() == (tok / "tokenizer.json").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == VOCAB
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(f).values())
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".ready-" in p.name]


def test_failed_save_keeps_the_previous_folder(cpu_megatron, saved, tmp_path, monkeypatch):
    """A save that fails while writing (disk full) raises and leaves the previous checkpoint
    complete and no temporary folder behind."""
    import safetensors.torch

    path, _ = saved("dense")
    chunks = megatron_model_from_hf(path)
    out = tmp_path / "out"
    save_hf_checkpoint(chunks, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.mul_(2)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(McoreDistillError, match="No space left on device"):
        save_hf_checkpoint(chunks, out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-dense-0", "out"]


def test_config_of_a_model_built_without_hf(cpu_megatron, tmp_path):
    """A Megatron model built by hand (tiny Qwen3 GPT) is saved with a config derived from its
    TransformerConfig; transformers loads it strictly and gives the Megatron logits."""
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(2)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                                         num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
                                         num_moe_experts=4, moe_ffn_hidden_size=16)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    save_hf_checkpoint([model], tmp_path / "out", vocab_size=VOCAB)
    theirs, info = load_transformers(tmp_path / "out", "moe")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert theirs.config.model_type == "qwen3_moe" and theirs.config.vocab_size == VOCAB
    assert (hf_logits(theirs, TOKENS) - _logits(model)).abs().max().item() <= 1e-5
    with pytest.raises(ConfigMismatchError, match="model_type='qwen3_next' does not fit"):
        save_hf_checkpoint([model], tmp_path / "bad", model_type="qwen3_next")


# ----- bad input: typed errors, nothing written ---------------------------------------------------
def _rewrite(path, edit):
    """Apply ``edit(dict of tensors)`` to the (single) safetensors file of ``path``."""
    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture
def model_and_copy(cpu_megatron, saved, tmp_path):
    """A loaded dense model and a second, independent checkpoint folder to break."""
    path, _ = saved("dense")
    chunks = megatron_model_from_hf(path)
    bad_path, _ = saved("dense", seed=1)
    return chunks, bad_path


def _check_untouched(chunks, bad_path, exc, match, **kw):
    before = _snapshot(chunks)
    with pytest.raises(exc, match=match) as ei:
        load_hf_checkpoint(chunks, bad_path, **kw)
    assert _untouched(chunks, before)
    assert isinstance(ei.value, McoreDistillError)
    return ei.value


def test_missing_tensor_is_named_and_nothing_loads(model_and_copy):
    chunks, bad = model_and_copy
    _rewrite(bad, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    err = _check_untouched(chunks, bad, CheckpointMismatchError, r"1 missing: model\.layers\.2\.self_attn\.k_proj")
    assert err.missing == ["model.layers.2.self_attn.k_proj.weight (16, 32)"]
    # strict=False: that parameter (layer 2's linear_qkv) keeps its values, the rest loads
    before = _snapshot(chunks)
    rep = load_hf_checkpoint(chunks, bad, strict=False)
    assert rep.missing == err.missing
    after = dict(chunks[0].named_parameters())
    assert torch.equal(after["decoder.layers.2.self_attention.linear_qkv.weight"],
                       before["decoder.layers.2.self_attention.linear_qkv.weight"])
    assert not torch.equal(after["decoder.layers.0.self_attention.linear_qkv.weight"],
                           before["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_unexpected_tensor_is_named(model_and_copy):
    chunks, bad = model_and_copy
    _rewrite(bad, lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(3)}))
    _check_untouched(chunks, bad, CheckpointMismatchError, r"1 unexpected: model\.layers\.1\.mlp\.extra\.weight \(3,\)")
    assert load_hf_checkpoint(chunks, bad, strict=False).unexpected == ["model.layers.1.mlp.extra.weight (3,)"]


def test_shape_mismatch_is_named(model_and_copy):
    chunks, bad = model_and_copy
    _rewrite(bad, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)}))
    _check_untouched(chunks, bad, CheckpointMismatchError,
                     r"model\.layers\.0\.mlp\.up_proj\.weight: checkpoint \(40, 32\), expected \(48, 32\)", strict=False)


def test_truncated_safetensors_is_named(model_and_copy):
    chunks, bad = model_and_copy
    (f,) = bad.glob("*.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    err = _check_untouched(chunks, bad, CheckpointFileError, f"{f.name}.*truncated or corrupt")
    assert isinstance(err, OSError)


def test_index_naming_an_absent_file(model_and_copy):
    chunks, bad = model_and_copy
    (f,) = bad.glob("*.safetensors")
    names = list(load_file(f))
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: ("gone.safetensors" if i == 3 else f.name) for i, n in enumerate(names)}}))
    _check_untouched(chunks, bad, CheckpointFileError, "gone.safetensors: safetensors file not found")


@pytest.mark.parametrize("edit,exc,match", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, UnsupportedConfigError,
     r"model_type='llama'"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, UnsupportedConfigError, "architectures="),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                          "original_max_position_embeddings": 32}}, UnsupportedConfigError,
     r"rope_scaling\.rope_type='yarn'"),
    ({"hidden_act": "gelu"}, UnsupportedConfigError, r"hidden_act='gelu'"),
    ({"use_sliding_window": True}, UnsupportedConfigError, "use_sliding_window=True"),
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedConfigError, "quantization_config"),
    ({"mystery_field": 1}, UnsupportedConfigError, r"\['mystery_field'\]"),
    ({"num_hidden_layers": 3}, ConfigMismatchError, "num_layers: model=4, config.json=3"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, ConfigMismatchError, "rotary_base"),
    ({"vocab_size": 200}, VocabSizeError, "vocab_size=200 does not fit"),
])
def test_bad_config_is_named_and_nothing_loads(model_and_copy, edit, exc, match):
    chunks, bad = model_and_copy
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    err = _check_untouched(chunks, bad, exc, match)
    assert isinstance(err, ConfigError)


def test_vocab_that_does_not_fit_when_building(cpu_megatron, saved):
    from mcore_distill.hf import transformer_config_from_hf

    path, _ = saved("dense")
    with pytest.raises(VocabSizeError, match="padded_vocab_size=40 must be >= config.json vocab_size=50"):
        megatron_model_from_hf(path, padded_vocab_size=40)
    assert transformer_config_from_hf(path, padded_vocab_size=64).padded_vocab_size == 64
    assert megatron_model_from_hf(path, make_vocab_size_divisible_by=64)[0].vocab_size == 64


def test_file_bytes_read_are_the_parameters(cpu_megatron, saved, monkeypatch):
    """One rank reads every tensor once (TP = 1); at most the files of one parameter are open."""
    from mcore_distill.hf import safetensors_io

    path, hf = saved("dense")
    hf.save_pretrained(path, max_shard_size="20KB")  # several shard files
    assert len(list(path.glob("*.safetensors"))) > 3
    opened, peak = [], [0]
    real = safetensors_io.SliceReader.source

    def source(self, name):
        out = real(self, name)
        opened.append(self.index.tensors[name].file)
        peak[0] = max(peak[0], len(self._open))
        return out

    monkeypatch.setattr(safetensors_io.SliceReader, "source", source)
    chunks = megatron_model_from_hf(path)
    sizes = {n: t.numel() * t.element_size() for f in path.glob("*.safetensors") for n, t in load_file(f).items()}
    rep = load_hf_checkpoint(chunks, path)
    assert rep.bytes_read == sum(sizes.values())
    assert peak[0] <= 2
