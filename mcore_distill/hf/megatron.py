"""Megatron-Core side: build a ``GPTModel`` from an HF folder, load and save HF checkpoints at
any TP / PP / EP / ETP layout.

Loading (:func:`load_hf_checkpoint`) runs in two phases on every rank:

1. *check*: ``config.json`` against the model, every shard header (a truncated file fails
   here), the checkpoint's tensor names and shapes against the mapping table for the whole
   model, and each local parameter's shard computed from ``meta`` tensors against its shape.
   The ranks then agree (one ``all_gather_object``): if any rank found a problem, every rank
   raises and **no parameter has been written**.
2. *read*: each rank reads only the rows/columns it holds through safetensors ``get_slice``,
   file by file (at most the files of one parameter open, so host memory stays bounded by one
   shard file plus one tensor), and copies them into its parameters. Padded vocabulary rows
   are zeros. An I/O error *during this phase* (a file deleted or a disk failing after the
   headers were read) leaves the parameters read so far written; the error says so.

Saving (:func:`save_hf_checkpoint`) is collective too: each TP (experts: ETP) group gathers its
shards to its first rank in data-parallel replica 0, which converts and writes them; pipeline
stages and expert-parallel ranks write their own files (no cross-stage traffic), each holding at
most one shard of host tensors. Rank 0 then names the files ``model-0000i-of-0000N``, writes
the index, ``config.json`` and tokenizer files, and publishes the folder atomically
(:func:`mcore_distill.atomic.publish_directory`): a reader sees the old folder or the complete
new one. The path must be on a file system every writing rank sees.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_distill.atomic import atomic_write_json, new_token, publish_directory, temp_directory_for
from mcore_distill.hf.config import (
    HFArch,
    arch_from_megatron,
    check_model_matches,
    hf_arch,
    hf_config_dict,
    read_hf_config,
    transformer_config_from_hf,
)
from mcore_distill.hf.errors import (
    CheckpointFileError,
    CheckpointMismatchError,
    ConversionError,
    HFCheckpointError,
    PeerRankError,
)
from mcore_distill.hf.layouts import Dims
from mcore_distill.hf.mapping import Match, Table, globalize_name, table_for
from mcore_distill.hf.safetensors_io import (
    INDEX_NAME,
    CheckpointIndex,
    ShardWriter,
    SliceReader,
    open_checkpoint,
)

__all__ = ["megatron_model_from_hf", "load_hf_checkpoint", "save_hf_checkpoint", "LoadReport", "SaveReport",
           "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
"""Files copied from a tokenizer folder (those present)."""

_SOURCE = "_mcore_distill_hf_source"
_IGNORED_PREFIXES = ("mtp.",)  # Qwen3-Next multi-token-prediction weights: not part of the causal LM
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry


@dataclass
class LoadReport:
    """What :func:`load_hf_checkpoint` did on this rank."""

    parameters: int
    """Megatron parameters written."""
    bytes_read: int
    """Bytes read from safetensors slices on this rank."""
    seconds: float
    missing: list[str] = field(default_factory=list)
    """HF tensors absent from the checkpoint (``strict=False``; their parameters are untouched)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors the model does not use (``strict=False``)."""


@dataclass
class SaveReport:
    """What :func:`save_hf_checkpoint` wrote (the same on every rank)."""

    path: str
    files: int
    bytes: int
    tensors: int
    seconds: float


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
    return [_unwrap(c) for c in chunks]


@dataclass
class _Groups:
    """The process groups a load or save needs (None: size 1)."""

    tp: Any
    etp: Any
    ep: Any
    dp: Any
    """Data parallel with context parallel: the replicas of the non-expert weights."""
    edp: Any
    """Expert data parallel: the replicas of the expert weights."""

    @classmethod
    def of(cls, pg_collection: Any | None) -> _Groups:
        if pg_collection is not None:
            def g(name: str) -> Any:
                return getattr(pg_collection, name, None)

            return cls(tp=g("tp"), etp=g("expt_tp"), ep=g("ep"), dp=g("dp_cp") or g("dp"), edp=g("expt_dp"))
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_group(), etp=ps.get_expert_tensor_parallel_group(False),
                   ep=ps.get_expert_model_parallel_group(False), dp=ps.get_data_parallel_group(with_context_parallel=True),
                   edp=ps.get_expert_data_parallel_group(check_initialized=False))


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


@dataclass
class _Item:
    """One local parameter and how it maps: its global name, match and TP (or ETP) shard."""

    name: str
    param: torch.Tensor
    match: Match
    expert: bool
    rank: int
    size: int
    lead: bool
    """This rank is the first of its TP (experts: ETP) group: it writes the tensor on save."""


def _plan(chunks: list[torch.nn.Module], table: Table, d: Dims, groups: _Groups) -> list[_Item]:
    """Resolve every local parameter (raises naming the unmapped or mis-sharded ones)."""
    ep_rank, ep_size = _rank(groups.ep), _size(groups.ep)
    items, bad = [], []
    for m in chunks:
        layers = m.decoder.layers if hasattr(m, "decoder") else []
        for name, p in m.named_parameters():
            lm = name.startswith("decoder.layers.")
            layer_id = layers[int(name.split(".")[2])].layer_number - 1 if lm else None
            expert = ".experts." in name and ".shared_experts." not in name
            offset = ep_rank * (d.E // ep_size) if expert and d.E else 0
            gname = globalize_name(name, layer_id=layer_id, expert_offset=offset)
            try:
                match = table.resolve(gname, d)
            except ConversionError as err:
                bad.append(str(err))
                continue
            sharded = bool(getattr(p, "tensor_model_parallel", False))
            group = groups.etp if expert else groups.tp
            want = {"replicated": None, "col": 0, "row": 1}[match.layout.tp]
            if sharded and _size(group) > 1 and getattr(p, "partition_dim", 0) != want:
                bad.append(f"{gname}: Megatron shards it on dim {getattr(p, 'partition_dim', None)}, the mapping "
                           f"table expects {match.layout.tp!r} ({match.layout!r})")
                continue
            items.append(_Item(gname, p, match, expert, _rank(group) if sharded else 0, _size(group) if sharded else 1,
                               _rank(group) == 0))
    if bad:
        raise ConversionError(f"{len(bad)} Megatron parameter(s) without a valid mapping: " + "; ".join(bad[:10]))
    return items


def _agree(error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed (collective over the default group); raise on
    all of them if so: this rank's own error, else :class:`PeerRankError` quoting the first."""
    msgs: list[str | None] = [None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        msgs = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(msgs) if m]
    if failed:
        r, m = failed[0]
        raise PeerRankError(f"{what}: rank {r} failed ({len(failed)} rank(s) in all): {m}")


