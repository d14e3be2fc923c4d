"""Math answer extraction and exact-match rewards (regex fast path; plain loops in ``reference.py``).

Extraction order on a response:

1. the content of the last balanced ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed);
2. the rest of the line after the last ``####`` (GSM8K style), if non-empty;
3. the rest of the line after the last ``Answer:`` (DAPO-Math prompt style), if non-empty;
4. the last number in the text (``-`` sign, thousands commas, decimals, ``a/b``).

Normalisation makes numbers exact rationals (:class:`fractions.Fraction`): ``1,234`` = ``1234``,
``42.0`` = ``42``, ``3/4`` = ``0.75`` = ``\\frac{3}{4}``; ``$``, ``\\!``, ``\\left``/``\\right``
and a trailing ``.`` are dropped. Anything else compares as a string with whitespace removed.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "extract_boxed",
    "extract_answer",
    "normalize_answer",
    "answers_match",
    "math_reward",
    "math_rewards",
]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?", re.ASCII)
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
_COMMAS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\$")


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, else ``None``."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for j in range(start, len(text)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:j].strip()
    return None


def _after_marker(text: str, marker: str) -> str | None:
    i = text.rfind(marker)
    if i < 0:
        return None
    rest = text[i + len(marker) :].split("\n", 1)[0].strip()
    return rest or None


def extract_answer(text: str) -> str | None:
    """Final answer string of a response (see the module docstring for the order), else ``None``."""
    for found in (extract_boxed(text), _after_marker(text, "####"), _after_marker(text, "Answer:")):
        if found is not None:
            return found
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _number(s: str) -> Fraction | None:
    if _COMMAS.fullmatch(s):
        s = s.replace(",", "")
    return Fraction(s) if _PLAIN.fullmatch(s) else None


def _to_fraction(s: str) -> Fraction | None:
    value = _number(s)
    if value is not None:
        return value
    sign = -1 if s.startswith("-") else 1
    m = _FRAC.fullmatch(s[1:] if sign < 0 else s)
    if m:
        a, b = _number(m.group(1).strip()), _number(m.group(2).strip())
    elif s.count("/") == 1:
        sign, (num, den) = 1, s.split("/")
        a, b = _number(num.strip()), _number(den.strip())
    else:
        return None
    if a is None or b is None or b == 0:
        return None
    return sign * a / b


def normalize_answer(answer: str) -> Fraction | str:
    """Exact rational for numeric answers, else the answer with whitespace and ``$`` removed."""
    s = _DROP.sub("", answer).strip().rstrip(".").strip()
    value = _to_fraction(s)
    return value if value is not None else "".join(s.split())


def answers_match(predicted: str | None, ground_truth: str) -> bool:
    """Whether ``predicted`` equals ``ground_truth`` after :func:`normalize_answer` (same kind, same value)."""
    if predicted is None:
        return False
    p, g = normalize_answer(predicted), normalize_answer(ground_truth)
    return type(p) is type(g) and p == g


def math_reward(response: str, ground_truth: str | int | float) -> float:
    """1.0 when the answer extracted from ``response`` matches ``ground_truth`` exactly, else 0.0.

    A numeric ``ground_truth`` is formatted with ``str`` first (``42`` and ``42.0`` both match "42").
    """
    return 1.0 if answers_match(extract_answer(response), str(ground_truth)) else 0.0


def math_rewards(responses: list[str], ground_truths: list[str]) -> list[float]:
    """:func:`math_reward` over a batch; ``[N]`` responses, ``[N]`` ground truths -> ``[N]`` rewards."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"math_rewards: {len(responses)} responses but {len(ground_truths)} ground truths")
    return [math_reward(r, g) for r, g in zip(responses, ground_truths, strict=True)]
