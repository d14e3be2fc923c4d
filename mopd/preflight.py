"""Pre-flight checks before any GPU is allocated: the configuration resolves, teacher checkpoints
exist and are readable, models are compatible (fingerprints), the topology divides.

Fingerprint of an HF model folder: SHA-256 of its architecture, of the vocabulary file
(``tokenizer.json``, ``vocab.json`` or ``tokenizer.model``) and of the added tokens
(``tokenizer_config.json`` ``added_tokens_decoder`` and ``added_tokens.json``). The architecture
is read by the same reader that loads HF checkpoints into Megatron
(:func:`mcore_distill.hf.hf_arch`: transformers 4.x and 5.x spellings of one model fingerprint
alike); for a model it does not support, ``config.json`` without the keys that do not change the
computation (names, versions, dtype, caching, labels, initialisation) is hashed instead, and a
Megatron teacher whose weights are that HF folder is reported as a problem.

Rules (for teachers some route uses; unused ones are listed, never loaded): every teacher must
share the student's vocabulary and added tokens (its log-probs are read at the student's token
ids); Megatron-backend teachers share one resident model, so they must share one architecture
(the student may differ); a config ``vocab_size`` that differs from the student's is reported as
a problem too (full-vocabulary divergences need equal rows); a Megatron teacher's ``checkpoint``
must be a readable folder holding a ``dist_checkpointing`` checkpoint (``metadata.json``) or
teacher shards (``shard_*.pt``).

CLI: ``python -m mopd.preflight config.yaml [key=value ...] [--tp N] [--pp N] [--world-size N]
[--dry-run]`` prints resolved routes, teachers, checkpoints, fingerprints and topology; exit code
0 when everything is consistent, 1 on a problem, 2 on an invalid configuration (a key that is no
field is named with the valid keys). ``--dry-run`` only resolves the configuration and the
topology: no checkpoint, model folder or server is read (for a machine without them).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mcore_distill.hf import HFCheckpointError, hf_arch, read_hf_config
from mcore_distill.structured import to_dataclass
from mcore_distill.validate import check_type
from mopd.config import MOPDConfig
from mopd.errors import ConfigError, FingerprintMismatchError

__all__ = ["ModelFingerprint", "PreflightReport", "check_checkpoint", "fingerprint_hf", "load_config", "main",
           "run_preflight"]

NON_ARCHITECTURE_KEYS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "initializer_range",
    "_attn_implementation", "attn_implementation", "chunk_size_feed_forward", "tokenizer_class",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
})
VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Compatibility facts of one HF model folder."""

    path: str
    architecture: str
    vocab: str | None
    added_tokens: str
    vocab_size: int | None
    vocab_file: str | None
    unsupported: str | None = None
    """Why :func:`mcore_distill.hf.hf_arch` cannot load this model into Megatron (None: it can)."""

    def short(self) -> str:
        v = self.vocab[:12] if self.vocab else "none"
        return (f"arch={self.architecture[:12]} vocab={v} ({self.vocab_file}) added={self.added_tokens[:12]} "
                f"vocab_size={self.vocab_size}")


def fingerprint_hf(path: str | Path) -> ModelFingerprint:
    """Fingerprint an HF model folder (``config.json`` required)."""
    path = Path(path)
    try:
        cfg = read_hf_config(path)
    except HFCheckpointError as err:
        raise FingerprintMismatchError(str(err)) from None
    unsupported = None
    try:
        arch = {k: v for k, v in dataclasses.asdict(hf_arch(cfg)).items() if k != "dtype"}
    except HFCheckpointError as err:
        unsupported = str(err)
        arch = {k: v for k, v in cfg.items() if k not in NON_ARCHITECTURE_KEYS}
    vocab_file = next((n for n in VOCAB_FILES if (path / n).is_file()), None)
    vocab = _sha((path / vocab_file).read_bytes()) if vocab_file else None
    added: dict = {}
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        added["decoder"] = json.loads(tc.read_text()).get("added_tokens_decoder", {})
    at = path / "added_tokens.json"
    if at.is_file():
        added["file"] = json.loads(at.read_text())
    return ModelFingerprint(str(path), _sha(json.dumps(arch, sort_keys=True).encode()), vocab,
                            _sha(json.dumps(added, sort_keys=True).encode()), cfg.get("vocab_size"), vocab_file,
                            unsupported)


