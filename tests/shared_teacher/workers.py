"""Process entry points for the multi-process shared-teacher tests (module level: spawn imports them).

Each student rank is its own process in its own gloo group (one group per student, never one
spanning students), with its own Megatron model, optimizer, LR and checkpoints. The producer is
one more process with the teacher. The control plane runs in the test process.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

VOCAB = 128


def dataset(n: int, *, seed: int = 0, lo: int = 4, hi: int = 12) -> list[torch.Tensor]:
    """Deterministic token sequences with lengths in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n_,), generator=g) for n_ in lengths]


def _init_group(rank: int, world: int, rendezvous: str, seed: int) -> None:
    """gloo group through a file store at ``rendezvous`` (a fresh path per group): no TCP port to
    pick ahead of time, which the students' own client connections could take first (EADDRINUSE)."""
    torch.set_num_threads(1)
    from mcore_distill import cpu_compat
    from mcore_distill.testing import init_megatron

    cpu_compat.enable()
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    init_megatron(seed=seed)


def teacher_model(seed: int = 7):
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(seed)
    return build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, max_sequence_length=64))


def producer_main(connect: dict, store_spec: dict, key_dict: dict, n_samples: int, rendezvous: str, out: str) -> None:
    """Teacher process: real Megatron GPT teacher → run_producer; writes its stats to ``out``."""
    try:
        _init_group(0, 1, rendezvous, seed=7)
        from shared_teacher import CompatKey, MegatronTeacher, run_producer

        key = CompatKey(**key_dict)
        teacher = MegatronTeacher(teacher_model(), key=key)
        stats = run_producer(connect, store_spec=store_spec, teacher=teacher, dataset=dataset(n_samples), key=key,
                             batch_size=4, plan_timeout=300, deadline_s=400)
        stats["teacher_calls"] = teacher.calls
        stats["teacher_sequences"] = teacher.sequences
        payload = {"ok": stats}
    except BaseException:  # noqa: BLE001 - reported to the test
        payload = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(payload, f)


def _save_ckpt(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def student_main(rank: int, world: int, rendezvous: str, connect: dict, store_spec: dict, key_dict: dict, name: str,
                 hidden: int, lr: float, packed: bool, seed: int, out_dir: str, resume: str | None,
                 step_limit: int, step_delay: float) -> None:
    """One rank of one student: own gloo group, model, optimizer; logs every step, checkpoints on rank 0."""
    log = open(os.path.join(out_dir, f"{name}.r{rank}.log"), "a")
    try:
        _init_group(rank, world, rendezvous, seed=seed)
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt
        from shared_teacher import CompatKey, StudentReader, train_window

        model = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=1,
                                             ffn_hidden_size=2 * hidden, max_sequence_length=64))
        model.config.finalize_model_grads_func = finalize_model_grads
        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, bf16=False, fp16=False),
                                     [model])
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=20, wd_incr_style="constant")
        cursor = None
        if resume:  # the student's own state: weights, optimizer, LR schedule, RNG, data cursor
            ck = torch.load(resume, weights_only=False)
            model.module.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            sched.load_state_dict(ck["scheduler"])
            torch.set_rng_state(ck["rng"])
            cursor = ck["cursor"]
        reader = StudentReader(connect, student=name, rank=rank, key=CompatKey(**key_dict), store_spec=store_spec,
                               resume=cursor, heartbeat_s=0.2, timeout=300)
        for window in reader:
            ids = [[r.sample_id for r in mb] for mb in window.micro_batches]
            nodes = sorted({r.node for mb in window.micro_batches for r in mb})
            step_lr = opt.param_groups[0]["lr"]
            loss = train_window(reader, window, model, opt, packed=packed)
            sched.step(increment=1)
            cur = reader.ack_step(window)
            log.write(json.dumps({"step": cur.step, "epoch": window.epoch, "ids": ids, "nodes": nodes,
                                  "loss": loss, "lr": step_lr}) + "\n")
            log.flush()
            if rank == 0:
                _save_ckpt(os.path.join(out_dir, f"{name}.step{cur.step}.pt"),
                           {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "cursor": cur.to_dict()})
            if step_limit and cur.step >= step_limit:
                reader.leave(f"step limit {step_limit}")
                break
            time.sleep(step_delay)
        if rank == 0:  # every student exports its own weights in Hugging Face (Qwen3) names
            from shared_teacher.megatron import export_hf_state_dict

            _save_ckpt(os.path.join(out_dir, f"{name}.hf.pt"), export_hf_state_dict(model))
        params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        log.write(json.dumps({"done": True, "checksum": float(params.double().sum()),
                              "abs": float(params.double().abs().sum())}) + "\n")
    except BaseException:  # noqa: BLE001 - reported to the test through the log
        log.write(json.dumps({"error": traceback.format_exc()}) + "\n")
    finally:
        log.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def read_log(out_dir: str, name: str, rank: int = 0) -> list[dict]:
    path = os.path.join(out_dir, f"{name}.r{rank}.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
