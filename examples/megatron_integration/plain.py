"""A plain Megatron-Core training loop (the shape of Megatron-LM's
``examples/run_simple_mcore_train_loop.py``): DDP, Megatron's distributed optimizer, a
``forward_step_func`` with its loss, ``get_forward_backward_func``, a ``dist_checkpointing`` save.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.megatron_integration.plain --tp 2

``train.py`` is this file plus mcore-distill (docs/integration.md shows the diff).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from examples.megatron_integration.common import (
    SEQ,
    StepLog,
    data_generator,
    get_batch,
    initialize_distributed,
    model_provider,
    parse_args,
)


def loss_func(loss_mask, output_tensor):
    """Mean cross entropy of the answer tokens (``output_tensor``: Megatron's per-token loss)."""
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    initialize_distributed(args.tp, args.seed)
    model = model_provider(args.hf)
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads  # DP reduce-scatter, TP norms, as in training.py
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, use_distributed_optimizer=True), [model])
    forward_backward = get_forward_backward_func()
    gen, log = data_generator(args.seed), StepLog(args.out, save_hf=args.save_hf)

    for step in range(args.steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=forward_step_func, data_iterator=iter([get_batch(args.batch, gen)]),
                                  model=model, num_microbatches=1, seq_length=SEQ, micro_batch_size=args.batch,
                                  forward_only=False)
        opt.step()
        log.step(step, losses)

    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(model.module.sharded_state_dict(), args.save)
    log.close(model)


if __name__ == "__main__":
    main()
