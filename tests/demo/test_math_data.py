"""Math jsonl loaders (GSM8K, DAPO-Math), prompt rendering and answer rewards (examples/data)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from examples.data import (
    MathDataConfig,
    MathDataConfigError,
    MathDataRecordError,
    extract_answer,
    load_math_jsonl,
    math_reward,
    math_rewards,
    normalize_answer,
    reference_extract_answer,
    reference_math_reward,
    reference_normalize_answer,
    render_prompt,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _tokenizer(*, chat: bool):
    """Tiny local WordLevel tokenizer (no download); with or without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "<unk> <|system|> <|user|> <|assistant|> <|end|> what is 2 + 3 ? Answer : be brief".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if chat:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GSM8K_ROWS = [
    {"question": "what is 2 + 3 ?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "How many eggs?", "answer": "She sells 1,000 + 234 eggs.\n#### 1,234"},
    {"question": "Half of 3/2?", "answer": "It is 3/4.\n#### 0.75"},
]

DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "what is 2 + 3 ?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "5", "style": "rule-lighter"},
        "extra_info": {"index": "a-0"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Sum of 1/2 and 1/4?"},
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "\\frac{3}{4}", "style": "rule-lighter"},
        "extra_info": {"index": 17},
    },
]


# ---------------------------------------------------------------- rewards: fixed cases ----------

REWARD_CASES = [
    ("... so the total is \\boxed{42}.", "42", 1.0, "boxed"),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0, "boxed-frac-vs-decimal"),
    ("\\boxed{0.75}", "3/4", 1.0, "decimal-vs-slash"),
    ("we get \\boxed{\\left(\\frac{1}{2}, {3}\\right)}", "(\\frac{1}{2},{3})", 1.0, "nested-braces-string"),
    ("first \\boxed{7} then \\boxed{ 8 }", "8", 1.0, "last-boxed"),
    ("first \\boxed{7} then \\boxed{8", "7", 1.0, "unbalanced-last-boxed"),
    ("work\n#### 1,234", "1234", 1.0, "gsm8k-commas"),
    ("#### 42.0", "42", 1.0, "trailing-point-zero"),
    ("#### $42$.", "42", 1.0, "dollar-and-period"),
    ("Answer: -\\dfrac{6}{8}", "-0.75", 1.0, "negative-dfrac"),
    ("no marker, numbers 3 then 12,000", "12000", 1.0, "last-number-commas"),
    ("it is 1,2345", "2345", 1.0, "bad-commas-split"),
    ("the ratio is 3/4.", "0.75", 1.0, "last-number-fraction"),
    ("x - 5 = 0 so x is -5", "-5", 1.0, "negative-last"),
    ("#### 41", "42", 0.0, "wrong"),
    ("\\boxed{0.750001}", "3/4", 0.0, "near-miss"),
    ("\\boxed{x+1}", "1", 0.0, "string-vs-number"),
    ("no answer here", "5", 0.0, "nothing"),
    ("\\boxed{1/0}", "1/0", 1.0, "zero-denominator-as-string"),
]


@pytest.mark.parametrize("response,gt,expected", [pytest.param(*c[:3], id=c[3]) for c in REWARD_CASES])
def test_reward_cases(response, gt, expected):
    assert math_reward(response, gt) == expected
    assert reference_math_reward(response, gt) == expected


