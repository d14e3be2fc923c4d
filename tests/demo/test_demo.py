"""The demo pipeline end to end on 2 gloo ranks with a tiny config, plus its config and checkers."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from examples.demo.config import (
    DemoConfig,
    DemoConfigError,
    EngineSection,
    MOPDStageConfig,
    TeacherTrainConfig,
    VerifySection,
    WarmStartConfig,
)
from examples.demo.tasks import FIRST_LETTER, TaskData, answer, prompts_from_letters

CONF_DIR = str(Path(__file__).resolve().parents[2] / "examples" / "demo" / "conf")


def _compose(overrides: list[str], name: str = "demo"):
    """Hydra's compose API as a user calls it: importing examples.demo.config registered the schema."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_gpu_config_is_the_colocated_sglang_job():
    """conf/gpu.yaml validates and asks for what the GPU run needs (issue 21's targets)."""
    from examples.demo.config import to_demo_config

    cfg = to_demo_config(_compose([], "gpu"))
    assert cfg.device == "cuda" and cfg.engine.kind == "sglang" and cfg.teacher_server.kind == "sglang"
    assert cfg.mopd.steps >= 30 and cfg.teacher.http_routes == ["shift"]
    assert cfg.engine.env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1" and cfg.engine.cuda_graph
    models = (cfg.student, cfg.teacher.model, cfg.teacher.http_model)
    assert all(m.hidden_size // m.num_attention_heads >= 32 for m in models)  # SGLang's triton backend
    assert cfg.teacher.http_model.hidden_size != cfg.teacher.model.hidden_size  # a teacher of another size
    with pytest.raises(DemoConfigError, match="engine.kind='sglang': sglang needs device=cuda"):
        to_demo_config(_compose(["device=cpu"], "gpu"))


def test_unexplained_rows_forgive_only_near_ties_at_the_first_difference():
    """The GPU job's greedy check: a bf16 engine may take the trainer's runner-up where the
    trainer's top-1/top-2 margin is small; anything else is a mismatch (tie_margin 0: exact)."""
    from examples.demo.runner import unexplained_rows

    tokens = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    runner = torch.tensor([[4, 5, 6]] * 5)
    margin = torch.tensor([[0.5, 0.1, 0.5]] * 5)
    got = torch.tensor([[1, 2, 3],     # equal
                        [1, 5, 9],     # runner-up at a 0.1-nat tie, then anything
                        [1, 7, 3],     # not the runner-up
                        [4, 2, 3],     # runner-up but margin 0.5
                        [1, 2, 6]])    # runner-up at margin 0.5
    assert unexplained_rows(got, (tokens, runner, margin), 0.25).tolist() == [False, False, True, True, True]
    assert unexplained_rows(got, (tokens, runner, margin), 0.5).tolist() == [False, False, True, False, False]
    assert unexplained_rows(got, (tokens, runner, margin), 0.0).tolist() == [False, True, True, True, True]


def test_megatron_greedy_path_margins_are_top2_log_prob_gaps():
    """Runner-up and margin of the trainer's greedy path match a plain recompute in fp64 terms."""
    from examples.demo.teachers import megatron_greedy, megatron_greedy_path

    torch.manual_seed(0)
    class Bigram(torch.nn.Embedding):  # next-token logits from the current token, Megatron's call signature
        def forward(self, seq, pos, mask):
            return super().forward(seq)

    model = lin = Bigram(11, 11)
    prompts = torch.randint(0, 11, (4, 3))
    tok, ru, mg = megatron_greedy_path(model, prompts, 5)
    assert torch.equal(tok, megatron_greedy(model, prompts, 5))
    last = torch.cat([prompts[:, -1:], tok[:, :-1]], 1)
    lp = torch.log_softmax(lin.weight.double()[last], -1)
    top = lp.topk(2, -1)
    assert torch.equal(tok, top.indices[..., 0]) and torch.equal(ru, top.indices[..., 1])
    torch.testing.assert_close(mg.double(), top.values[..., 0] - top.values[..., 1], rtol=0, atol=1e-6)


def test_phase_timeline_accumulates_and_resets():
    from examples.demo.timeline import PHASES, PhaseTimeline

    tl = PhaseTimeline("cpu")
    with tl.phase("verify"):
        pass
    with tl.phase("verify"):
        sum(range(1000))
    tl.add_bytes("release", {"engine/weights": 5})
    tl.add_bytes("release", {"engine/weights": 7})
    row = tl.flush()
    assert set(f"time/{p}" for p in PHASES) <= set(row) and row["time/generate"] == 0.0 and row["time/verify"] > 0
    assert row["bytes/release/engine/weights"] == 12 and row["mem/verify/allocated"] is None  # no counters on CPU
    assert tl.flush()["time/verify"] == 0.0


def test_yaml_equals_dataclass_defaults():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(_compose([]))
    assert isinstance(cfg, DemoConfig)
    assert asdict(cfg) == asdict(DemoConfig())  # one default per knob


def test_hydra_names_a_wrong_key():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="stepz"):
        _compose(["mopd.stepz=3"])


