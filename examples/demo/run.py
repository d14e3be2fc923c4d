"""The colocated multi-teacher on-policy distillation (MOPD) job: CPU demo and GPU run, one runner.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.demo.run [key=value ...]
    python -m torch.distributed.run --standalone --nproc-per-node 1 -m examples.demo.run --config-name gpu

Two tiny Megatron teachers are trained on their own domain (string reversal, Caesar shift); a
smaller student is warm-started on their greedy outputs, then trained on-policy: the embedded
rollout engine samples GRPO groups, harts packs them as a prefix tree, the routed teachers score
the student's tokens, the MOPD loss updates the student through StagedAdamW, and the colocate
publisher sends the new weights to the engine, the engine and the trainer handing memory back and
forth through ``colocate.ColocatedCycle`` every step. Prints a table; writes ``results.json``,
``steps.jsonl``, ``demo.png``, TensorBoard scalars and checkpoints under ``out_dir`` (see
``docs/demo.md``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


def _wants_cuda(argv: list[str]) -> bool:
    """``device=cuda`` or the ``gpu`` config on the command line (read before torch touches CUDA)."""
    flat = " ".join(argv)
    return "device=cuda" in argv or "--config-name gpu" in flat or "--config-name=gpu" in flat or "-cn gpu" in flat


os.environ.setdefault("OMP_NUM_THREADS", "1")
if not _wants_cuda(sys.argv[1:]):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU run: its tensors are created on the host (docs/demo.md)

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from examples.demo.config import to_demo_config  # noqa: E402 (registers the schema)
from mcore_distill.lifetime import end_with_launcher  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="demo")
def main(dcfg: DictConfig) -> None:
    cfg = to_demo_config(dcfg)
    end_with_launcher()  # torchrun starts ranks in their own sessions: a killed torchrun must not strand them
    logging.getLogger().setLevel(logging.WARNING)  # Megatron / publisher INFO lines would break the bar
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
    else:
        from mcore_distill import cpu_compat

        cpu_compat.enable()
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo")
    from examples.demo.pipeline import acceptance, run_demo
    from examples.demo.report import table, timeline_summary, write_outputs

    try:
        results = run_demo(cfg)
        if torch.distributed.get_rank() == 0:
            history, evals, tb_dir = results.pop("history"), results.pop("evals"), results.pop("tb_dir")
            paths = write_outputs(results, history, evals, cfg.out_dir, tb_dir=tb_dir)
            w = results["wall_s"]
            print("\n" + table(results))
            print("\n" + timeline_summary(results, history))
            print(f"\nwall: teachers {w['teachers']:.0f}s{' (cached)' if results['teachers_cached'] else ''}, "
                  f"warm start {w['warm_start']:.0f}s, MOPD {w['mopd']:.0f}s, total {w['total']:.0f}s "
                  f"on {results['world_size']} ranks; student forward: {results['forward']}")
            for k, ok in acceptance(results).items():
                print(f"  [{'ok' if ok else 'MISS'}] {k}")
            print(f"wrote {paths['json']}, {paths['png']}, {paths['tensorboard']}/")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
