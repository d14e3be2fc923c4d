"""What one MOPD step's rows are (``workload.kind``): single-turn GRPO groups or multi-turn agent episodes.

``grpo``: n samples of one answer per prompt, ``BOS TASK x SEP y``.

``agent``: episodes of ``turns`` model turns over the same tasks. The model answers; the
environment (the task's exact checker) appends an observation ``OBS f_1..f_L SEP`` with
f_i = RIGHT if the answer's position i is correct, else WRONG; the model answers again in the whole
context. With turns = 2::

    BOS TASK x_1..x_L SEP | y¹_1..y¹_L | OBS f¹_1..f¹_L SEP | y²_1..y²_L
    └──── prompt P ─────┘   turn 1       observation (env)     turn 2

The episodes of a group share the prompt; each turn's context is the whole previous episode, so
harts packs turn t's context once under turn t−1's path (siblings whose earlier answers agree share
those too). Only the model's tokens (every turn's answer) are in the loss mask: observation tokens
are labels the environment wrote, they get neither gradient nor teacher signal.

Everything here is a pure tensor function; the runner passes :func:`run_episodes` an ``act``
callback that samples from the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from examples.demo.tasks import FIRST_LETTER, OBS, RIGHT, SEP, WRONG


def model_turns(cfg) -> int:
    """Model turns per row of a :class:`~examples.demo.config.DemoConfig`: 1 for GRPO, ``workload.turns`` for agent."""
    return cfg.workload.turns if cfg.workload.kind == "agent" else 1


def feedback(truth: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The environment's observation ``[N, L + 2]``: ``OBS f_1..f_L SEP``, f_i = RIGHT iff ``answer[:, i] == truth[:, i]``."""
    f = torch.where(answer == truth, RIGHT, WRONG)
    n = truth.shape[0]
    return torch.cat([torch.full((n, 1), OBS), f, torch.full((n, 1), SEP)], 1)


def answer_spans(prompt_len: int, length: int, turns: int) -> list[tuple[int, int]]:
    """Columns ``[a, b)`` of each turn's answer in an episode row (turns = 1: the GRPO row)."""
    return [(prompt_len + t * (2 * length + 2), prompt_len + t * (2 * length + 2) + length) for t in range(turns)]


def episode_len(prompt_len: int, length: int, turns: int) -> int:
    """Tokens of an episode: P + turns · L answers + (turns − 1) · (L + 2) observations."""
    return answer_spans(prompt_len, length, turns)[-1][1]


def turn_label_masks(batch: int, width: int, prompt_len: int, length: int, turns: int) -> list[torch.Tensor]:
    """``[B, S]`` bool label masks, one per turn, in the teachers' label layout (column t ↔ ids[:, t + 1]):
    True exactly at the labels of that turn's answer tokens."""
    out = []
    for a, b in answer_spans(prompt_len, length, turns):
        m = torch.zeros(batch, width, dtype=torch.bool)
        m[:, a - 1:b - 1] = True
        out.append(m)
    return out


@dataclass
class Episodes:
    """One step's rows on this rank (GRPO groups are episodes of one turn)."""

    ids: torch.Tensor             # [B, S] prompt, answers and observations
    answers: list[torch.Tensor]   # per turn [B, L] the model's tokens
    old: torch.Tensor             # [B, S] behaviour log-probs in the label layout (0 off the answers)
    turn_masks: list[torch.Tensor]  # per turn [B, S] bool label masks

    @property
    def mask(self) -> torch.Tensor:
        """The loss mask: every turn's answer labels (never a prompt or observation token)."""
        out = self.turn_masks[0].clone()
        for m in self.turn_masks[1:]:
            out |= m
        return out


def run_episodes(prompts: torch.Tensor, truth: torch.Tensor, turns: int,
                 act: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> Episodes:
    """Roll out ``turns`` model turns from ``prompts [B, P]``: ``act(context [B, s], turn)`` returns
    the turn's tokens and behaviour log-probs ``[B, L]``; between turns the environment appends
    :func:`feedback` against ``truth [B, L]`` (the correct answers)."""
    ctx, answers, logps = prompts, [], []
    for turn in range(turns):
        y, lp = act(ctx, turn)
        answers.append(y)
        logps.append(lp)
        ctx = torch.cat([ctx, y], 1)
        if turn < turns - 1:
            ctx = torch.cat([ctx, feedback(truth, y)], 1)
    B, S = ctx.shape
    P, L = prompts.shape[1], truth.shape[1]
    old = torch.zeros(B, S)
    for (a, b), lp in zip(answer_spans(P, L, turns), logps, strict=True):
        old[:, a - 1:b - 1] = lp
    return Episodes(ctx, answers, old, turn_label_masks(B, S, P, L, turns))


def corrupt(good: torch.Tensor, g: torch.Generator, *, letters: int, p_wrong: float) -> torch.Tensor:
    """``good [N, L]`` with, per row with probability ``p_wrong``, k ~ U{1..L} positions replaced by
    another letter (a plausible wrong answer)."""
    n, L = good.shape
    wrong_row = torch.rand(n, generator=g) < p_wrong
    k = torch.randint(1, L + 1, (n,), generator=g)
    pos = torch.rand(n, L, generator=g).argsort(1) < k[:, None]          # k distinct positions per row
    off = torch.randint(1, letters, (n, L), generator=g)                  # never the same letter
    bad = (good - FIRST_LETTER + off) % letters + FIRST_LETTER
    return torch.where(wrong_row[:, None] & pos, bad, good)


def supervised_episodes(prompts: torch.Tensor, truth: torch.Tensor, good: torch.Tensor, turns: int,
                        g: torch.Generator, *, letters: int, p_wrong: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Episodes to learn the agent format by cross entropy (teachers, warm start): every turn but
    the last answers ``good`` corrupted with probability ``p_wrong`` (:func:`corrupt`), the
    observations are the environment's, the last turn answers ``good``. Returns the rows ``[N, S]``
    and the ``[N, S]`` label mask of the answers that equal ``good`` (a corrupted turn is context,
    not a target)."""
    def act(ctx, turn):
        y = good if turn == turns - 1 else corrupt(good, g, letters=letters, p_wrong=p_wrong)
        return y, torch.zeros(y.shape)

    ep = run_episodes(prompts, truth, turns, act)
    mask = torch.zeros_like(ep.mask)
    for y, m in zip(ep.answers, ep.turn_masks, strict=True):
        mask |= m & (y == good).all(1, keepdim=True)
    return ep.ids, mask
