"""Print the agent workload's trees per step: episodes, checker reward, harts sharing statistics.

    python -m examples.agent.run [--steps 5] [--tasks 8] [--group-size 8] [--p-error 0.2] [--seed 0]

No model: this shows the trees harts would pack. Training on them:
``python -m examples.train_gpu workload.kind=agent`` (see docs/demo.md).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> list[dict]:
    from examples.agent import ScriptedPolicy, ToyTokenizer, agent_batch, make_tasks
    from harts import sharing_stats

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=8, help="tasks per step")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per task")
    ap.add_argument("--p-error", type=float, default=0.2, help="scripted policy's mistake probability")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tok, policy = ToyTokenizer(), ScriptedPolicy(p_error=args.p_error)
    rows = []
    print(f"{'step':>4} {'episodes':>8} {'reward':>7} {'ΣL':>7} {'T':>6} {'C':>5} {'ρ':>5} {'forks':>5} {'depth':>5}")
    for step in range(args.steps):
        seed = args.seed * 7919 + step
        b = agent_batch(make_tasks(args.tasks, seed=seed), policy, tok, group_size=args.group_size, seed=seed)
        st = sharing_stats(b.seqs)
        row = {"step": step, "episodes": len(b.seqs), "reward": sum(b.rewards) / len(b.rewards), **st.as_dict()}
        rows.append(row)
        print(f"{step:>4} {row['episodes']:>8} {row['reward']:>7.2f} {st.total_tokens:>7} {st.tree_tokens:>6} "
              f"{st.compression:>5.2f} {st.sharing_ratio:>5.2f} {st.fork_edges:>5} {st.max_depth:>5}")
    return rows


if __name__ == "__main__":
    main()
