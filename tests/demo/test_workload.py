"""The agent workload of the colocated runner (``workload.kind=agent``): episode rows and masks,
the tree packing of episodes against a per-sequence forward, and a 2-rank run of the runner."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from examples.demo.config import (
    DemoConfig,
    DemoConfigError,
    MOPDStageConfig,
    TeacherTrainConfig,
    WarmStartConfig,
    WorkloadSection,
)
from examples.demo.tasks import (
    BOS,
    FIRST_LETTER,
    OBS,
    RIGHT,
    SEP,
    TASK_TOKEN,
    WRONG,
    TaskData,
    prompts_from_letters,
)
from examples.demo.workload import answer_spans, corrupt, episode_len, run_episodes, supervised_episodes

L = 3


def _fake_episodes(turns: int = 2):
    """Two groups of two episodes over hand-picked answers; ``act`` returns them with log-probs
    -(turn + 1) - 0.01 · (row + col), so every position's value is known."""
    x = torch.tensor([[5, 6, 7], [8, 9, 10]])
    prompts = prompts_from_letters("reverse", x).repeat_interleave(2, 0)          # [4, 6]
    truth = x.flip(1).repeat_interleave(2, 0)
    said = [torch.tensor([[7, 6, 5], [7, 9, 5], [10, 9, 8], [8, 9, 10]]),         # turn 1: right, 1 wrong, right, 2 wrong
            torch.tensor([[7, 6, 5], [7, 6, 5], [10, 9, 8], [10, 9, 8]])]         # turn 2: all right
    seen = []

    def act(ctx, turn):
        seen.append(ctx.clone())
        lp = -(turn + 1) - 0.01 * (torch.arange(4)[:, None] + torch.arange(L)[None])
        return said[turn], lp.float()

    return prompts, truth, said, seen, run_episodes(prompts, truth, turns, act)


def test_agent_episode_tokens_observations_and_loss_mask_exactly():
    prompts, truth, said, seen, ep = _fake_episodes()
    P = prompts.shape[1]
    assert P == L + 3 and ep.ids.shape == (4, episode_len(P, L, 2)) == (4, P + 3 * L + 2)
    R, W = RIGHT, WRONG
    obs = [[R, R, R], [R, W, R], [R, R, R], [W, R, W]]
    for b in range(4):  # the row, token by token: prompt | turn 1 | OBS f SEP | turn 2
        want = prompts[b].tolist() + said[0][b].tolist() + [OBS, *obs[b], SEP] + said[1][b].tolist()
        assert ep.ids[b].tolist() == want
    assert ep.ids[0, :2].tolist() == [BOS, TASK_TOKEN["reverse"]]
    # the engine acted on the prompt, then on the whole episode so far (token in, token out)
    assert torch.equal(seen[0], prompts) and torch.equal(seen[1], ep.ids[:, :P + 2 * L + 2])
    assert answer_spans(P, L, 2) == [(P, P + L), (P + 2 * L + 2, P + 3 * L + 2)]
    # label layout: column t holds the label ids[:, t + 1]; the mask is exactly the answers' labels
    want_mask = torch.zeros_like(ep.mask)
    want_mask[:, P - 1:P - 1 + L] = True
    want_mask[:, P + 2 * L + 1:P + 3 * L + 1] = True
    assert torch.equal(ep.mask, want_mask) and ep.mask.sum() == 4 * 2 * L
    labels = ep.ids[:, 1:]
    assert set(labels[ep.mask[:, :-1]].tolist()) <= set(range(FIRST_LETTER, FIRST_LETTER + 16))
    obs_cols = torch.zeros_like(ep.mask)
    obs_cols[:, P + L - 1:P + 2 * L + 1] = True  # labels OBS f_1..f_L SEP
    assert set(labels[obs_cols[:, :-1]].tolist()) <= {OBS, RIGHT, WRONG, SEP} and not (ep.mask & obs_cols).any()
    # behaviour log-probs sit at exactly the answers' labels, 0 elsewhere
    assert torch.equal(ep.old[:, P - 1:P - 1 + L], -1 - 0.01 * (torch.arange(4)[:, None] + torch.arange(L)))
    assert torch.equal(ep.old[:, P + 2 * L + 1:P + 3 * L + 1], -2 - 0.01 * (torch.arange(4)[:, None] + torch.arange(L)))
    assert (ep.old[~ep.mask] == 0).all()
    assert [int(m.sum()) for m in ep.turn_masks] == [4 * L, 4 * L] and not (ep.turn_masks[0] & ep.turn_masks[1]).any()


