"""Checkpoints of the colocated runner: atomic, complete only once their step was verified.

``<out_dir>/checkpoints/step_<k>/`` holds

* ``megatron/``: model + staged optimizer (:func:`optim_staged.megatron.save_checkpoint`,
  ``dist_checkpointing``, switched in atomically), written after the step's optimizer update;
* ``hf/``: the student as a Hugging Face folder (:func:`mcore_distill.hf.save_hf_checkpoint`,
  atomic), what an engine loads;
* ``runner_rank<r>.pt``: step, weight version, RNG states, metric history (atomic per file).

``latest.json`` names the last complete one; rank 0 rewrites it (atomically) only after every
rank wrote its files and the step's publish passed verification, so a crash at any point leaves
the previous complete checkpoint as the one ``resume=true`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from examples.demo.config import DemoConfig


def root(cfg: DemoConfig) -> Path:
    return Path(cfg.out_dir) / "checkpoints"


def step_dir(cfg: DemoConfig, step: int) -> Path:
    return root(cfg) / f"step_{step:06d}"


def due(cfg: DemoConfig, step: int) -> bool:
    """Whether step ``step`` (0: after the warm start) is checkpointed."""
    return cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0


def save_weights(st, cfg: DemoConfig, step: int) -> None:
    """Collective: Megatron model + optimizer, and the HF folder, of the trainer now (resident)."""
    from examples.demo.tasks import VOCAB
    from mcore_distill.hf import save_hf_checkpoint
    from optim_staged.megatron import save_checkpoint

    d = step_dir(cfg, step)
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_checkpoint(st.ddp, st.opt, str(d / "megatron"))
    save_hf_checkpoint([st.model], d / "hf", model_type="qwen3", vocab_size=VOCAB)


def rng_state(g: torch.Generator) -> dict:
    state = {"prompts": g.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(g: torch.Generator, state: dict) -> None:
    g.set_state(state["prompts"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def finalize(cfg: DemoConfig, step: int, state: dict) -> None:
    """Collective: write this rank's runner state, then (rank 0) point ``latest.json`` at ``step``."""
    from mcore_distill.atomic import atomic_torch_save, atomic_write_json

    atomic_torch_save(state, step_dir(cfg, step) / f"runner_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        atomic_write_json(root(cfg) / "latest.json", {"step": step, "version": state["version"],
                                                      "world_size": dist.get_world_size()})
    dist.barrier()


def latest(cfg: DemoConfig) -> dict | None:
    """``{"step", "version", "world_size"}`` of the last complete checkpoint, or None."""
    p = root(cfg) / "latest.json"
    return json.loads(p.read_text()) if p.is_file() else None


def load(st, cfg: DemoConfig, info: dict) -> dict:
    """Collective: load step ``info["step"]`` into the trainer; returns this rank's runner state."""
    from examples.demo.config import DemoConfigError
    from optim_staged.megatron import load_checkpoint

    if info["world_size"] != dist.get_world_size():
        raise DemoConfigError(f"resume=True: the checkpoint of step {info['step']} was written by "
                              f"{info['world_size']} ranks, this job has {dist.get_world_size()}")
    d = step_dir(cfg, info["step"])
    load_checkpoint(st.ddp, st.opt, str(d / "megatron"))
    return torch.load(d / f"runner_rank{dist.get_rank()}.pt", weights_only=False)
