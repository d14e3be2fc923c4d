"""Multi-turn tool-use workload (airline-style) with a scripted user and token-in/token-out
trajectories whose shared turns are token-identical, for harts prefix trees (``docs/demo.md``)."""

from examples.agent.env import AirlineDB, Task, check_task, make_tasks, run_tool
from examples.agent.rollout import (
    AgentBatch,
    EnginePolicy,
    ScriptedPolicy,
    Trajectory,
    agent_batch,
    rollout_group,
)
from examples.agent.tokenizer import ToyTokenizer

__all__ = ["AgentBatch", "AirlineDB", "EnginePolicy", "ScriptedPolicy", "Task", "ToyTokenizer", "Trajectory",
           "agent_batch", "check_task", "make_tasks", "rollout_group", "run_tool"]