def _ignored(name: str, d: Dims) -> bool:
    return (name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES)
            or (d.tied and name == "lm_head.weight"))


def _compare(index: CheckpointIndex, expected: dict[str, tuple[int, ...]], d: Dims
             ) -> tuple[list[str], list[str], list[str]]:
    have = index.tensors
    missing = [f"{n} {tuple(s)}" for n, s in expected.items() if n not in have]
    unexpected = sorted(f"{n} {have[n].shape}" for n in have if n not in expected and not _ignored(n, d))
    mismatched = [f"{n}: checkpoint {have[n].shape}, expected {tuple(s)}" for n, s in expected.items()
                  if n in have and tuple(have[n].shape) != tuple(s)]
    return missing, unexpected, mismatched


def _dims(arch: HFArch, model: torch.nn.Module) -> Dims:
    zc = bool(getattr(model.config, "layernorm_zero_centered_gamma", False))
    return Dims.of(dataclasses.replace(arch, megatron_zero_centered_gamma=zc))


@torch.no_grad()
def load_hf_checkpoint(model_chunks: torch.nn.Module | Sequence[torch.nn.Module], path: str | os.PathLike, *,
                       strict: bool = True, pg_collection: Any | None = None,
                       ignore_fields: tuple[str, ...] = ()) -> LoadReport:
    """Load the HF checkpoint in ``path`` into a Megatron model built by the caller (collective:
    every rank of the default process group calls it; see the module docstring for the phases).

    ``model_chunks``: this rank's ``GPTModel`` chunk(s) (wrappers such as DDP are unwrapped).
    ``strict``: every tensor the model needs must be in the checkpoint and nothing else (tied
    ``lm_head``, rotary ``inv_freq`` buffers and ``mtp.*`` are ignored), and RoPE, norm epsilon and
    router settings must match ``config.json``; with ``strict=False`` parameters whose tensors
    are missing are left as they are and reported. Shapes must always match. Raises
    :class:`~mcore_distill.hf.errors.HFCheckpointError` subclasses naming tensors and fields,
    before any parameter is written.
    """
    t0 = time.perf_counter()
    chunks, path = _chunks(model_chunks), Path(path)
    error: BaseException | None = None
    work: list[tuple[_Item, list[str]]] = []
    missing: list[str] = []
    unexpected: list[str] = []
    index = None
    try:
        arch = hf_arch(read_hf_config(path), ignore_fields=ignore_fields)
        for m in chunks:
            check_model_matches(m, arch, strict=strict)
        d = _dims(arch, chunks[0])
        table = table_for(d)
        index = open_checkpoint(path)
        missing, unexpected, mismatched = _compare(index, table.expected(d), d)
        if mismatched or (strict and (missing or unexpected)):
            raise CheckpointMismatchError(missing=missing if strict else [], unexpected=unexpected if strict else [],
                                          mismatched=mismatched, where=str(path))
        wrong = []
        for it in _plan(chunks, table, d, _Groups.of(pg_collection)):
            if any(n not in index.tensors for n in it.match.hf):
                continue  # strict=False: reported in `missing`
            local = it.match.layout.from_hf([index.meta(n) for n in it.match.hf], d, rank=it.rank, size=it.size,
                                            rows=it.param.shape[0] if it.param.dim() else None)
            if tuple(local.shape) != tuple(it.param.shape):
                wrong.append(f"{it.name} (from {', '.join(it.match.hf)}): shard {tuple(local.shape)}, "
                             f"parameter {tuple(it.param.shape)}")
            work.append((it, list(it.match.hf)))
        if wrong:
            raise CheckpointMismatchError(mismatched=wrong, where=str(path))
    except Exception as err:  # noqa: BLE001 - re-raised after the ranks agree
        error = err
    _agree(error, f"load_hf_checkpoint({path})")
    files = {n: index.tensors[n].file for it, names in work for n in names}
    work.sort(key=lambda w: min(files[n] for n in w[1]))
    reader = SliceReader(index)
    done = 0
    try:
        for i, (it, names) in enumerate(work):
            local = it.match.layout.from_hf([reader.source(n) for n in names], d, rank=it.rank, size=it.size,
                                            rows=it.param.shape[0] if it.param.dim() else None)
            it.param.copy_(local)
            done += 1
            nxt = work[i + 1][1] if i + 1 < len(work) else []
            reader.keep_only({files[n] for n in nxt})
    except Exception as err:
        raise CheckpointFileError(f"{path}: reading failed after {done} of {len(work)} parameters were written "
                                  f"(the model is partly loaded; load again): {type(err).__name__}: {err}") from err
    finally:
        reader.close()
    for m in chunks:
        setattr(m, _SOURCE, {"path": str(path), "config": read_hf_config(path)})
    return LoadReport(parameters=done, bytes_read=reader.bytes_read, seconds=time.perf_counter() - t0,
                      missing=[] if strict else missing, unexpected=[] if strict else unexpected)


