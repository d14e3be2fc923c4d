"""Loaders for GSM8K-format and DAPO-Math-format jsonl files.

Each line becomes a :class:`MathRecord`: chat messages, the ground-truth answer string, a stable
id, the routing task, and (given a tokenizer) the rendered prompt text and its token ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from examples.data.config import MathDataConfig, MathDataConfigError, MathDataRecordError
from examples.data.templates import render_prompt

__all__ = ["MathRecord", "load_math_jsonl", "gsm8k_ground_truth"]


@dataclass(kw_only=True, slots=True)
class MathRecord:
    """One math prompt with its answer key."""

    id: str
    """Stable id: the configured source id, or ``<format>-<16 hex of sha256(source messages, ground
    truth)>`` (before ``system_prompt``/``instruction`` are applied; identical rows share an id)."""

    task: str
    """Routing task (``MathDataConfig.task``)."""

    messages: list[dict[str, str]]
    """Chat messages of the prompt (``role``/``content``)."""

    ground_truth: str
    """Answer key compared by :func:`examples.data.rewards.math_reward`."""

    line: int
    """1-based line number in the source file."""

    prompt_text: str | None = None
    """Rendered prompt (chat template or fallback), when a tokenizer was given."""

    prompt_ids: list[int] | None = field(default=None)
    """Token ids of ``prompt_text`` (no extra special tokens added), when a tokenizer was given."""

    def as_dict(self, *, task_key: str = "task") -> dict[str, Any]:
        """Plain dict for trainers; the task is stored under ``task_key``."""
        return {
            "id": self.id,
            task_key: self.task,
            "messages": self.messages,
            "ground_truth": self.ground_truth,
            "prompt_text": self.prompt_text,
            "prompt_ids": self.prompt_ids,
        }


def gsm8k_ground_truth(answer: str) -> str | None:
    """Final value of a GSM8K worked answer: the text after its last ``####`` (commas kept)."""
    i = answer.rfind("####")
    if i < 0:
        return None
    value = answer[i + 4 :].strip()
    return value or None


_MISSING = object()


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def _record_error(config: MathDataConfig, line: int, msg: str) -> MathDataRecordError:
    return MathDataRecordError(f"{config.path}:{line}: {msg}")


def _messages(config: MathDataConfig, obj: dict, line: int) -> tuple[list[dict[str, str]], str]:
    if config.format == "gsm8k":
        q, a = _get(obj, config.question_field), _get(obj, config.answer_field)
        if not isinstance(q, str) or not q.strip():
            raise _record_error(
                config,
                line,
                f"field {config.question_field!r} missing or not a non-empty string (got {q if q is not _MISSING else 'nothing'!r})",
            )
        if not isinstance(a, str):
            raise _record_error(
                config,
                line,
                f"field {config.answer_field!r} missing or not a string (got {a if a is not _MISSING else 'nothing'!r})",
            )
        gt = gsm8k_ground_truth(a)
        if gt is None:
            raise _record_error(
                config, line, f"field {config.answer_field!r} has no '#### <answer>' suffix: {a[-80:]!r}"
            )
        messages = [{"role": "user", "content": q.strip()}]
    else:
        p, gt = _get(obj, config.prompt_field), _get(obj, config.ground_truth_field)
        if not isinstance(p, list) or not p:
            raise _record_error(
                config,
                line,
                f"field {config.prompt_field!r} missing or not a non-empty message list (got {p if p is not _MISSING else 'nothing'!r})",
            )
        messages = []
        for i, m in enumerate(p):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise _record_error(
                    config,
                    line,
                    f"field {config.prompt_field!r}[{i}] is not a {{'role': str, 'content': str}} message: {m!r}",
                )
            messages.append({"role": m["role"], "content": m["content"]})
        if (
            isinstance(gt, bool)
            or not isinstance(gt, str | int | float)
            or (isinstance(gt, str) and not gt.strip())
        ):
            raise _record_error(
                config,
                line,
                f"field {config.ground_truth_field!r} missing or not a non-empty string/number (got {gt if gt is not _MISSING else 'nothing'!r})",
            )
        gt = str(gt).strip()
    return messages, gt


def _record_id(config: MathDataConfig, obj: dict, line: int, messages: list, gt: str) -> str:
    if config.id_field is not None:
        v = _get(obj, config.id_field)
        if v is _MISSING or v is None or isinstance(v, dict | list):
            raise _record_error(
                config,
                line,
                f"id field {config.id_field!r} missing or not a scalar (got {v if v is not _MISSING else 'nothing'!r})",
            )
        return str(v)
    payload = json.dumps([config.format, messages, gt], sort_keys=True, ensure_ascii=False)
    return f"{config.format}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def load_math_jsonl(config: MathDataConfig, *, tokenizer: Any = None) -> list[MathRecord]:
    """Read ``config.path`` into :class:`MathRecord` rows (file order).

    With ``tokenizer`` (a ``transformers`` tokenizer), prompts are rendered by its chat template when
    it has one, else by ``config.fallback_template``, and tokenized without extra special tokens.
    Raises ``FileNotFoundError`` naming ``MathDataConfig.path``, ``MathDataRecordError`` naming
    ``<path>:<line>`` and the field, ``MathDataConfigError`` on duplicate configured ids.
    """
    if not os.path.isfile(config.path):
        raise FileNotFoundError(f"MathDataConfig.path={config.path!r} is not an existing file")
    records: list[MathRecord] = []
    seen: dict[str, int] = {}
    with open(config.path, encoding="utf-8-sig") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _record_error(
                    config, line_no, f"malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise _record_error(config, line_no, f"expected a JSON object, got {type(obj).__name__}")
            messages, gt = _messages(config, obj, line_no)
            rid = _record_id(config, obj, line_no, messages, gt)
            if config.format == "gsm8k" and config.instruction:
                messages[-1]["content"] += config.instruction
            if config.system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": config.system_prompt})
            if config.id_field is not None and rid in seen:
                raise MathDataConfigError(
                    f"MathDataConfig.id_field={config.id_field!r}: id {rid!r} repeats at {config.path}:{seen[rid]} and :{line_no}"
                )
            seen.setdefault(rid, line_no)
            rec = MathRecord(id=rid, task=config.task, messages=messages, ground_truth=gt, line=line_no)
            if tokenizer is not None:
                rec.prompt_text = render_prompt(
                    messages,
                    tokenizer=tokenizer,
                    fallback_template=config.fallback_template,
                    add_generation_prompt=config.add_generation_prompt,
                )
                rec.prompt_ids = list(tokenizer.encode(rec.prompt_text, add_special_tokens=False))
            records.append(rec)
            if config.max_records is not None and len(records) >= config.max_records:
                break
    return records