@dataclass
class PreflightReport:
    """Printable lines and the problems found (empty = compatible)."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise FingerprintMismatchError("pre-flight failed:\n  " + "\n  ".join(self.problems))

    def text(self) -> str:
        tail = ["OK"] if self.ok else ["PROBLEMS:"] + [f"  - {p}" for p in self.problems]
        return "\n".join(self.lines + tail)


def check_checkpoint(path: str | os.PathLike) -> str | None:
    """Why a Megatron teacher checkpoint folder cannot be loaded, or None when it can: it must be
    a directory we may list, holding ``metadata.json`` (``dist_checkpointing``), ``shard_*.pt``
    teacher shards or an HF checkpoint (``config.json`` + ``*.safetensors``), whose first file
    opens and reads."""
    p = Path(path)
    if not p.exists():
        return f"checkpoint {str(p)!r} does not exist"
    if not p.is_dir():
        return f"checkpoint {str(p)!r} is not a folder"
    if not os.access(p, os.R_OK | os.X_OK):
        return f"checkpoint {str(p)!r} is not readable (permissions)"
    if (p / "metadata.json").is_file():
        files = [p / "metadata.json"]
    elif (p / "config.json").is_file():
        files = sorted(p.glob("*.safetensors"))
    else:
        files = sorted(p.glob("shard_*.pt"))
    if not files:
        return (f"checkpoint {str(p)!r} holds no dist_checkpointing checkpoint (metadata.json), teacher "
                "shards (shard_*.pt) or HF checkpoint (config.json + *.safetensors)")
    try:
        with open(files[0], "rb") as f:
            f.read(1)
    except OSError as err:
        return f"checkpoint {str(p)!r}: cannot read {files[0].name}: {err}"
    return None


def run_preflight(config: MOPDConfig, *, tp: int = 1, pp: int = 1, world_size: int | None = None,
                  read_files: bool = True) -> PreflightReport:
    """Resolve routes and teachers, check checkpoints, fingerprint models, check topology; never
    raises on a mismatch (see :meth:`PreflightReport.raise_if_failed`). ``read_files=False``
    (``--dry-run``) skips everything that reads a checkpoint or model folder."""
    check_type("config", config, MOPDConfig)
    rep = PreflightReport()
    rep.lines.append(f"routing field: {config.routing.field!r} (strict={config.routing.strict}, "
                     f"default_route={config.routing.default_route!r})")
    for route, weights in sorted(config.routing.routes.items()):
        pos = {t: w for t, w in weights.items() if w > 0}
        total = sum(pos.values())
        parts = ", ".join(f"{t}: w={w:g} (ŵ={w / total:.3f})" for t, w in sorted(pos.items()))
        rep.lines.append(f"route {route!r} -> {parts}")
    used = set(config.routing.teacher_ids())
    for tid, spec in sorted(config.teachers.items()):
        where = spec.weights_path if spec.backend == "megatron" else spec.url
        status = "used" if tid in used else "unused (never loaded)"
        rep.lines.append(f"teacher {tid!r}: backend={spec.backend} source={where} hf_path={spec.hf_path} [{status}]")
        if read_files and spec.backend == "megatron" and tid in used:
            why = ("neither checkpoint nor hf_path is set" if not spec.weights_path
                   else check_checkpoint(spec.weights_path))
            if why:
                rep.problems.append(f"teacher {tid!r}: {why}")
    if read_files:
        _check_fingerprints(config, used, rep)
    else:
        rep.lines.append("dry run: no checkpoint or model folder was read")
    _check_topology(config, tp, pp, world_size, rep)
    return rep


def _check_fingerprints(config: MOPDConfig, used: set[str], rep: PreflightReport) -> None:
    """Student and teacher fingerprints; vocabulary, added tokens, vocab size, one Megatron architecture."""
    fps: dict[str, ModelFingerprint] = {}
    student = None
    if config.student_hf_path:
        try:
            student = fingerprint_hf(config.student_hf_path)
            rep.lines.append(f"student: {student.short()}")
        except FingerprintMismatchError as err:
            rep.problems.append(f"student: {err}")
    else:
        rep.problems.append("student_hf_path is not set: cannot check teacher vocabularies against the student")
    for tid, spec in sorted(config.teachers.items()):
        if spec.hf_path is None:
            rep.problems.append(f"teacher {tid!r}: hf_path is not set (needed for its fingerprint)")
            continue
        try:
            fps[tid] = fp = fingerprint_hf(spec.hf_path)
        except FingerprintMismatchError as err:
            rep.problems.append(f"teacher {tid!r}: {err}")
            continue
        rep.lines.append(f"teacher {tid!r} fingerprint: {fp.short()}")
        if spec.backend == "megatron" and not spec.checkpoint and fp.unsupported:
            rep.problems.append(f"teacher {tid!r}: its weights are the HF folder {spec.hf_path}, which cannot be "
                                f"loaded into Megatron: {fp.unsupported}")
        if student is None or tid not in used:
            continue
        if fp.vocab != student.vocab:
            rep.problems.append(f"teacher {tid!r}: vocabulary differs from the student's "
                                f"({fp.vocab_file} {str(fp.vocab)[:12]} vs {student.vocab_file} {str(student.vocab)[:12]})")
        if fp.added_tokens != student.added_tokens:
            rep.problems.append(f"teacher {tid!r}: added tokens differ from the student's")
        if fp.vocab_size != student.vocab_size:
            rep.problems.append(f"teacher {tid!r}: vocab_size {fp.vocab_size} != student vocab_size {student.vocab_size}")
    megatron = {t: fps[t] for t, s in config.teachers.items() if s.backend == "megatron" and t in fps and t in used}
    archs = {fp.architecture for fp in megatron.values()}
    if len(archs) > 1:
        groups = {a[:12]: sorted(t for t, fp in megatron.items() if fp.architecture == a) for a in archs}
        rep.problems.append(f"megatron teachers must share one architecture (one resident model): {groups}")


def _check_topology(config: MOPDConfig, tp: int, pp: int, world_size: int | None, rep: PreflightReport) -> None:
    if world_size is None:
        world_size = tp * pp
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        rep.problems.append(f"topology: world_size={world_size} is not divisible by tp*pp={tp * pp}")
        dp = None
    else:
        dp = world_size // (tp * pp)
    rep.lines.append(f"topology: world_size={world_size} tp={tp} pp={pp} dp={dp}; megatron teachers use the "
                     f"trainer's layout; rollout_temperature={config.rollout_temperature}")


def load_config(path: str | None, overrides: list[str]) -> MOPDConfig:
    """Compose ``MOPDConfig`` from a YAML file and ``key=value`` overrides (OmegaConf). A key that
    is no field raises :class:`ConfigError` naming it, the closest field and the valid keys."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(path) if path else OmegaConf.create({})
    if overrides:
        node = OmegaConf.merge(node, OmegaConf.from_dotlist(overrides))
    where = f"{path}{' + overrides' if overrides else ''}" if path else "overrides"
    return to_dataclass(node, MOPDConfig, error=ConfigError, where=where)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mopd.preflight", description="MOPD pre-flight checks")
    ap.add_argument("config", nargs="?", help="YAML file with MOPDConfig fields")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve the configuration and topology only; read no checkpoint, model folder or server")
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as err:
        print(f"invalid configuration: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - OmegaConf type errors name the key
        print(f"invalid configuration: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    report = run_preflight(config, tp=args.tp, pp=args.pp, world_size=args.world_size, read_files=not args.dry_run)
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
