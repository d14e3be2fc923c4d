"""CPU end-to-end multi-teacher on-policy distillation (MOPD) demo.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.demo.run [key=value ...]

Two tiny Megatron teachers are trained on their own domain (string reversal, Caesar shift); a
smaller student is warm-started on their greedy outputs, then trained on-policy: the embedded
rollout engine samples GRPO groups, harts packs them as a prefix tree, the routed teachers score
the student's tokens, the MOPD loss updates the student through StagedAdamW, and the colocate
publisher sends the new weights to the engine. Prints a table; writes ``results.json``,
``demo.png`` and TensorBoard scalars under ``out_dir`` (see ``docs/demo.md``).
"""

from __future__ import annotations

import logging
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU-only demo: its tensors are created on the host (docs/demo.md)

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from examples.demo.config import to_demo_config  # noqa: E402 (registers the schema)


@hydra.main(version_base="1.3", config_path="conf", config_name="demo")
def main(dcfg: DictConfig) -> None:
    cfg = to_demo_config(dcfg)
    logging.getLogger().setLevel(logging.WARNING)  # Megatron / publisher INFO lines would break the bar
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    from mcore_distill import cpu_compat

    cpu_compat.enable()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    from examples.demo.pipeline import acceptance, run_demo
    from examples.demo.report import table, write_outputs

    try:
        results = run_demo(cfg)
        if torch.distributed.get_rank() == 0:
            paths = write_outputs(results, results.pop("history"), results.pop("evals"), cfg.out_dir)
            w = results["wall_s"]
            print("\n" + table(results))
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
