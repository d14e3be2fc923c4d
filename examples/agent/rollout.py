"""Token-in/token-out trajectories, a scripted agent policy, and group rollouts that share turns.

A :class:`Trajectory` is the token ids of one episode plus the role of every token. Turns are
appended as ids: environment text (system prompt, user, tool results) is encoded once, as that
turn alone; agent turns are the ids the policy emitted, stored as given. History is never decoded
and re-encoded, so an episode forked from another (:meth:`Trajectory.fork`) holds exactly the same
ids for the shared turns and harts packs them once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from examples.agent.env import CALL_RE, Task, check_task, run_tool, user_reply
from examples.agent.tokenizer import ToyTokenizer

__all__ = ["Trajectory", "ScriptedPolicy", "EnginePolicy", "rollout_group", "AgentBatch", "agent_batch",
           "SYSTEM_PROMPT"]

SYSTEM_PROMPT = ("you are an airline agent. tools: get_booking(B), search_flights(ORIG,DEST,dN), "
                 "change_flight(B,F), cancel_booking(B). one call or say per turn.")


@dataclass
class Trajectory:
    """``ids[t]`` and ``roles[t]`` per token; ``roles`` is ``template`` (role markers), ``system``,
    ``user``, ``tool`` or ``agent`` (the policy's tokens, end-of-turn included: the loss tokens)."""

    ids: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    turns: list[tuple[str, int, int]] = field(default_factory=list)
    """(role, start, end) of every turn's body in ``ids``."""
    logprobs: dict[int, float] = field(default_factory=dict)
    """Behaviour log-prob of each engine-sampled token, by position in ``ids`` (EnginePolicy only)."""

    def add_text(self, tok: ToyTokenizer, role: str, text: str) -> None:
        """Append an environment turn: role marker, ``encode(text)`` of this turn only, end of turn."""
        body = tok.encode(text)
        self._append(tok, role, body, [role] * (len(body) + 1))

    def add_agent(self, tok: ToyTokenizer, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append the policy's ids as emitted (no re-encoding), then end of turn. ``logprobs`` (one
        per id, optionally one more for a sampled end of turn) are recorded by position."""
        start = len(self.ids) + 1
        self._append(tok, "agent", list(ids), ["agent"] * (len(ids) + 1))
        for k, lp in enumerate(logprobs or []):
            self.logprobs[start + k] = lp

    def _append(self, tok, role, body, roles) -> None:
        start = len(self.ids) + 1
        self.ids += [tok.role_ids[role], *body, tok.eot_id]
        self.roles += ["template", *roles]
        self.turns.append((role, start, start + len(body)))

    def fork(self) -> Trajectory:
        """An independent continuation sharing this history (ids copied, never re-encoded)."""
        return Trajectory(list(self.ids), list(self.roles), list(self.turns), dict(self.logprobs))

    def loss_mask(self) -> list[bool]:
        """True at the policy's tokens."""
        return [r == "agent" for r in self.roles]


class ScriptedPolicy:
    """The correct next action of each task (read from the task's database, as an oracle would),
    replaced with probability ``p_error`` by a plausible mistake. Harmless mistakes (looking up the
    wrong booking, searching the wrong day) waste a turn; harmful ones (changing to the pricier
    flight, cancelling another booking, naming a wrong flight) make the checker return 0.

    ``split_words``: emit actions spelled out character by character (a segmentation the canonical
    encoder would never produce), so ``encode(decode(ids)) != ids`` for agent turns."""

    def __init__(self, *, p_error: float = 0.2, split_words: bool = True):
        if not 0.0 <= p_error <= 1.0:
            raise ValueError(f"p_error={p_error!r}: must be in [0, 1]")
        self.p_error, self.split_words = p_error, split_words

    def plan(self, task: Task) -> list[tuple[str, str]]:
        """(correct action, mistake) per stage."""
        b = task.booking
        bk = task.db.bookings[b]
        o, d, day, _ = task.db.flights[bk["flight"]]
        other = next(x for x in sorted(task.db.bookings) if x != b)
        look = (f"call get_booking({b})", f"call get_booking({other})")
        if task.kind == "change":
            target = task.target_flight()
            pricier = next(f for f, (fo, fd, fday, _) in sorted(task.db.flights.items())
                           if (fo, fd, fday) == (o, d, task.day) and f != target)
            wrong_day = next(x for x in (1, 2, 3) if x not in (task.day, day))
            return [look, (f"call search_flights({o},{d},d{task.day})", f"call search_flights({o},{d},d{wrong_day})"),
                    (f"call change_flight({b},{target})", f"call change_flight({b},{pricier})"),
                    ("say done, your flight is changed", "say done, your flight is changed")]
        if task.kind == "cancel":
            return [look, (f"say please confirm cancel of {b}", f"say please confirm cancel of {b}"),
                    (f"call cancel_booking({b})", f"call cancel_booking({other})"),
                    ("say done, refund is on the way", "say done, refund is on the way")]
        wrong = next(f for f in sorted(task.db.flights) if f != bk["flight"])
        return [look, (f"say your booking is on flight {bk['flight']}", f"say your booking is on flight {wrong}")]

    def emit(self, task: Task, stage: int, rng: random.Random, traj: Trajectory, tok: ToyTokenizer):
        """(ids, logprobs or None, advances) of the next agent turn."""
        text, advance = self.act(task, stage, rng)
        return tok.encode_split(text, split_words=self.split_words), None, advance

    def stages(self, task: Task) -> int:
        return len(self.plan(task))

    def act(self, task: Task, stage: int, rng: random.Random) -> tuple[str, bool]:
        """(action text, whether it advances the plan) at ``stage``."""
        good, bad = self.plan(task)[stage]
        if rng.random() >= self.p_error or good == bad:
            return good, True
        harmless = bad.startswith(("call get_booking", "call search_flights"))
        return bad, not harmless


class EnginePolicy:
    """Agent turns sampled from a rollout engine (``colocate.HFEngine`` or any object with its
    ``generate(prompts, max_new_tokens=, temperature=, seed=, eos_token_id=)``).

    Token in: the prompt is the trajectory's stored ids plus the agent role marker. Token out: the
    engine's ids are appended as returned, with their behaviour log-probs; nothing is decoded and
    re-encoded. A turn ends at the engine's end-of-turn token or after ``max_turn_tokens`` (then
    the end of turn is appended as a template token)."""

    def __init__(self, engine, *, max_turn_tokens: int = 32, temperature: float = 1.0):
        if max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens={max_turn_tokens!r}: must be >= 1")
        self.engine, self.max_turn_tokens, self.temperature = engine, max_turn_tokens, temperature

    def stages(self, task: Task) -> int:
        return 1 << 30  # episodes end by the user or by max_agent_turns

    def emit(self, task: Task, stage: int, rng: random.Random, traj: Trajectory, tok: ToyTokenizer):
        res = self.engine.generate([traj.ids + [tok.role_ids["agent"]]], max_new_tokens=self.max_turn_tokens,
                                   temperature=self.temperature, seed=rng.randrange(1 << 62), eos_token_id=tok.eot_id)
        ids, lps = list(res.tokens[0]), list(res.logprobs[0])
        if ids and ids[-1] == tok.eot_id:
            return ids[:-1], lps, False  # the sampled end of turn keeps its log-prob (position after the body)
        return ids, lps, False


def _episode(task: Task, policy: ScriptedPolicy | EnginePolicy, tok: ToyTokenizer, traj: Trajectory, rng: random.Random,
             max_agent_turns: int) -> tuple[Trajectory, float]:
    db, says, stage, plan_len = task.db.copy(), [], 0, policy.stages(task)
    for _ in range(max_agent_turns):
        if stage >= plan_len:
            break
        ids, logprobs, advance = policy.emit(task, stage, rng, traj, tok)
        traj.add_agent(tok, ids, logprobs)
        stage += advance
        heard = tok.decode(traj.ids[traj.turns[-1][1]:traj.turns[-1][2]])  # the env reads the emitted text
        m = CALL_RE.match(heard)
        if m:
            args = [a.strip() for a in m.group(2).split(",") if a.strip()]
            traj.add_text(tok, "tool", run_tool(db, m.group(1), args))
            continue
        says.append(heard)
        reply = user_reply(task, heard)
        if reply is None:
            break
        traj.add_text(tok, "user", reply)
    return traj, check_task(task, db, says)


def rollout_group(task: Task, policy: ScriptedPolicy | EnginePolicy, tok: ToyTokenizer, *, n: int, seed: int = 0,
                  max_agent_turns: int = 12) -> list[tuple[Trajectory, float]]:
    """``n`` episodes of ``task``, all forked from one trajectory holding the system prompt and the
    user's request; each returns (trajectory, checker reward)."""
    if n < 1:
        raise ValueError(f"n={n}: need at least one episode per task")
    base = Trajectory()
    base.add_text(tok, "system", SYSTEM_PROMPT)
    base.add_text(tok, "user", task.request)
    return [_episode(task, policy, tok, base.fork(), random.Random(f"{seed}/{task.id}/{k}"), max_agent_turns)
            for k in range(n)]


@dataclass
class AgentBatch:
    """One step of agent rollouts, in the order tasks × episodes."""

    seqs: list[list[int]]
    loss_masks: list[list[bool]]
    rewards: list[float]
    task_ids: list[str]

    def label_mask(self):
        """[Σ(L_i − 1)] bool in :func:`harts.sequence_logprobs` layout: positions t ≥ 1 that are
        policy tokens."""
        import torch

        return torch.tensor([m for mask in self.loss_masks for m in mask[1:]], dtype=torch.bool)


def agent_batch(tasks: list[Task], policy: ScriptedPolicy | EnginePolicy, tok: ToyTokenizer, *, group_size: int,
                seed: int = 0) -> AgentBatch:
    """Group rollouts of every task (``group_size`` episodes each)."""
    seqs, masks, rewards, ids = [], [], [], []
    for task in tasks:
        for traj, r in rollout_group(task, policy, tok, n=group_size, seed=seed):
            seqs.append(traj.ids)
            masks.append(traj.loss_mask())
            rewards.append(r)
            ids.append(task.id)
    return AgentBatch(seqs, masks, rewards, ids)