def test_numeric_ground_truth_and_batch():
    assert math_reward("#### 42", 42) == 1.0
    assert math_reward("#### 42", 42.0) == 1.0
    assert normalize_answer("1,234.50") == Fraction(2469, 2)
    assert normalize_answer(" \\tfrac{-3}{ 4 } ") == Fraction(-3, 4)
    assert normalize_answer("x + 1") == "x+1"
    assert math_rewards(["#### 1", "#### 2"], ["1", "3"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        math_rewards(["a", "b"], ["1"])


# ---------------------------------------------------------------- rewards: fast path vs reference -

_pieces = st.one_of(
    st.sampled_from(
        [
            " ",
            "\n",
            "the answer",
            "x",
            "-",
            ",",
            ".",
            "/",
            "{",
            "}",
            "$",
            "\\!",
            "\\left(",
            "#### ",
            "Answer: ",
        ]
    ),
    st.tuples(st.integers(-99, 99), st.integers(0, 99)).map(lambda t: f"{t[0]}/{t[1]}"),
    st.integers(-50000, 5_000_000).map(str),
    st.integers(1000, 9_999_999).map(lambda n: f"{n:,}"),
    st.text(alphabet="0123456789,./-", min_size=1, max_size=8),
    st.tuples(st.integers(-99, 99), st.integers(0, 99)).map(lambda t: f"\\frac{{{t[0]}}}{{{t[1]}}}"),
    st.tuples(st.integers(0, 999), st.integers(0, 999)).map(lambda t: f"{t[0]}.{t[1]}"),
)
_texts = st.recursive(
    st.lists(_pieces, max_size=8).map("".join),
    lambda inner: st.tuples(inner, inner, st.sampled_from(["\\boxed{", "\\boxed {", "\\fbox{"])).map(
        lambda t: f"{t[0]}{t[2]}{t[1]}}}"
    ),
    max_leaves=4,
)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(_texts, _texts)
def test_fast_path_matches_reference(response, other):
    got, ref = extract_answer(response), reference_extract_answer(response)
    assert got == ref, (response, got, ref)
    for s in (response, other, got or ""):
        assert normalize_answer(s) == reference_normalize_answer(s), s
    gt = other if len(response) % 2 else (got or "0")
    assert math_reward(response, gt) == reference_math_reward(response, gt)


# ---------------------------------------------------------------- loaders --------------------------


def test_gsm8k_chat_template_ids_and_rewards(tmp_path):
    path = _write(tmp_path / "gsm8k.jsonl", GSM8K_ROWS[:1] + [""] + GSM8K_ROWS[1:])
    tok = _tokenizer(chat=True)
    cfg = MathDataConfig(path=path, format="gsm8k", task="gsm8k_math", system_prompt="be brief")
    recs = load_math_jsonl(cfg, tokenizer=tok)
    assert [r.line for r in recs] == [1, 3, 4]
    assert [r.ground_truth for r in recs] == ["5", "1,234", "0.75"]
    assert {r.task for r in recs} == {"gsm8k_math"}
    r0 = recs[0]
    assert r0.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2 + 3 ?"},
    ]
    want = "<|system|> be brief <|end|> <|user|> what is 2 + 3 ? <|end|> <|assistant|> "
    assert r0.prompt_text == want
    vocab = tok.get_vocab()
    assert r0.prompt_ids == [vocab[w] for w in want.split()]
    assert r0.as_dict(task_key="domain")["domain"] == "gsm8k_math"
    # the dataset's own worked answer earns reward 1, a wrong one 0
    for row, rec in zip(GSM8K_ROWS, recs, strict=True):
        assert math_reward(row["answer"], rec.ground_truth) == 1.0
        assert math_reward("#### 999", rec.ground_truth) == 0.0
    # ids are content hashes: stable across runs and under reordering, distinct per record
    # (the configured system prompt and instruction do not enter the id)
    shuffled = load_math_jsonl(
        MathDataConfig(path=_write(tmp_path / "rev.jsonl", GSM8K_ROWS[::-1]), instruction=" Think."),
    )
    assert shuffled[-1].messages == [{"role": "user", "content": "what is 2 + 3 ? Think."}]
    assert {r.id: r.ground_truth for r in shuffled} == {r.id: r.ground_truth for r in recs}
    assert len({r.id for r in recs}) == 3 and all(r.id.startswith("gsm8k-") for r in recs)
    assert len(load_math_jsonl(MathDataConfig(path=path, max_records=2))) == 2


def test_dapo_fallback_template_and_source_ids(tmp_path):
    path = _write(tmp_path / "dapo.jsonl", DAPO_ROWS)
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(MathDataConfig(path="unset")),
            {"path": path, "format": "dapo_math", "id_field": "extra_info.index", "task": "dapo"},
        )
    )
    tok = _tokenizer(chat=False)
    recs = load_math_jsonl(cfg, tokenizer=tok)
    assert [r.id for r in recs] == ["a-0", "17"]
    assert [r.ground_truth for r in recs] == ["5", "\\frac{3}{4}"]
    assert recs[0].prompt_text == "what is 2 + 3 ?\nAnswer:"
    assert recs[1].prompt_text == "be brief\n\nSum of 1/2 and 1/4?\nAnswer:"
    assert recs[0].prompt_ids == tok.encode("what is 2 + 3 ?\nAnswer:", add_special_tokens=False)
    assert math_reward("1/2 + 1/4 = \\boxed{0.75}", recs[1].ground_truth) == 1.0
    assert math_reward("so Answer: 5", recs[0].ground_truth) == 1.0
    # the same records through a chat-template tokenizer
    chat = load_math_jsonl(cfg, tokenizer=_tokenizer(chat=True))
    assert (
        chat[1].prompt_text
        == "<|system|> be brief <|end|> <|user|> Sum of 1/2 and 1/4? <|end|> <|assistant|> "
    )
    assert (
        render_prompt(chat[0].messages, tokenizer=None, fallback_template="Q: {prompt}")
        == "Q: what is 2 + 3 ?"
    )


