"""Multi-turn airline agent workload: token-exact sharing between sibling episodes (with a tokenizer
whose decode→encode is not the identity), harts compression against a brute-force trie count,
checker rewards, tools, and the label mask layout."""

from __future__ import annotations

import pytest
import torch

from examples.agent import (
    ScriptedPolicy,
    ToyTokenizer,
    Trajectory,
    agent_batch,
    check_task,
    make_tasks,
    rollout_group,
    run_tool,
)

TOK = ToyTokenizer()


def _agent_bodies(traj: Trajectory) -> list[list[int]]:
    return [traj.ids[a:b] for role, a, b in traj.turns if role == "agent"]


def test_tokenizer_decode_encode_is_not_identity_for_agent_turns():
    assert TOK.encode("booking") == [TOK.ids["booking"]]
    split = TOK.encode_split("call get_booking(B1)", split_words=True)
    assert TOK.decode(split) == "call get_booking(B1)" and TOK.encode(TOK.decode(split)) != split
    with pytest.raises(ValueError, match="'é' at 1"):
        TOK.encode("café"[2:] + "x")


def test_siblings_share_turns_token_exactly_and_history_is_never_reencoded():
    task = make_tasks(1, seed=3)[0]
    eps = rollout_group(task, ScriptedPolicy(p_error=0.5), TOK, n=12, seed=1)
    base = Trajectory()
    from examples.agent.rollout import SYSTEM_PROMPT

    base.add_text(TOK, "system", SYSTEM_PROMPT)
    base.add_text(TOK, "user", task.request)
    n_base = len(base.ids)
    texts = []
    for traj, _ in eps:
        assert traj.ids[:n_base] == base.ids  # the shared prompt, identical ids
        texts.append([TOK.decode(b) for b in _agent_bodies(traj)])
    pairs_checked = 0
    for i in range(len(eps)):
        for j in range(i + 1, len(eps)):
            a, b = eps[i][0], eps[j][0]
            # siblings that took the same first k agent actions hold identical ids through those turns
            k = 0
            while k < min(len(texts[i]), len(texts[j])) and texts[i][k] == texts[j][k]:
                k += 1
            ai = [t for t in a.turns if t[0] == "agent"]
            if k:
                end = ai[k - 1][2] + 1
                assert a.ids[:end] == b.ids[:end]
                pairs_checked += 1
    assert pairs_checked > 0
    # the stored agent ids are the policy's (non-canonical) ids: re-encoding the decoded history differs
    traj = eps[0][0]
    bodies = _agent_bodies(traj)
    assert all(TOK.encode(TOK.decode(x)) != x for x in bodies)
    retok = [TOK.encode(TOK.decode(x)) for x in bodies]
    assert sum(map(len, retok)) < sum(map(len, bodies))  # re-tokenizing would shift every later position


def _trie_size(seqs):
    return len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})


def test_forest_compression_equals_brute_force_trie():
    from harts import build_forest, sharing_stats

    b = agent_batch(make_tasks(6, seed=5), ScriptedPolicy(p_error=0.3), TOK, group_size=6, seed=2)
    forest = build_forest(b.seqs)
    T = _trie_size(b.seqs)
    total = sum(map(len, b.seqs))
    assert forest.num_real == T and forest.total_tokens == total
    st = sharing_stats(b.seqs)
    assert st.tree_tokens == T and st.compression == pytest.approx(total / T, rel=1e-12)
    assert st.compression > 2.0  # shared system prompt, request and common early turns
    # one root: every episode starts with the same system prompt, packed once for all of them
    roots = (forest.parent[:forest.num_real] < 0).nonzero()[:, 0]
    assert roots.tolist() == [0] and int(forest.multiplicity[0]) == len(b.seqs)
    from examples.agent.rollout import SYSTEM_PROMPT

    sys_len = len(TOK.encode(SYSTEM_PROMPT)) + 2
    assert bool((forest.multiplicity[:sys_len] == len(b.seqs)).all())


def test_rewards_from_the_checker():
    tasks = make_tasks(9, seed=7)
    good = agent_batch(tasks, ScriptedPolicy(p_error=0.0), TOK, group_size=2)
    bad = agent_batch(tasks, ScriptedPolicy(p_error=1.0), TOK, group_size=2)
    assert good.rewards == [1.0] * 18 and bad.rewards == [0.0] * 18
    mixed = agent_batch(tasks, ScriptedPolicy(p_error=0.3), TOK, group_size=8, seed=1)
    assert 0.0 < sum(mixed.rewards) / len(mixed.rewards) < 1.0
    change = next(t for t in tasks if t.kind == "change")
    db = change.db.copy()
    assert run_tool(db, "change_flight", [change.booking, change.target_flight()]).startswith("ok")
    assert check_task(change, db, []) == 1.0
    db2 = change.db.copy()
    other = next(f for f, v in db2.flights.items() if v[:3] == db2.flights[change.target_flight()][:3]
                 and f != change.target_flight())
    run_tool(db2, "change_flight", [change.booking, other])
    assert check_task(change, db2, []) == 0.0
    lookup = next(t for t in tasks if t.kind == "lookup")
    f = lookup.db.bookings[lookup.booking]["flight"]
    assert check_task(lookup, lookup.db.copy(), [f"your booking is on flight {f}"]) == 1.0
    assert check_task(lookup, lookup.db.copy(), [f"your booking is on flight {f}0"]) == 0.0


