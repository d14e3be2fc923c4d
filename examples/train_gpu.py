"""MOPD steps on a real architecture built from a Hydra config, on one GPU (or CPU for tiny models).

    python -m examples.train_gpu model=qwen3_dense_0p6b            # GPU
    python -m examples.train_gpu                                   # CPU default: model=tiny_dense
    python -m examples.train_gpu model.hf_path=/ckpt/student model.teacher_hf_path=/ckpt/teacher

Builds a student and a frozen teacher (random init) from ``examples/configs/model/<name>.yaml``,
or loads them from HF folders (``model.hf_path``: ``mcore_distill.hf.megatron_model_from_hf``),
runs ``run.steps`` steps of tree-packed (harts) GRPO batches through the MOPD loss and StagedAdamW,
and prints per-step tokens/s, sharing ratio and peak device memory (see ``docs/demo.md``).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from examples.train.config import TrainConfig, to_train_config  # noqa: E402 (registers the schema)


def setup(device: str) -> bool:
    """One-rank process group (NCCL on CUDA, gloo + ``cpu_compat`` on CPU) and Megatron state."""
    from mcore_distill.testing import free_port, init_megatron

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not cuda:
        from mcore_distill import cpu_compat

        cpu_compat.enable()
    else:
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1, seed=0)
    return cuda


def report(res: dict) -> str:
    lines = [f"model {res['model']}: {res['params'] / 1e6:,.1f}M params on {res['device']}, tree attention "
             f"'{res['backend']}', optimizer residency '{res['residency']}', build {res['build_s']:.1f}s",
             f"{'step':>4} {'step_s':>8} {'teacher_s':>9} {'train_s':>8} {'tokens':>8} {'tree':>8} {'C':>5} "
             f"{'tok/s':>10} {'loss':>9} {'KL':>8}"]
    for x in res["steps"]:
        lines.append(f"{x['step']:>4} {x['step_s']:>8.3f} {x['teacher_s']:>9.3f} {x['train_s']:>8.3f} "
                     f"{x['tokens']:>8} {x['tree_tokens']:>8} {x['compression']:>5.2f} {x['tokens_per_s']:>10.0f} "
                     f"{x['loss']:>9.4f} {x['sampled_kl']:>8.4f}"
                     + ("" if x["reward"] is None else f"  reward {x['reward']:.2f}"))
    peak = res["peak_memory_GiB"]
    lines.append(f"mean over steps 1..: {res['tokens_per_s']:.0f} tokens/s (ΣL per wall second), "
                 f"{res['step_s']:.3f} s/step; peak device memory "
                 f"{'n/a (CPU)' if peak is None else f'{peak:.2f} GiB'} "
                 f"(estimated resident before activations {res['estimated_resident_GiB']:.2f} GiB)")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(dcfg: DictConfig) -> None:
    cfg: TrainConfig = to_train_config(dcfg)
    logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    setup(cfg.run.device)
    from examples.train.runner import run

    try:
        res = run(cfg)
        print(report(res), flush=True)
        if cfg.out_json:
            Path(cfg.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out_json).write_text(json.dumps(res, indent=1))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
