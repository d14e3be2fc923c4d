"""Math jsonl data loaders (GSM8K, DAPO-Math), prompt rendering and exact-match answer rewards."""

from examples.data.config import MathDataConfig, MathDataConfigError, MathDataError, MathDataRecordError
from examples.data.math_jsonl import MathRecord, gsm8k_ground_truth, load_math_jsonl
from examples.data.reference import (
    reference_extract_answer,
    reference_math_reward,
    reference_normalize_answer,
)
from examples.data.rewards import (
    answers_match,
    extract_answer,
    extract_boxed,
    math_reward,
    math_rewards,
    normalize_answer,
)
from examples.data.templates import has_chat_template, render_fallback, render_prompt

__all__ = [
    "MathDataConfig",
    "MathDataConfigError",
    "MathDataError",
    "MathDataRecordError",
    "MathRecord",
    "answers_match",
    "extract_answer",
    "extract_boxed",
    "gsm8k_ground_truth",
    "has_chat_template",
    "load_math_jsonl",
    "math_reward",
    "math_rewards",
    "normalize_answer",
    "reference_extract_answer",
    "reference_math_reward",
    "reference_normalize_answer",
    "render_fallback",
    "render_prompt",
]