def test_tools_errors():
    db = make_tasks(1, seed=0)[0].db.copy()
    assert run_tool(db, "get_booking", ["B9"]) == "error: no booking B9"
    assert run_tool(db, "cancel_booking", ["B0"]).startswith("ok")
    assert run_tool(db, "cancel_booking", ["B0"]) == "error: B0 is cancelled"
    assert run_tool(db, "fly", ["B1"]) == "error: unknown call fly(B1)"
    f = db.bookings["B1"]["flight"]
    far = next(x for x, v in db.flights.items() if v[:2] != db.flights[f][:2])
    assert run_tool(db, "change_flight", ["B1", far]) == "error: route differs"
    with pytest.raises(ValueError, match="p_error=1.5"):
        ScriptedPolicy(p_error=1.5)


def test_label_mask_marks_exactly_the_policy_tokens():
    from harts import build_forest, sequence_logprobs

    b = agent_batch(make_tasks(2, seed=1), ScriptedPolicy(p_error=0.2), TOK, group_size=3)
    forest = build_forest(b.seqs)
    predicted = sequence_logprobs(forest.tokens.double(), forest).long()  # node value = its own token
    mask = b.label_mask()
    assert mask.shape == predicted.shape
    roles = [r for s, m in zip(b.seqs, b.loss_masks, strict=True) for r in m[1:]]
    assert torch.equal(mask, torch.tensor(roles))
    # every masked position predicts an agent body token or the end of an agent turn
    agent_ids = {t for s in b.seqs for t in s} - {TOK.role_ids[r] for r in TOK.role_ids}
    assert set(predicted[mask].tolist()) <= agent_ids
    assert TOK.eot_id in set(predicted[mask].tolist())


@pytest.mark.timeout(120)
def test_engine_policy_is_token_in_token_out():
    """Agent turns sampled by the embedded engine are stored as returned; their recorded log-probs
    equal a full forward over the stored ids at the same positions (no re-tokenization drift)."""
    from colocate import EngineConfig, HFModelSpec
    from colocate.engines import HFEngine, hf_checkpoint_views
    from examples.agent import EnginePolicy

    spec = HFModelSpec(arch="qwen3", num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       head_dim=8, ffn_hidden_size=48, vocab_size=TOK.vocab_size, rope_theta=10000.0)
    torch.manual_seed(0)
    engine = HFEngine(spec, EngineConfig(max_new_tokens=8, temperature=1.0))
    with torch.no_grad():
        for v in hf_checkpoint_views(engine.model).values():
            v.normal_(0, 0.3)
    task = make_tasks(1, seed=2)[0]
    eps = rollout_group(task, EnginePolicy(engine, max_turn_tokens=6), TOK, n=4, seed=5, max_agent_turns=3)
    n_base = None
    for traj, reward in eps:
        assert reward in (0.0, 1.0)
        agent_turns = [t for t in traj.turns if t[0] == "agent"]
        assert agent_turns and traj.logprobs
        n_base = n_base or agent_turns[0][1] - 1
        assert traj.ids[:n_base] == eps[0][0].ids[:n_base]  # shared prompt ids
        logits = engine.logits(torch.tensor([traj.ids]))[0]
        lp = torch.log_softmax(logits, -1)
        for pos, rec in traj.logprobs.items():
            assert traj.roles[pos] == "agent"
            assert abs(float(lp[pos - 1, traj.ids[pos]]) - rec) < 1e-4, (pos, rec)
    # different seeds per episode: the group branches after the shared prompt
    assert len({tuple(t.ids) for t, _ in eps}) > 1


def test_run_script_logs_sharing_per_step(capsys):
    from examples.agent.run import main

    rows = main(["--steps", "2", "--tasks", "3", "--group-size", "4", "--seed", "1"])
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episodes"] == 12 and r["compression"] == pytest.approx(r["total_tokens"] / r["tree_tokens"])
        assert 0.0 < r["sharing_ratio"] < 1.0
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and "ρ" in out.splitlines()[0]