def test_appended_unknown_key_is_refused_with_the_valid_keys():
    """``+mopd.stepz=1`` passes Hydra's composition; building the config refuses it by name."""
    from examples.demo.config import to_demo_config

    cfg = to_demo_config(_compose(["mopd.steps=7"]))
    assert isinstance(cfg, DemoConfig) and cfg.mopd.steps == 7
    with pytest.raises(DemoConfigError, match=r"'mopd.stepz': MOPDStageConfig has no field 'stepz' "
                                              r"\(did you mean 'steps'\?\); valid keys: adv_clip, "):
        to_demo_config(_compose(["+mopd.stepz=1"]))
    with pytest.raises(DemoConfigError, match="'seeed': DemoConfig has no field"):
        to_demo_config(_compose(["+seeed=1"]))


@pytest.mark.parametrize("field,value,kw", [
    ("mopd.forward", "dense", {"mopd": MOPDStageConfig(forward="dense")}),
    ("teacher.min_accuracy", 1.5, {"teacher": TeacherTrainConfig(min_accuracy=1.5)}),
    ("warm_start.lr", 0.0, {"warm_start": WarmStartConfig(lr=0.0)}),
    ("shift", 16, {"shift": 16}),
    ("engine.start_timeout_s", 0.0, {"engine": EngineSection(start_timeout_s=0.0)}),
    ("verify.tie_margin", -0.1, {"verify": VerifySection(tie_margin=-0.1)}),
    ("engine.max_total_tokens", 0, {"engine": EngineSection(max_total_tokens=0)}),
])
def test_bad_values_name_field_and_value(field, value, kw):
    with pytest.raises(DemoConfigError, match=rf"{field}={value!r}"):
        DemoConfig(**kw).validate()


def test_checkers():
    x = torch.tensor([[0, 1, 2, 15]]) + FIRST_LETTER
    assert answer("reverse", x, letters=16, shift=3).tolist() == [[20, 7, 6, 5]]
    assert answer("shift", x, letters=16, shift=3).tolist() == [[8, 9, 10, 7]]  # 15 + 3 wraps to 2
    assert prompts_from_letters("shift", x).tolist() == [[1, 4, 5, 6, 7, 20, 2]]
    data = TaskData(length=4, letters=16, shift=3, held_out=8, seed=0)
    held = {tuple(r) for r in data.held_out["reverse"].tolist()}
    small = TaskData(length=2, letters=2, shift=1, held_out=3, seed=0)  # 4 possible rows, 3 held out
    rows = small.sample("reverse", 50, torch.Generator().manual_seed(0)).tolist()
    assert all(tuple(r) not in {tuple(h) for h in small.held_out["reverse"].tolist()} for r in rows)
    assert not held & {tuple(r) for r in data.sample("reverse", 64, torch.Generator().manual_seed(1)).tolist()}


