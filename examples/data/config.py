"""Configuration and typed errors for the math jsonl loaders."""

from __future__ import annotations

import string
from dataclasses import dataclass

from mcore_distill.errors import ConfigError, ConfigTypeError, McoreDistillError
from mcore_distill.validate import validate_fields

__all__ = ["MathDataConfig", "MathDataError", "MathDataConfigError", "MathDataRecordError"]

FORMATS = ("gsm8k", "dapo_math")


class MathDataError(McoreDistillError, ValueError):
    """Base class of every error raised by ``examples.data``."""


class MathDataConfigError(MathDataError, ConfigError):
    """A :class:`MathDataConfig` field holds an invalid value."""


class _MathDataConfigTypeError(MathDataConfigError, ConfigTypeError):
    """A config field holds a value of the wrong type."""


class MathDataRecordError(MathDataError):
    """A jsonl line is malformed or lacks a configured field (message names file, line and field)."""


def template_fields(template: str) -> set[str]:
    """Names of the ``str.format`` replacement fields in ``template``."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass(kw_only=True, slots=True)
class MathDataConfig:
    """One math jsonl source: where it is, how its fields map, how prompts are rendered.

    Defaults follow the public layouts: GSM8K ``{"question", "answer": "... #### 42"}`` and
    DAPO-Math (verl parquet layout exported to jsonl) ``{"prompt": [{"role", "content"}],
    "reward_model": {"ground_truth"}, "extra_info": {"index"}}``. Nested fields use dotted paths.
    """

    path: str
    """Path of the user-provided ``.jsonl`` file (one JSON object per line; blank lines skipped)."""

    format: str = "gsm8k"
    """One of ``gsm8k`` (question string + worked answer whose final value follows ``####``) or
    ``dapo_math`` (prompt as a chat-message list + a ground-truth answer string)."""

    task: str = "math"
    """Value written into each record's task field; MOPD routes teachers on it."""

    task_key: str = "task"
    """Name of the output record key holding ``task`` (the routing field name of the trainer)."""

    question_field: str = "question"
    """gsm8k: dotted path of the question string."""

    answer_field: str = "answer"
    """gsm8k: dotted path of the worked answer; the ground truth is the text after its last ``####``."""

    prompt_field: str = "prompt"
    """dapo_math: dotted path of the chat-message list (``[{"role": ..., "content": ...}, ...]``)."""

    ground_truth_field: str = "reward_model.ground_truth"
    """dapo_math: dotted path of the ground-truth answer (string or number)."""

    id_field: str | None = None
    """Dotted path of a source id (e.g. ``extra_info.index``). ``None``: the id is a content hash
    (format, messages, ground truth), stable under reordering and across runs."""

    system_prompt: str | None = None
    """Optional system message prepended to every prompt (gsm8k and dapo_math alike)."""

    instruction: str = ""
    """gsm8k: text appended to the question, e.g. a request to put the answer in ``\\boxed{}``."""

    fallback_template: str = "{system}{prompt}\nAnswer:"
    """``str.format`` template used when the tokenizer has no chat template (base models).
    Fields: ``{prompt}`` (user contents joined by blank lines, required) and ``{system}``
    (system contents followed by a blank line, or empty)."""

    add_generation_prompt: bool = True
    """Passed to ``apply_chat_template``: end the rendered prompt with the assistant header."""

    max_records: int | None = None
    """Keep only the first ``max_records`` records (``None``: all)."""

    def __post_init__(self) -> None:
        validate_fields(self, error=MathDataConfigError, type_error=_MathDataConfigTypeError)
        if not isinstance(self.path, str) or not self.path:
            raise MathDataConfigError(f"MathDataConfig.path must be a non-empty string, got {self.path!r}")
        if self.format not in FORMATS:
            raise MathDataConfigError(f"MathDataConfig.format must be one of {FORMATS}, got {self.format!r}")
        for name in (
            "task",
            "task_key",
            "question_field",
            "answer_field",
            "prompt_field",
            "ground_truth_field",
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise MathDataConfigError(f"MathDataConfig.{name} must be a non-empty string, got {value!r}")
        if self.id_field is not None and (not isinstance(self.id_field, str) or not self.id_field):
            raise MathDataConfigError(
                f"MathDataConfig.id_field must be None or a non-empty string, got {self.id_field!r}"
            )
        try:
            fields = template_fields(self.fallback_template)
        except ValueError as exc:
            raise MathDataConfigError(
                f"MathDataConfig.fallback_template is not a valid format string ({exc}): {self.fallback_template!r}"
            ) from None
        if "prompt" not in fields or not fields <= {"prompt", "system"}:
            raise MathDataConfigError(
                "MathDataConfig.fallback_template must use {prompt} and may use {system} only, "
                f"got fields {sorted(fields)} in {self.fallback_template!r}"
            )
        if self.max_records is not None and (
            isinstance(self.max_records, bool)
            or not isinstance(self.max_records, int)
            or self.max_records < 1
        ):
            raise MathDataConfigError(
                f"MathDataConfig.max_records must be None or an int >= 1, got {self.max_records!r}"
            )