def _local_layer_ids(config: Any, vp_stage: int | None) -> list[int]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))


def _default_spec(cfg: Any, vp_stage: int | None):
    arch, c = cfg.arch, cfg.config
    if arch.is_hybrid:
        from harts.gdn_megatron import hybrid_block_spec  # local-module GDN (CPU route included)

        pattern = cfg.layer_pattern
        return hybrid_block_spec("".join(pattern[i] for i in _local_layer_ids(c, vp_stage)),
                                 num_experts=arch.num_experts)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")


def megatron_model_from_hf(path: str | os.PathLike, *, layer_spec: Any = None, make_vocab_size_divisible_by: int = 128,
                           padded_vocab_size: int | None = None, ignore_fields: tuple[str, ...] = (),
                           load: bool = True, **overrides: Any) -> list[torch.nn.Module]:
    """Build this rank's ``GPTModel`` chunk(s) for the HF model in ``path`` and load its weights
    (collective, like :func:`load_hf_checkpoint`). The parallel layout is Megatron's
    ``parallel_state`` (TP, PP, EP, ETP; one chunk per virtual pipeline stage).

    ``layer_spec``: a ``ModuleSpec`` / ``TransformerBlockSubmodules``, or a callable
    ``(config, vp_stage) -> spec``; default: Megatron's local-module GPT spec (dense or MoE), or
    for Qwen3-Next/3.5 hybrids :func:`harts.gdn_megatron.hybrid_block_spec` (local Gated DeltaNet
    that also runs on CPU). ``overrides``: ``TransformerConfig`` fields
    (:func:`~mcore_distill.hf.config.transformer_config_from_hf`); parameters are not randomly
    initialised first (``perform_initialization=False``) since every one is loaded.
    ``load=False`` builds only, randomly initialised (``path`` then needs just ``config.json``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config_from_hf(path, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     padded_vocab_size=padded_vocab_size, ignore_fields=ignore_fields,
                                     **{"perform_initialization": not load, **overrides})
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else None
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        if layer_spec is None:
            spec = _default_spec(cfg, vp_stage)
        else:
            spec = layer_spec(cfg.config, vp_stage) if callable(layer_spec) else layer_spec
        chunks.append(GPTModel(config=cfg.config, transformer_layer_spec=spec, vp_stage=vp_stage,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                               **cfg.gpt_kwargs))
    if load:
        load_hf_checkpoint(chunks, path, ignore_fields=ignore_fields)
    return chunks


def _gather(t: torch.Tensor, group: Any, size: int, writer: bool) -> list[torch.Tensor]:
    """The shards of ``t`` over ``group`` on its first rank (rank order); [] elsewhere."""
    if size == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(size)] if writer else None
    dist.gather(t, out, dst=dist.get_global_rank(group, 0), group=group)
    return out or []


def _copy_tokenizer(tokenizer: Any, folder: Path) -> list[str]:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
        return sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES)
    src = Path(tokenizer)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not names:
        raise CheckpointFileError(f"tokenizer={str(src)!r}: none of {list(TOKENIZER_FILES)} found")
    for n in names:
        shutil.copyfile(src / n, folder / n)
    return names


def _source_config(chunks: list[torch.nn.Module], hf_config: Any, model_type: str | None,
                   vocab_size: int | None) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        raw = dict(hf_config)
    elif hf_config is not None:
        raw = read_hf_config(hf_config)
    elif getattr(chunks[0], _SOURCE, None) is not None:
        raw = dict(getattr(chunks[0], _SOURCE)["config"])
    else:
        return hf_config_dict(arch_from_megatron(chunks[0], model_type=model_type, vocab_size=vocab_size))
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
    return raw


@torch.no_grad()
def save_hf_checkpoint(model_chunks: torch.nn.Module | Sequence[torch.nn.Module], path: str | os.PathLike, *,
                       hf_config: Any = None, model_type: str | None = None, vocab_size: int | None = None,
                       tokenizer: Any = None, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
                       pg_collection: Any | None = None) -> SaveReport:
    """Write the model as an HF checkpoint folder at ``path`` (collective over the default group;
    see the module docstring).

    ``hf_config``: the ``config.json`` to write (a dict or an HF folder); default: the one the
    model was loaded from (:func:`load_hf_checkpoint`), else one derived from the Megatron config
    (``model_type`` picks the HF class for that case, ``vocab_size`` the HF vocabulary rows; the
    padded rows beyond it are dropped). ``tokenizer``: a folder whose tokenizer files are copied
    (or an object with ``save_pretrained``). ``dtype``: of the saved tensors (default: the
    parameters'). ``max_shard_bytes``: per safetensors file (a larger tensor gets its own file).
    """
    t0 = time.perf_counter()
    chunks, path = _chunks(model_chunks), Path(path)
    groups = _Groups.of(pg_collection)
    error: BaseException | None = None
    items: list[_Item] = []
    try:
        raw = _source_config(chunks, hf_config, model_type, vocab_size)
        arch = hf_arch(raw)
        for m in chunks:
            check_model_matches(m, arch, strict=False)
        d = _dims(arch, chunks[0])
        table = table_for(d)
        items = [it for it in _plan(chunks, table, d, groups) if it.match.save]
        out_dtype = dtype or next(chunks[0].parameters()).dtype
        raw.update(dtype=str(out_dtype).removeprefix("torch."), torch_dtype=str(out_dtype).removeprefix("torch."))
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    except Exception as err:  # noqa: BLE001 - re-raised after the ranks agree
        error = err
    _agree(error, f"save_hf_checkpoint({path})")
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    token = [new_token() if me == 0 else None]
    if world > 1:
        dist.broadcast_object_list(token, src=0)
    tmp = temp_directory_for(path, token[0])
    writer = ShardWriter(tmp, f"part-r{me:05d}", max_shard_bytes)
    write_error: str | None = None
    for it in items:
        replica0 = _rank(groups.edp if it.expert else groups.dp) == 0
        if not replica0:
            continue
        group = groups.etp if it.expert else groups.tp
        shards = _gather(it.param, group, it.size, it.lead)
        if not it.lead or write_error is not None:
            continue
        try:
            full = it.match.layout.merge(shards, d)
            for n, t in zip(it.match.hf, it.match.layout.to_hf(full, d, names=it.match.hf)):
                writer.add(n, t.to(device="cpu", dtype=it.match.layout.hf_dtype(d, out_dtype), copy=True).contiguous())
        except Exception as err:  # noqa: BLE001 - keep taking part in the gathers, report at the end
            write_error = f"{it.name}: {type(err).__name__}: {err}"
    if write_error is None:
        try:
            writer.flush()
        except Exception as err:  # noqa: BLE001
            write_error = f"writing {tmp}: {type(err).__name__}: {err}"
    reports: list[Any] = [(writer.files, write_error)]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, (writer.files, write_error))
    result: list[Any] = [None]
    if me == 0:
        try:
            result[0] = _finish(reports, tmp, path, raw, table.expected(d), tokenizer)
        except Exception as err:  # noqa: BLE001 - broadcast, then raised everywhere
            shutil.rmtree(tmp, ignore_errors=True)
            result[0] = err if isinstance(err, HFCheckpointError) else CheckpointFileError(
                f"save_hf_checkpoint({path}): {type(err).__name__}: {err}")
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], BaseException):
        raise result[0]
    files, nbytes, ntensors = result[0]
    return SaveReport(str(path), files, nbytes, ntensors, time.perf_counter() - t0)


def _finish(reports: list[Any], tmp: Path, path: Path, raw: dict, expected: dict[str, tuple[int, ...]],
            tokenizer: Any) -> tuple[int, int, int]:
    """Rank 0: check the written tensors, name the files, write index/config/tokenizer, publish."""
    failed = [(r, e) for r, (_, e) in enumerate(reports) if e]
    if failed:
        raise PeerRankError(f"save_hf_checkpoint({path}): rank {failed[0][0]} failed: {failed[0][1]}")
    files = [f for fs, _ in reports for f in fs]
    written: dict[str, str] = {}
    dup = []
    for fname, names, _ in files:
        for n in names:
            if n in written:
                dup.append(n)
            written[n] = fname
    missing = [n for n in expected if n not in written]
    extra = [n for n in written if n not in expected]
    if missing or extra or dup:
        raise CheckpointMismatchError(missing=missing, unexpected=extra + dup, where=f"save_hf_checkpoint({path})")
    renamed = {}
    for i, (fname, _, _) in enumerate(files):
        renamed[fname] = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp / fname, tmp / renamed[fname])
    total = sum(b for _, _, b in files)
    atomic_write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total},
                                         "weight_map": {n: renamed[f] for n, f in sorted(written.items())}})
    atomic_write_json(tmp / "config.json", raw)
    if tokenizer is not None:
        _copy_tokenizer(tokenizer, tmp)
    publish_directory(tmp, path)
    return len(files), total, len(written)