def _tiny(out_dir: str, **over) -> DemoConfig:
    cfg = DemoConfig(length=4, held_out=16, out_dir=out_dir, progress=False,
                     teacher=TeacherTrainConfig(steps=30, batch=16, min_accuracy=0.0, distill_prompts=32),
                     warm_start=WarmStartConfig(steps=3, batch=8),
                     mopd=MOPDStageConfig(steps=2, prompts_per_step=2, group_size=4, eval_every=1))
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _pipeline_rank(rank: int, world: int, out_dir: str) -> dict:
    from examples.demo.pipeline import run_demo
    from examples.demo.report import table, write_outputs
    from examples.demo.student import build_student, student_logprobs, warm_start
    from examples.demo.teachers import TeacherNotConvergedError
    from mcore_distill.testing import assert_close, destroy_megatron

    torch.set_num_threads(1)
    checks: dict = {}
    cfg = _tiny(out_dir)
    res = run_demo(cfg)
    checks["first"] = {k: res[k] for k in ("teachers_cached", "engine_version", "accuracy", "teacher_accuracy",
                                           "colocated")}
    checks["steps_jsonl"] = Path(out_dir, "steps.jsonl").read_text().splitlines() if rank == 0 else None
    checks["max_engine_trainer"] = max(h["engine_trainer_max_abs"] for h in res["history"])
    checks["sharing"] = [h["sharing_ratio"] for h in res["history"]]
    if rank == 0:
        paths = write_outputs(res, res.pop("history"), res.pop("evals"), out_dir)
        checks["paths"] = paths
        checks["table"] = table(res)
    destroy_megatron()

    res2 = run_demo(cfg)  # teachers from the cache
    checks["second"] = {k: res2[k] for k in ("teachers_cached", "teacher_accuracy")}
    destroy_megatron()

    if rank == 0:  # a cache folder missing a teacher weights file is retrained, not loaded
        for f in Path(out_dir, "cache").glob("*/shift/*.safetensors"):
            f.unlink()
    torch.distributed.barrier()
    checks["third_cached"] = run_demo(cfg)["teachers_cached"]
    destroy_megatron()

    try:  # one step cannot reach 50%: the demo must refuse to print a table
        run_demo(_tiny(out_dir, use_cache=False, teacher=TeacherTrainConfig(steps=1, batch=4, min_accuracy=0.5)))
        checks["not_converged"] = None
    except TeacherNotConvergedError as e:
        checks["not_converged"] = str(e)
    destroy_megatron()

    # Tree (harts) vs plain student forward, and engine (published) vs Megatron logits, fp32.
    from mcore_distill.testing import init_megatron

    init_megatron(seed=0)
    cfg = _tiny(out_dir)
    data = TaskData(length=cfg.length, letters=cfg.letters, shift=cfg.shift, held_out=cfg.held_out, seed=0)
    st = build_student(cfg, data)
    g = torch.Generator().manual_seed(rank)
    x = torch.cat([data.sample("reverse", 3, g), data.sample("shift", 3, g)])
    y = torch.randint(FIRST_LETTER, FIRST_LETTER + 16, (6, cfg.length), generator=g)
    prompts = torch.cat([prompts_from_letters("reverse", x[:3]), prompts_from_letters("shift", x[3:])])
    ids = torch.cat([prompts.repeat_interleave(2, 0), y.repeat(2, 1)], 1)  # shared prompts, forks
    distill = {t: (x, y) for t in ("reverse", "shift")}
    warm_start(st, cfg, data, distill)                                     # trains and publishes v2
    # the resident-fraction accounting reads real storage sizes: full while resident, 0 once released
    from examples.demo.engine import resident_bytes
    from examples.demo.runner import trainer_resident_bytes, trainer_state_bytes

    total, engine_full = trainer_state_bytes(st), resident_bytes(st.engine)
    checks["trainer_resident"] = [trainer_resident_bytes(st), total]
    st.residency.release()
    st.engine.release_memory()
    checks["released"] = [trainer_resident_bytes(st), resident_bytes(st.engine), engine_full]
    st.residency.resume()
    st.engine.resume_memory()
    from examples.demo.student import publish

    publish(st)                                                            # v3: the released engine lost its weights
    st.ddp.eval()
    with torch.no_grad():
        tree, compression = student_logprobs(st, ids, cfg)
        cfg.mopd.forward = "plain"
        plain, _ = student_logprobs(st, ids, cfg)
        assert_close("tree vs plain log-probs", plain, tree, atol=2e-5)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        assert_close("engine vs Megatron logits", st.model(ids, pos, None).float(), st.engine.logits(ids), atol=2e-5)
    checks["compression"] = compression
    checks["version"] = st.engine.weight_version()
    checks["n_params"] = sum(p.numel() for p in st.model.parameters())
    return checks


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_demo_pipeline_two_ranks(tmp_path):
    from mcore_distill.testing import run_ranks

    out = run_ranks(_pipeline_rank, 2, str(tmp_path), timeout=140)
    for c in out:
        first = c["first"]
        assert first["teachers_cached"] is False and c["second"]["teachers_cached"] is True
        assert c["second"]["teacher_accuracy"] == first["teacher_accuracy"]
        assert c["third_cached"] is False
        assert first["engine_version"] == 1 + 1 + 2  # init, after warm start, one per MOPD step
        for stage in ("before", "warm_start", "mopd"):
            assert set(first["accuracy"][stage]) == {"reverse", "shift"}
            assert all(0.0 <= v <= 1.0 for v in first["accuracy"][stage].values())
        assert c["max_engine_trainer"] < 1e-4  # on-policy: behaviour log-probs = trainer log-probs
        rec = first["colocated"]  # the residency cycle ran: everything handed over, publishes verified
        assert rec["engine"] == "hf_engine" and rec["steps"] == 2 and rec["greedy_match"] is True
        assert rec["trainer_resident_fraction_during_generate"] == 0.0
        assert rec["engine_resident_fraction_during_train"] == 0.0
        assert rec["routes"]["shift"]["teacher"] == "http" and rec["routes"]["reverse"]["teacher"] == "megatron"
        assert rec["publish_ms"] > 0 and set(rec["header"]) == {"date", "gpu", "commit", "versions"}
        assert all(1.5 < s < 4.0 for s in c["sharing"])  # groups of 4 share a 7-token prompt
        assert c["not_converged"] is not None and "teacher.min_accuracy=0.5" in c["not_converged"]
        assert c["version"] == 3 and c["compression"] > 1.2
        # resident: the full fp32 param and grad buffers; plus, in the host slabs, this rank's half
        # (the distributed optimizer's shard, within bucket padding) of master, exp_avg, exp_avg_sq
        n = c["n_params"]
        resident, total = c["trainer_resident"]
        assert resident >= 2 * 4 * n and 0.95 * 3 * 4 * n / 2 <= total - resident <= 1.05 * 3 * 4 * n / 2
        assert c["released"][:2] == [0, 0] and c["released"][2] >= 4 * n
    assert out[0]["first"]["accuracy"] == out[1]["first"]["accuracy"]  # all-reduced
    paths = out[0]["paths"]
    saved = json.loads(Path(paths["json"]).read_text())
    assert len(saved["history"]) == 2 and saved["evals"][-1]["step"] == 2
    assert saved["greedy_match"] is True and "routes" in saved  # the colocated record at top level
    rows = [json.loads(x) for x in out[0]["steps_jsonl"]]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the timeline and the bytes each side handed over
        assert all(r[f"time/{p}"] > 0 for p in ("generate", "teacher_scoring", "train", "optimizer", "publish"))
        assert r["bytes/release/engine/weights"] > 0 and r["bytes/resume/trainer/weights"] > 0
    assert Path(paths["png"]).stat().st_size > 10_000
    assert any(Path(paths["tensorboard"]).glob("events.out.tfevents.*"))
    assert "student after MOPD" in out[0]["table"]


