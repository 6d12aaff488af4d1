"""Real-data path: JSONL and Parquet with field maps (DAPO-Math-17k and MATH layouts), chat templates, math-verify
rewards on the committed sample, and a short end-to-end run on CPU."""
import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.jsonl import DataFormatError
from megatron_rl.data.sources import apply_chat_template, load_prompts, read_prompts
from megatron_rl.data.tokenizer import CHATML_TEMPLATE, PRINTABLE_ALPHABET, build_char_tokenizer
from megatron_rl.reward import get_reward_fn

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "math_sample"


def _parquet(tmp_path, name="dapo.parquet", source=SAMPLE / "dapo_math.jsonl") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(records), str(tmp_path / name))
    return tmp_path / name


def _data(*overrides):
    return load_config(None, list(overrides)).data


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"), PRINTABLE_ALPHABET, chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("plain"), PRINTABLE_ALPHABET)


def test_dapo_layout_from_jsonl_and_parquet_agree(tmp_path, plain_tokenizer):
    cfg = _data("data.layout=dapo_math_17k")
    from_jsonl = load_prompts(SAMPLE / "dapo_math.jsonl", cfg, plain_tokenizer)
    from_parquet = load_prompts(_parquet(tmp_path), cfg, plain_tokenizer)
    assert len(from_jsonl) == 8
    assert [(r.prompt, r.answer) for r in from_jsonl] == [(r.prompt, r.answer) for r in from_parquet]
    first = from_jsonl[0]
    assert first.answer == "\\frac{5}{6}" and first.prompt.endswith("$\\frac{1}{2} + \\frac{1}{3}$?")
    assert first.meta["messages"][0]["role"] == "user" and first.meta["data_source"] == "megatron_rl_sample"


def test_explicit_nested_keys(tmp_path):
    rows = read_prompts(_parquet(tmp_path), prompt_key="prompt.0.content", answer_key="reward_model.ground_truth")
    assert rows[1].answer == "4" and "2x + 3 = 11" in rows[1].prompt


def test_chat_template_modes(chat_tokenizer, plain_tokenizer):
    rows = read_prompts(SAMPLE / "dapo_math.jsonl", "prompt", "reward_model.ground_truth")
    templated = apply_chat_template(rows, chat_tokenizer, "auto")
    assert templated[0].prompt.startswith("<|im_start|>user\n") and templated[0].prompt.endswith("<|im_start|>assistant\n")
    assert templated[0].meta["raw_prompt"] == rows[0].prompt
    ids = chat_tokenizer(templated[0].prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")  # markers are single special tokens
    assert apply_chat_template(rows, chat_tokenizer, False) == rows
    assert apply_chat_template(rows, plain_tokenizer, "auto") == rows
    with pytest.raises(DataFormatError, match="apply_chat_template=true"):
        apply_chat_template(rows, plain_tokenizer, True)
    plain_prompt = read_prompts(SAMPLE / "math.jsonl", "problem", "solution")
    wrapped = apply_chat_template(plain_prompt, chat_tokenizer, True)  # a string prompt becomes one user message
    assert wrapped[0].prompt == f"<|im_start|>user\n{plain_prompt[0].prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_math_layout_and_math_verify_on_the_sample(plain_tokenizer):
    reward = get_reward_fn("math_answer")
    math_rows = load_prompts(SAMPLE / "math.jsonl", _data("data.layout=math"), plain_tokenizer)
    dapo_rows = load_prompts(SAMPLE / "dapo_math.jsonl", _data("data.layout=dapo_math_17k"), plain_tokenizer)
    right = {"10": "\\boxed{10}", "12": "so it is 12", "3": "Answer: 3", "\\frac{3}{4}": "$\\frac{6}{8}$", "[-1, 3]": "\\boxed{[-1,3]}"}
    for row in math_rows:  # gold = a worked solution; math-verify reads its \boxed{}
        gold = row.answer[row.answer.rindex("\\boxed{") + 7: row.answer.rindex("}")]
        response = right.get(gold, f"The answer is $\\boxed{{{gold}}}$.")
        assert reward(response, row.answer) == (1.0, True), (response, row.answer)
        assert reward("The answer is $\\boxed{99}$.", row.answer) == (0.0, False)
    equivalent = {"\\frac{5}{6}": "Answer: 10/12", "(-2, 2)": "Answer: $(-2,2)$", "5\\sqrt{2}": "Answer: $\\sqrt{50}$"}
    for row in dapo_rows:
        response = equivalent.get(row.answer, f"Answer: {row.answer}")
        assert reward(response, row.answer)[1], (response, row.answer)
    assert not reward("Answer: $[-2, 2]$", "(-2, 2)")[1]  # intervals: closed != open


def test_bad_records_name_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "x"}], "reward_model": {}}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: no field 'reward_model.ground_truth'"):
        read_prompts(bad, "prompt", "reward_model.ground_truth")
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: 'prompt' must be a string or a non-empty list"):
        read_prompts(bad, "prompt", "answer")
    pq_path = _parquet(tmp_path, "math.parquet", SAMPLE / "math.jsonl")
    with pytest.raises(DataFormatError, match=r"math.parquet:row 0: no field 'question'"):
        read_prompts(pq_path, "question", "solution")


def test_field_map_config_validation():
    with pytest.raises(ConfigError, match="data.layout"):
        load_config(None, ["data.layout=math", "data.prompt_key=question"])
    with pytest.raises(ConfigError, match="data.layout"):
        load_config(None, ["data.layout=gsm8k"])
    with pytest.raises(ConfigError, match="data.answer_key"):
        load_config(None, ["data.answer_key=a..b"])
    assert load_config(None, ["data.apply_chat_template=false"]).data.apply_chat_template is False


@pytest.mark.slow
def test_tiny_math_example_runs_end_to_end(tmp_path):
    """examples/configs/tiny_math.yaml on the committed sample: Parquet + chat template + math-verify, one RL step."""
    import subprocess
    import sys

    from rl_runs import cli_env, read_rows

    base = tmp_path / "base"
    subprocess.run([sys.executable, str(SAMPLE / "prepare.py"), str(base)], check=True, env=cli_env(), timeout=120)
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "examples" / "configs" / "tiny_math.yaml"),
           f"run_dir={tmp_path / 'run'}", f"data.train_file={base / 'dapo_math.parquet'}",
           f"data.eval_file={SAMPLE / 'dapo_math.jsonl'}", f"data.tokenizer_dir={base / 'tokenizer'}",
           "sft.steps=2", "train.steps=1", "rollout.n_samples_per_prompt=2", "rollout.sampling.max_new_tokens=8",
           "train.micro_batch_size=4", "train.eval_max_prompts=2", "tracking.progress_bar=false",
           "train.health.max_entropy_frac=null"]  # two SFT steps leave a near-uniform policy: the guard would stop it
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(tmp_path / "run")
    assert len(rows) == 1 and rows[0]["reward/mean"] is not None and "time/rollout" in rows[0]


def test_rows_keep_their_source_through_the_template(chat_tokenizer, tmp_path):
    rows = apply_chat_template(read_prompts(SAMPLE / "math.jsonl", "problem", "solution"), chat_tokenizer, True)
    assert rows[2].source == f"{SAMPLE / 'math.jsonl'}:3"
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataFormatError, match=r"latin1.jsonl:1: not valid UTF-8"):
        read_prompts(bad)
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        read_prompts(tmp_path / "missing.parquet")
