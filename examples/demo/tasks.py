"""Two synthetic domains with exact checkers, over one 32-token vocabulary.

Row layout: ``BOS TASK x_1 .. x_L SEP y_1 .. y_L`` (prompt ``P = L + 3`` tokens, answer ``L``).
Letters are ids ``FIRST_LETTER ..`` (at most 24 of them, up to id 28); ids 29..31 are the agent
workload's observation tokens (:mod:`examples.demo.workload`).
``reverse``: y_i = x_{L+1-i}.  ``shift``: y_i = (x_i + s) mod A (a Caesar shift over A letters).
"""

from __future__ import annotations

import torch

PAD, BOS, SEP = 0, 1, 2
TASK_TOKEN = {"reverse": 3, "shift": 4}
FIRST_LETTER = 5
VOCAB = 32
OBS, RIGHT, WRONG = 29, 30, 31
"""Observation tokens of the agent workload: ``OBS f_1 .. f_L SEP``, f_i ∈ {RIGHT, WRONG}."""
DOMAINS = ("reverse", "shift")


def answer(task: str, x: torch.Tensor, *, letters: int, shift: int) -> torch.Tensor:
    """Correct answers ``[N, L]`` for letter ids ``x [N, L]`` (token ids)."""
    if task == "reverse":
        return x.flip(1)
    if task == "shift":
        return (x - FIRST_LETTER + shift) % letters + FIRST_LETTER
    raise KeyError(f"unknown task {task!r}; known: {DOMAINS}")


def prompts_from_letters(task: str, x: torch.Tensor) -> torch.Tensor:
    """Prompt rows ``[N, L + 3]``."""
    n = x.shape[0]
    return torch.cat([torch.full((n, 1), BOS), torch.full((n, 1), TASK_TOKEN[task]), x, torch.full((n, 1), SEP)], 1)


class TaskData:
    """Prompt sampler that never returns a held-out prompt; held-out sets are fixed by ``seed``."""

    def __init__(self, *, length: int, letters: int, shift: int, held_out: int, seed: int):
        self.length, self.letters, self.shift = length, letters, shift
        g = torch.Generator().manual_seed(10_007 * seed + 1)
        self.held_out = {t: self._letters(held_out, g) for t in DOMAINS}
        self._held = {t: {tuple(r) for r in self.held_out[t].tolist()} for t in DOMAINS}

    def _letters(self, n: int, g: torch.Generator) -> torch.Tensor:
        return torch.randint(FIRST_LETTER, FIRST_LETTER + self.letters, (n, self.length), generator=g)

    @property
    def prompt_len(self) -> int:
        return self.length + 3

    def sample(self, task: str, n: int, g: torch.Generator) -> torch.Tensor:
        """``n`` training letter rows ``[n, L]`` of ``task`` (held-out rows redrawn)."""
        x = self._letters(n, g)
        for i, row in enumerate(x.tolist()):
            while tuple(row) in self._held[task]:
                row = self._letters(1, g)[0].tolist()
                x[i] = torch.tensor(row)
        return x

    def answer(self, task: str, x: torch.Tensor) -> torch.Tensor:
        return answer(task, x, letters=self.letters, shift=self.shift)

    def full_rows(self, task: str, x: torch.Tensor) -> torch.Tensor:
        """Prompt + correct answer ``[N, 2L + 3]``."""
        return torch.cat([prompts_from_letters(task, x), self.answer(task, x)], 1)

    def correct(self, task: str, x: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """[N] bool: exact match of ``generated [N, L]`` with the answer."""
        return (generated == self.answer(task, x)).all(1)
