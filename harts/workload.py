"""Synthetic rollouts with controllable sharing, for tests and benchmarks.

* GRPO groups: ``n`` responses of length ``R`` after a shared prompt of length ``P``;
  ``C = n(P+R)/(P+nR)``, sharing ratio ``ρ = 1 − 1/C``.
* Caterpillar trees (multi-turn agents): a main trajectory of ``turns`` turns; after each turn
  ``branches`` side rollouts of ``branch_len`` tokens fork off, and the last turn ends the main path.
"""

from __future__ import annotations

import torch

__all__ = ["grpo_groups", "grpo_for_sharing", "caterpillar"]


def _rand(g: torch.Generator, n: int, vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def grpo_groups(num_groups: int, *, prompt_len: int, response_len: int, n: int, vocab_size: int = 32000,
                seed: int = 0, response_jitter: int = 0) -> list[list[int]]:
    """``num_groups · n`` sequences: random prompt (``prompt_len`` tokens) + random response.

    ``response_jitter`` draws each response length uniformly from
    ``[response_len − jitter, response_len + jitter]`` (at least 1).
    """
    for name, v, lo in (("num_groups", num_groups, 1), ("prompt_len", prompt_len, 0), ("response_len", response_len, 1),
                        ("n", n, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_groups):
        prompt = _rand(g, prompt_len, vocab_size)
        for _ in range(n):
            r = response_len
            if response_jitter:
                r = max(1, r + int(torch.randint(-response_jitter, response_jitter + 1, (1,), generator=g)))
            out.append(prompt + _rand(g, r, vocab_size))
    return out


def grpo_for_sharing(rho: float, *, num_groups: int, n: int, seq_len: int, vocab_size: int = 32000,
                     seed: int = 0) -> list[list[int]]:
    """GRPO groups of total length ``seq_len`` whose sharing ratio is ``rho`` (rounded).

    With ``P`` prompt tokens: ``ρ = (n − 1) P / (n L)``, so ``P = ρ n L / (n − 1)``.
    """
    if not 0 <= rho < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho}")
    if n < 2 and rho > 0:
        raise ValueError(f"rho={rho} > 0 needs n >= 2 responses per group, got n={n}")
    p = round(rho * n * seq_len / (n - 1)) if rho > 0 else 0
    if p > seq_len - 1:
        raise ValueError(f"rho={rho} is not reachable with n={n}, seq_len={seq_len} (max {(n - 1) * (seq_len - 1) / (n * seq_len):.3f})")
    return grpo_groups(num_groups, prompt_len=p, response_len=seq_len - p, n=n, vocab_size=vocab_size, seed=seed)


def caterpillar(num_trees: int, *, turns: int, turn_len: int, branches: int, branch_len: int,
                vocab_size: int = 32000, seed: int = 0) -> list[list[int]]:
    """Multi-turn agent trees: per tree, the main path of ``turns · turn_len`` tokens plus, after
    every turn, ``branches`` side sequences (main prefix + ``branch_len`` fresh tokens)."""
    if min(num_trees, turns, turn_len) < 1 or branches < 0 or branch_len < 1:
        raise ValueError(f"need num_trees, turns, turn_len, branch_len >= 1 and branches >= 0; got {num_trees}, "
                         f"{turns}, {turn_len}, {branch_len}, {branches}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_trees):
        main: list[int] = []
        for _ in range(turns):
            main = main + _rand(g, turn_len, vocab_size)
            for _ in range(branches):
                out.append(main + _rand(g, branch_len, vocab_size))
        out.append(main)
    return out
