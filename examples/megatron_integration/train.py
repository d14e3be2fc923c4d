"""The plain Megatron-Core loop (``plain.py``) plus mcore-distill, each piece a switch:

(a) ``--residency staged``: ``get_staged_optimizer`` in place of ``get_megatron_optimizer`` (the
    same Megatron distributed optimizer, AdamW state in host memory streamed through device slots),
    with ``zero_grad_buffer()`` as before and model + optimizer checkpoints (``--load``/``--save``);
(b) ``--teacher DIR``: an MOPD loss in ``forward_step_func``: the student samples its own tokens,
    a frozen Megatron teacher (a ``dist_checkpointing`` folder, e.g. ``plain.py --save``) scores
    them, ``mopd_loss_func`` is the per-token reverse-KL policy-gradient loss;
(c) ``--tree``: the sampled groups share their prompt, so harts packs each micro-batch as a
    prefix tree (every prompt once) and the loss reads the tree's log-probs back per row.

With ``--residency gpu`` and no ``--teacher`` this is ``plain.py`` step for step (tested).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.megatron_integration.plain \\
        --steps 200 --save /tmp/teacher
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.megatron_integration.train \\
        --tp 2 --teacher /tmp/teacher --tree --save /tmp/student
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from examples.megatron_integration.common import (
    LETTERS,
    PROMPT,
    SEQ,
    StepLog,
    data_generator,
    get_batch,
    initialize_distributed,
    model_provider,
    parse_args,
    position_ids,
    sample,
)
from harts import plan_tree_batch
from harts.megatron import make_tree_params, tree_forward
from mopd.backends import TokenBatch
from mopd.config import MOPDConfig, MOPDLossConfig, RoutingSpec, TeacherSpec, TeacherTreeConfig
from mopd.megatron import MegatronTeacherHost, MOPDMicroBatch, build_teacher_pool, mopd_loss_func
from mopd.routing import score_routed, stamp_routes
from optim_staged.config import AdamWConfig, StagedOptimizerConfig
from optim_staged.megatron import get_staged_optimizer, load_checkpoint, save_checkpoint

ROUTING = RoutingSpec(field="task", routes={"reverse": {"teacher": 1.0}})
LOSS = MOPDLossConfig(is_cap=5.0, adv_clip=3.0)


def loss_func(loss_mask, output_tensor):
    """Mean cross entropy of the answer tokens (``output_tensor``: Megatron's per-token loss)."""
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def mopd_batch(model, pool, args, gen):
    """(b) One step's on-policy data: ``args.group`` samples per prompt, scored by the teacher."""
    prompts = get_batch(args.batch // args.group, gen)["tokens"][:, :PROMPT].repeat_interleave(args.group, 0)
    tokens, old_logp = sample(model, prompts, LETTERS, gen)  # your rollout engine
    batch = TokenBatch(tokens, torch.full_like(tokens[:, 0], SEQ), torch.full_like(tokens[:, 0], PROMPT - 1))
    routes = stamp_routes([{"task": "reverse"} for _ in range(len(tokens))], ROUTING)
    targets, _ = score_routed(pool, batch, routes, ROUTING, old_logp=old_logp)
    labels, mask = torch.roll(tokens, -1, 1), batch.label_mask()

    def micro(rows):
        return MOPDMicroBatch(labels=labels[rows], loss_mask=mask[rows], old_logp=old_logp[rows],
                              targets=targets[rows], route_ids=torch.zeros_like(labels[rows]))

    if not args.tree:
        return [(tokens, micro(slice(None)), None)]
    tree = plan_tree_batch(tokens, device=tokens.device)  # (c) every shared prompt once
    return [(None, micro(mb.rows), mb) for mb in tree.microbatches]


def mopd_forward_step(data_iterator, model):
    """(b) MOPD loss on the student's log-probs: of the [B, S] batch, or (c) of a tree micro-batch."""
    tokens, micro, tree = next(data_iterator)
    loss = partial(mopd_loss_func, micro, config=LOSS, route_names=["reverse"])
    if tree is None:
        return model(tokens, position_ids(tokens), None), loss
    output = tree_forward(model, tree.forest, params=make_tree_params(tree.forest, backend="dense", model=model))
    return output, partial(loss, logprob_fn=lambda out, _: tree.logprob_rows(out.logp))


def main() -> None:
    def extra(ap):
        ap.add_argument("--residency", choices=["staged", "gpu"], default="staged", help="(a) optimizer state")
        ap.add_argument("--load", default=None, help="(a) resume model + optimizer from this checkpoint")
        ap.add_argument("--teacher", default=None, help="(b) teacher checkpoint: MOPD instead of cross entropy")
        ap.add_argument("--group", type=int, default=8, help="(b) samples per prompt")
        ap.add_argument("--tree", action="store_true", help="(c) harts tree packing of the MOPD batch")

    args = parse_args(__doc__.splitlines()[0], extra)
    initialize_distributed(args.tp, args.seed)
    model = model_provider(args.hf)
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads  # DP reduce-scatter, TP norms, as in training.py
    opt = get_staged_optimizer(StagedOptimizerConfig(residency=args.residency, adamw=AdamWConfig(lr=args.lr)), [model])
    if args.load:
        load_checkpoint(model, opt, args.load)
    pool = None
    if args.teacher:  # (b) one frozen teacher; several, routed per sample: add teachers and routes
        config = MOPDConfig(teachers={"teacher": TeacherSpec(checkpoint=args.teacher)}, routing=ROUTING, loss=LOSS,
                            teacher_tree=TeacherTreeConfig(enabled=args.tree, backend="dense"))
        pool = build_teacher_pool(config, host=MegatronTeacherHost(model_provider(), micro_batch_size=args.batch))
    forward_backward = get_forward_backward_func()
    gen, log = data_generator(args.seed), StepLog(args.out, save_hf=args.save_hf)

    for step in range(args.steps):
        data = [get_batch(args.batch, gen)] if pool is None else mopd_batch(model, pool, args, gen)
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=forward_step_func if pool is None else mopd_forward_step,
                                  data_iterator=iter(data), model=model, num_microbatches=len(data), seq_length=SEQ,
                                  micro_batch_size=args.batch, forward_only=False)
        opt.step()
        log.step(step, losses)

    if args.save:
        save_checkpoint(model, opt, args.save)  # (a) model + optimizer, atomic; loads at any DP size
    if pool is not None:
        pool.close()
    log.close(model)


if __name__ == "__main__":
    main()