# ---------------------------------------------------------------- bad input ------------------------


def test_bad_input_names_field_and_line(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="MathDataConfig.path=.*nope.jsonl"):
        load_math_jsonl(MathDataConfig(path=missing))
    bad_json = _write(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], '{"question": "x", "answer": '])
    with pytest.raises(MathDataRecordError, match=r"bad.jsonl:2: malformed JSON"):
        load_math_jsonl(MathDataConfig(path=bad_json))
    no_q = _write(tmp_path / "noq.jsonl", [GSM8K_ROWS[0], GSM8K_ROWS[1], {"answer": "#### 3"}])
    with pytest.raises(MathDataRecordError, match=r"noq.jsonl:3: field 'question' missing"):
        load_math_jsonl(MathDataConfig(path=no_q))
    no_hash = _write(tmp_path / "nohash.jsonl", [{"question": "q", "answer": "just 3"}])
    with pytest.raises(MathDataRecordError, match=r":1: field 'answer' has no '#### <answer>'"):
        load_math_jsonl(MathDataConfig(path=no_hash))
    not_obj = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(MathDataRecordError, match=r":1: expected a JSON object, got list"):
        load_math_jsonl(MathDataConfig(path=not_obj))
    dapo = [DAPO_ROWS[0], {**DAPO_ROWS[1], "reward_model": {"style": "rule"}}]
    no_gt = _write(tmp_path / "nogt.jsonl", dapo)
    with pytest.raises(MathDataRecordError, match=r"nogt.jsonl:2: field 'reward_model.ground_truth' missing"):
        load_math_jsonl(MathDataConfig(path=no_gt, format="dapo_math"))
    bad_msg = _write(tmp_path / "msg.jsonl", [{**DAPO_ROWS[0], "prompt": [{"role": "user"}]}])
    with pytest.raises(MathDataRecordError, match=r"field 'prompt'\[0\] is not a"):
        load_math_jsonl(MathDataConfig(path=bad_msg, format="dapo_math"))
    dup = _write(tmp_path / "dup.jsonl", [DAPO_ROWS[0], DAPO_ROWS[0]])
    with pytest.raises(MathDataConfigError, match=r"id_field='extra_info.index': id 'a-0' repeats"):
        load_math_jsonl(MathDataConfig(path=dup, format="dapo_math", id_field="extra_info.index"))
    no_id = _write(tmp_path / "noid.jsonl", [DAPO_ROWS[0]])
    with pytest.raises(MathDataRecordError, match=r"id field 'extra_info.uid' missing"):
        load_math_jsonl(MathDataConfig(path=no_id, format="dapo_math", id_field="extra_info.uid"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"format": "gsm8"}, r"MathDataConfig.format must be one of .*'gsm8'", id="format"),
        pytest.param({"path": ""}, r"MathDataConfig.path must be a non-empty string", id="path"),
        pytest.param({"task": ""}, r"MathDataConfig.task must be", id="task"),
        pytest.param(
            {"fallback_template": "{question}"}, r"fallback_template must use \{prompt\}", id="tmpl-field"
        ),
        pytest.param({"fallback_template": "{prompt"}, r"fallback_template is not a valid", id="tmpl-syntax"),
        pytest.param({"max_records": 0}, r"MathDataConfig.max_records .* got 0", id="max-records"),
        pytest.param({"id_field": ""}, r"MathDataConfig.id_field", id="id-field"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(MathDataConfigError, match=match):
        MathDataConfig(**{"path": "x.jsonl", **kwargs})


def test_fallback_rejects_assistant_turns():
    with pytest.raises(ValueError, match=r"messages\[1\].role='assistant'"):
        render_prompt(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            tokenizer=None,
            fallback_template="{prompt}",
        )
