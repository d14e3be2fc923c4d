"""Plain-Python reference of ``rewards.py``: character loops, no regular expressions.

Written independently of the regex fast path; ``tests/demo/test_math_data.py`` compares the two.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["reference_extract_answer", "reference_normalize_answer", "reference_math_reward"]

_DIGITS = "0123456789"


def _last_boxed(text: str) -> str | None:
    best = None
    for key in ("\\boxed", "\\fbox"):
        start = 0
        while True:
            i = text.find(key, start)
            if i < 0:
                break
            start = i + 1
            j = i + len(key)
            while j < len(text) and text[j].isspace():
                j += 1
            if j >= len(text) or text[j] != "{":
                continue
            depth, k = 0, j
            while k < len(text):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            if depth == 0 and (best is None or i > best[0]):
                best = (i, text[j + 1 : k].strip())
    return None if best is None else best[1]


def _is_comma_int(s: str) -> bool:
    """``s`` is 1-3 digits followed by one or more ``,ddd`` groups."""
    head, *groups = s.split(",")
    return (
        bool(groups)
        and 1 <= len(head) <= 3
        and all(c in _DIGITS for c in head)
        and all(len(g) == 3 and all(c in _DIGITS for c in g) for g in groups)
    )


def _skip_digits(text: str, j: int) -> int:
    while j < len(text) and text[j] in _DIGITS:
        j += 1
    return j


def _read_number(text: str, i: int) -> int:
    """End index of the number starting at digit ``text[i]`` (same grammar as the fast path).

    Grammar: digits, or 1-3 digits plus ``,ddd`` groups (a group followed by a digit is not taken);
    then an optional ``.digits``; then an optional ``/digits`` with an optional ``.digits``.
    """
    n = len(text)
    j = _skip_digits(text, i)
    if j - i <= 3:
        while (
            j + 3 < n
            and text[j] == ","
            and all(text[j + t] in _DIGITS for t in (1, 2, 3))
            and not (j + 4 < n and text[j + 4] in _DIGITS)
        ):
            j += 4
    if j + 1 < n and text[j] == "." and text[j + 1] in _DIGITS:
        j = _skip_digits(text, j + 1)
    if j + 1 < n and text[j] == "/" and text[j + 1] in _DIGITS:
        j = _skip_digits(text, j + 1)
        if j + 1 < n and text[j] == "." and text[j + 1] in _DIGITS:
            j = _skip_digits(text, j + 1)
    return j


def _last_number(text: str) -> str | None:
    last, i = None, 0
    while i < len(text):
        if text[i] in _DIGITS:
            j = _read_number(text, i)
            start = i - 1 if i > 0 and text[i - 1] == "-" else i
            last, i = text[start:j], j
        else:
            i += 1
    return last


def _rest_of_line(text: str, marker: str) -> str | None:
    i = text.rfind(marker)
    if i < 0:
        return None
    line = text[i + len(marker) :]
    nl = line.find("\n")
    line = (line if nl < 0 else line[:nl]).strip()
    return line if line else None


def reference_extract_answer(text: str) -> str | None:
    """Reference of :func:`examples.data.rewards.extract_answer`."""
    for found in (_last_boxed(text), _rest_of_line(text, "####"), _rest_of_line(text, "Answer:")):
        if found is not None:
            return found
    return _last_number(text)


def _plain_number(s: str) -> Fraction | None:
    if _is_comma_int(s.lstrip("+-").split(".")[0]) and s.count(".") <= 1:
        head, _, tail = s.partition(".")
        if "." in s and not (tail and all(c in _DIGITS for c in tail)):
            return None
        s = head.replace(",", "") + ("." + tail if "." in s else "")
    body = s[1:] if s[:1] in ("+", "-") else s
    whole, dot, frac = body.partition(".")
    if not (whole or frac) or not all(c in _DIGITS for c in whole + frac):
        return None
    if not dot and not whole:
        return None
    value = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    return -value if s.startswith("-") else value


def reference_normalize_answer(answer: str) -> Fraction | str:
    """Reference of :func:`examples.data.rewards.normalize_answer`."""
    s = answer
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$"):
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    value = _plain_number(s)
    if value is not None:
        return value
    sign, body = (-1, s[1:]) if s.startswith("-") else (1, s)
    for head in ("\\frac{", "\\dfrac{", "\\tfrac{"):
        if body.startswith(head) and body.endswith("}"):
            inner = body[len(head) : -1]
            if (
                inner.count("}{") == 1
                and "{" not in inner.replace("}{", "")
                and "}" not in inner.replace("}{", "")
            ):
                num, den = inner.split("}{")
                a, b = _plain_number(num.strip()), _plain_number(den.strip())
                if a is not None and b is not None and b != 0:
                    return sign * a / b
            break
    if s.count("/") == 1:
        num, den = s.split("/")
        a, b = _plain_number(num.strip()), _plain_number(den.strip())
        if a is not None and b is not None and b != 0:
            return a / b
    return "".join(s.split())


def reference_math_reward(response: str, ground_truth: str | int | float) -> float:
    """Reference of :func:`examples.data.rewards.math_reward`."""
    predicted = reference_extract_answer(response)
    if predicted is None:
        return 0.0
    p, g = reference_normalize_answer(predicted), reference_normalize_answer(str(ground_truth))
    return 1.0 if type(p) is type(g) and p == g else 0.0