def test_sglang_arguments_of_the_gpu_config():
    """What the GPU run hands SGLang (it cannot start here): the engine's and the teacher server's
    arguments from conf/gpu.yaml, and SGLang's output dicts read as tokens and behaviour log-probs."""
    from examples.demo.config import to_demo_config
    from examples.demo.engine import sample, sglang_args
    from examples.demo.teacher_server import launch_args

    cfg = to_demo_config(_compose([], "gpu"))
    args = sglang_args(cfg, "/m/student_hf", torch.device("cuda", 0))
    assert args["model_path"] == "/m/student_hf" and args["attention_backend"] == "triton"
    assert args["sampling_backend"] == "pytorch" and args["grammar_backend"] == "none"
    assert args["skip_tokenizer_init"] and args["enable_memory_saver"] and args["dtype"] == "bfloat16"
    assert args["disable_cuda_graph"] is False and args["mem_fraction_static"] == 0.1 and args["base_gpu_id"] == 0
    assert args["max_total_tokens"] is None  # ServerArgs' default: SGLang sizes the KV pool from its share
    assert sglang_args(to_demo_config(_compose(["engine.max_total_tokens=4096"], "gpu")), "/m", torch.device("cuda", 0)
                       )["max_total_tokens"] == 4096
    assert cfg.engine.start_timeout_s > 0
    # the teacher server: colocate's one launch path (SGLangServerConfig → HTTPClient.launch)
    import inspect

    from colocate.sglang_clients import HTTPClient, server_args_to_cli

    la = launch_args(cfg, "/m/shift", "/o/teacher_server.log")
    own = set(inspect.signature(HTTPClient.launch).parameters)
    cmd = server_args_to_cli({k: v for k, v in la.items() if k not in own})
    assert la["server_module"] == "sglang.launch_server" and la["ipc"] == "cuda" and la["role"] == "teacher"
    assert cmd[cmd.index("--model-path") + 1] == "/m/shift" and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "triton" and "--enable-memory-saver" not in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.05" and "--disable-cuda-graph" in cmd
    assert (la["start_timeout_s"], la["timeout_s"], la["log_path"]) == (300.0, 60.0, "/o/teacher_server.log")
    env = la["env"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] is None  # removed for the role
    cpu = launch_args(to_demo_config(_compose([])), "/m/shift")
    assert cpu["server_module"] == "mopd.hf_server" and cpu["ipc"] == "cpu" and cpu["model_path"] == "/m/shift"

    class SGLangLike:  # the reply shape of colocate.SGLangEngine.generate (SGLang's output dicts)
        client = object()

        def generate(self, prompts, *, max_new_tokens, temperature):
            assert temperature == 0.5 and max_new_tokens == 2
            return [{"output_ids": [7, 8], "meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]]}}
                    for _ in prompts]

    assert sample(SGLangLike(), [[1, 2]], n_new=2, temperature=0.5, seed=3) == ([[7, 8]], [[-0.5, -1.5]])