def test_grpo_rows_are_one_turn_episodes_with_the_token_batch_mask():
    from mopd import TokenBatch

    prompts, truth, said, _, ep = _fake_episodes(turns=1)
    B, S = ep.ids.shape
    assert torch.equal(ep.ids, torch.cat([prompts, said[0]], 1))
    batch = TokenBatch(ep.ids, torch.full((B,), S), torch.full((B,), prompts.shape[1] - 1))
    assert torch.equal(ep.mask, batch.label_mask())


def test_observation_tokens_get_no_gradient():
    """∂loss/∂ℓθ of the MOPD loss on an agent batch is exactly 0 at every prompt and observation
    label and nonzero at every answer label."""
    from mopd import MOPDLossConfig, TokenTargets
    from mopd.objectives import mopd_pg_loss

    _, _, _, _, ep = _fake_episodes()
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(ep.ids.shape, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = -torch.rand(ep.ids.shape, generator=g, dtype=torch.float64)
    targets = TokenTargets(logp_sum=teacher, weight_sum=torch.ones_like(teacher))
    out = mopd_pg_loss(lp, ep.old.double(), targets, ep.mask, config=MOPDLossConfig(is_cap=5.0, adv_clip=3.0))
    out.loss.backward()
    assert (lp.grad[~ep.mask] == 0).all()
    assert (lp.grad[ep.mask] != 0).all()


def test_supervised_episodes_target_only_the_good_answers():
    g = torch.Generator().manual_seed(1)
    good = torch.randint(FIRST_LETTER, FIRST_LETTER + 16, (400, 4), generator=g)
    bad = corrupt(good, g, letters=16, p_wrong=0.5)
    wrong = (bad != good).any(1)
    assert 0.4 < wrong.float().mean() < 0.6 and ((bad >= FIRST_LETTER) & (bad < FIRST_LETTER + 16)).all()
    assert ((bad != good).sum(1)[wrong] >= 1).all() and (bad != good).sum(1).max() == 4

    data = TaskData(length=4, letters=16, shift=3, held_out=4, seed=0)
    x = data.sample("shift", 64, g)
    truth = data.answer("shift", x)
    rows, mask = supervised_episodes(prompts_from_letters("shift", x), truth, truth, 3, g, letters=16, p_wrong=0.5)
    P = data.prompt_len
    spans = answer_spans(P, 4, 3)
    assert rows.shape == (64, episode_len(P, 4, 3))
    assert torch.equal(rows[:, spans[-1][0]:], truth) and mask[:, spans[-1][0] - 1:spans[-1][1] - 1].all()
    for (a, b) in spans[:-1]:
        right = (rows[:, a:b] == truth).all(1)
        assert torch.equal(mask[:, a - 1:b - 1].all(1), right) and torch.equal(mask[:, a - 1:b - 1].any(1), right)
        assert 0 < right.sum() < 64
        f = rows[:, b + 1:b + 1 + 4]  # the observation the environment wrote after that turn
        assert torch.equal(f == RIGHT, rows[:, a:b] == truth) and (rows[:, b] == OBS).all() and (rows[:, b + 5] == SEP).all()
    assert int(mask.sum()) == int(sum(4 * (rows[:, a:b] == truth).all(1).sum() for a, b in spans[:-1])) + 64 * 4


def test_workload_config_is_validated():
    DemoConfig(workload=WorkloadSection(kind="agent")).validate()
    with pytest.raises(DemoConfigError, match=r"workload.kind='tree': one of grpo\|agent"):
        DemoConfig(workload=WorkloadSection(kind="tree")).validate()
    with pytest.raises(DemoConfigError, match="workload.turns=0"):
        DemoConfig(workload=WorkloadSection(kind="agent", turns=0)).validate()


# ----- tree packing of episodes vs a per-sequence forward (1 rank, the Megatron student) ----------
def _tree_rank(rank: int, world: int) -> dict:
    from examples.demo.student import student_logprobs
    from examples.demo.teachers import context_len, tiny_cfg
    from mcore_distill.testing import build_tiny_gpt, destroy_megatron, init_megatron

    torch.set_num_threads(1)
    init_megatron(seed=0)
    cfg = DemoConfig(length=4, workload=WorkloadSection(kind="agent", turns=2))
    data = TaskData(length=4, letters=16, shift=3, held_out=4, seed=0)
    model = build_tiny_gpt(tiny_cfg(cfg.student, max_len=context_len(data, cfg)))
    from harts.megatron import apply_harts

    apply_harts(model)
    g = torch.Generator().manual_seed(3)
    x = data.sample("reverse", 3, g)
    prompts = prompts_from_letters("reverse", x).repeat_interleave(4, 0)         # 3 groups of 4 episodes
    truth = data.answer("reverse", x).repeat_interleave(4, 0)
    pool = torch.randint(FIRST_LETTER, FIRST_LETTER + 16, (2, 12, 4), generator=g)

    def act(ctx, turn):  # two distinct answers per group on turn 1 (pairs share it), all distinct on turn 2
        y = pool[turn].clone()
        if turn == 0:
            y = y[torch.arange(12) // 2 * 2]
        return y, torch.zeros(y.shape)

    ep = run_episodes(prompts, truth, 2, act)
    model.eval()
    with torch.no_grad():
        tree, compression = student_logprobs(type("St", (), {"ddp": model})(), ep.ids, cfg)
        rows = []
        for b in range(ep.ids.shape[0]):  # each episode alone, plain forward
            ids = ep.ids[b:b + 1]
            logits = model(ids, torch.arange(ids.shape[1])[None], None).float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            rows.append(torch.nn.functional.pad(lp, (0, 1)))
        ref = torch.cat(rows)
    prefixes = {tuple(r[:t + 1]) for r in ep.ids.tolist() for t in range(ep.ids.shape[1])}
    destroy_megatron()
    return {"max_abs": float(((tree - ref) * ep.mask).abs().max()), "all_abs": float((tree - ref)[:, :-1].abs().max()),
            "compression": compression, "tokens": ep.ids.numel(), "distinct_prefixes": len(prefixes)}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_tree_packing_of_episodes_equals_per_sequence_logprobs():
    from mcore_distill.testing import run_ranks

    r = run_ranks(_tree_rank, 1, timeout=110)[0]
    assert r["all_abs"] < 2e-5 and r["max_abs"] < 2e-5  # fp32, float reduction order only
    # the tree holds each distinct prefix once: prompts per group, turn 1 per pair, turn 2 per episode
    assert r["compression"] == pytest.approx(r["tokens"] / r["distinct_prefixes"]) and r["compression"] > 1.5


# ----- a short 2-rank run of the runner with workload.kind=agent ------------------------------------
def _agent_rank(rank: int, world: int, out_dir: str) -> dict:
    from examples.demo.pipeline import run_demo
    from mcore_distill.testing import destroy_megatron

    torch.set_num_threads(1)
    cfg = DemoConfig(length=4, held_out=16, out_dir=out_dir, progress=False, checkpoint_every=2,
                     teacher=TeacherTrainConfig(steps=30, batch=16, min_accuracy=0.0, distill_prompts=32),
                     warm_start=WarmStartConfig(steps=3, batch=8),
                     mopd=MOPDStageConfig(steps=3, prompts_per_step=2, group_size=4, eval_every=1),
                     workload=WorkloadSection(kind="agent", turns=2))
    res = run_demo(cfg)
    destroy_megatron()
    cfg.resume = True  # from the step-2 checkpoint: step 3 again
    resumed = run_demo(cfg)
    destroy_megatron()
    out = {"history": res["history"], "colocated": res["colocated"], "evals": res["evals"], "accuracy": res["accuracy"],
           "resumed": {"from": resumed["resumed_from"], "history": resumed["history"], "evals": resumed["evals"]}}
    if rank == 0:
        from examples.demo.report import timeline_summary, write_outputs

        out["summary"] = timeline_summary(res, res["history"])
        out["png"] = write_outputs(res, res.pop("history"), res.pop("evals"), out_dir)["png"]
        out["steps_jsonl"] = [json.loads(x) for x in Path(out_dir, "steps.jsonl").read_text().splitlines()]
    return out


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_runner_agent_workload_two_ranks(tmp_path):
    from mcore_distill.testing import run_ranks

    out = run_ranks(_agent_rank, 2, str(tmp_path), timeout=190)
    timing = ("time/", "mem/", "tokens_per_s", "step_s", "publish_ms", "bytes/")
    for r in out:
        assert len(r["history"]) == 3 and r["colocated"]["greedy_match"] is True
        # resume from the step-2 checkpoint: the same episodes, metrics and evals (CPU: exactly)
        assert r["resumed"]["from"] == 2 and r["resumed"]["evals"] == r["evals"]
        assert [{k: v for k, v in h.items() if not k.startswith(timing)} for h in r["resumed"]["history"]] == \
            [{k: v for k, v in h.items() if not k.startswith(timing)} for h in r["history"]]
        for h in r["history"]:
            for key in ("reward/reverse", "reward/shift", "turn1/reward/reverse", "turn2/reward/reverse",
                        "turn1/reward/shift", "turn2/reward/shift", "gnorm", "tokens_per_s"):
                assert math.isfinite(h[key]), (key, h[key])
            for d in ("reverse", "shift"):
                for j in (1, 2):
                    assert 0.0 <= h[f"turn{j}/sample_accuracy/{d}"] <= 1.0
                assert h[f"sample_accuracy/{d}"] == h[f"turn2/sample_accuracy/{d}"]  # the episode's final answer
            assert h["sharing_ratio"] > 1.0 and h["sharing_ratio_turns"] > h["sharing_ratio"]
            assert h["engine_trainer_max_abs"] < 1e-4  # the engine's behaviour log-probs on every turn = trainer's
            assert all(h[f"time/{p}"] > 0 for p in ("generate", "teacher_scoring", "train", "optimizer", "publish"))
        for e in r["evals"]:  # held-out greedy episodes through the engine: turn 1 is the domain's accuracy
            assert all(0.0 <= e[f"turn{j}/{d}"] <= 1.0 for j in (1, 2) for d in ("reverse", "shift"))
            assert e["reverse"] == e["turn1/reverse"] and e["shift"] == e["turn1/shift"]
        assert r["accuracy"]["warm_start"]["turn2/reverse"] == r["evals"][0]["turn2/reverse"]
    rows = out[0]["steps_jsonl"]
    assert [x["step"] for x in rows] == [1, 2, 3] and "turn2/sample_accuracy/shift" in rows[0]
    assert rows[-1]["accuracy/turn2/shift"] == out[0]["evals"][-1]["turn2/shift"]  # steps.jsonl of the resumed run
    assert "agent episodes, sample accuracy" in out[0]["summary"] and Path(out[0]["png"]).stat().st_size > 10_000
