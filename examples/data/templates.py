"""Prompt rendering: the tokenizer's chat template, or a configured fallback for base tokenizers."""

from __future__ import annotations

from typing import Any

__all__ = ["has_chat_template", "render_fallback", "render_prompt"]


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` carries a non-empty ``chat_template``."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_fallback(messages: list[dict[str, str]], *, template: str) -> str:
    """Render ``messages`` with a ``str.format`` template (fields ``{prompt}``, ``{system}``).

    ``prompt`` joins the user contents with blank lines; ``system`` is the system contents plus a
    blank line, or ``""``. Assistant turns are not representable and raise ``ValueError``.
    """
    system, user = [], []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system":
            system.append(m["content"])
        elif role == "user":
            user.append(m["content"])
        else:
            raise ValueError(
                f"fallback template renders system/user messages only; messages[{i}].role={role!r}"
            )
    sys_text = "\n\n".join(system) + "\n\n" if system else ""
    return template.format(prompt="\n\n".join(user), system=sys_text)


def render_prompt(
    messages: list[dict[str, str]],
    *,
    tokenizer: Any,
    fallback_template: str,
    add_generation_prompt: bool = True,
) -> str:
    """Prompt text for ``messages``: ``tokenizer.apply_chat_template`` when the tokenizer has a chat
    template, else :func:`render_fallback` with ``fallback_template``."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return render_fallback(messages, template=fallback_template)
