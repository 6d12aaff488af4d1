"""Prompt data: JSONL errors name file and line, tasks are held out and verifiable, tokenizer round-trips."""
import json
import random

import pytest

from megatron_rl.config.data import DataConfig
from megatron_rl.data.jsonl import DataFormatError, PromptRow, read_jsonl, write_jsonl
from megatron_rl.data.prepare import prepare_task_data
from megatron_rl.data.tasks import generate, get_task
from megatron_rl.data.tokenizer import build_char_tokenizer, check_encodable, load_tokenizer
from megatron_rl.reward import get_reward_fn


def test_jsonl_round_trip_keeps_extra_keys(tmp_path):
    rows = [PromptRow("1+1=", "2", {"task": "addition", "level": 1}), PromptRow("2+2=", 4)]
    path = tmp_path / "d.jsonl"
    assert write_jsonl(path, rows) == 2
    back = read_jsonl(path)
    assert [(r.prompt, r.answer, r.meta) for r in back] == [(r.prompt, r.answer, r.meta) for r in rows]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "1+1=", "answer": "2"', "invalid JSON"),
        ('{"answer": "2"}', "missing required key 'prompt'"),
        ('{"prompt": "", "answer": "2"}', "non-empty string"),
        ('[1, 2]', "expected a JSON object"),
    ],
)
def test_malformed_line_reports_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n' + bad_line + "\n")
    with pytest.raises(DataFormatError) as exc:
        read_jsonl(path)
    assert f"{path}:3" in str(exc.value) and message in str(exc.value)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "1+1=", "answer": null}', "'answer' is null"),
        ('{"prompt": "1+1=", "answer": [2]}', "'answer' must be a string or a number, got a JSON array"),
        ('{"prompt": "1+1=", "answer": {"v": 2}}', "'answer' must be a string or a number, got a JSON object"),
        ('{"prompt": "1+1=", "answer": NaN}', "'answer' is nan"),
    ],
)
def test_null_and_non_scalar_answers_are_rejected(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n' + bad_line + "\n")
    with pytest.raises(DataFormatError) as exc:
        read_jsonl(path)
    assert str(exc.value).startswith(f"{path}:2: ") and message in str(exc.value)


def test_non_utf8_byte_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataFormatError, match=rf"{path}:2: not valid UTF-8 \(byte 0xe9"):
        read_jsonl(path)


def test_characters_outside_the_vocabulary_name_file_and_line(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok")
    path = tmp_path / "d.jsonl"
    lines = ['{"prompt": "%d+1=", "answer": "%d"}' % (i, i + 1) for i in range(50)]
    lines[37] = '{"prompt": "7#1=", "answer": "8"}'
    path.write_text("\n".join(lines) + '\n{"prompt": "1+1=", "answer": "\u00bd"}\n')
    rows = read_jsonl(path)
    check_encodable(tok, rows[:37])
    with pytest.raises(DataFormatError, match=rf"{path}:38: prompt has characters outside the tokenizer's vocabulary: '#'"):
        check_encodable(tok, rows, batch_size=16)
    with pytest.raises(DataFormatError, match=rf"{path}:51: answer has characters outside .*'\u00bd'"):
        check_encodable(tok, rows[38:])


def test_missing_data_files_name_the_field(tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.runtime import load_datasets

    cfg = load_config(None, [f"data.train_file={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(DataFormatError, match=r"data\.train_file: file not found: .*nope\.jsonl"):
        load_datasets(cfg, tmp_path)
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config(None, [f"data.train_file={tmp_path / 't.jsonl'}", f"data.tokenizer_dir={tmp_path / 'no_tok'}",
                             "data.num_eval_prompts=0"])
    with pytest.raises(DataFormatError, match=r"data\.tokenizer_dir: directory not found"):
        load_datasets(cfg, tmp_path)
    (tmp_path / "no_tok").mkdir()
    with pytest.raises(DataFormatError, match=r"data\.tokenizer_dir: no tokenizer\.json"):
        load_datasets(cfg, tmp_path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="no rows"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "nope.jsonl")


def test_addition_answers_are_correct_and_values_uniform():
    rows = generate("addition", 500, seed=3, min_digits=1, max_digits=2)
    assert len({r.prompt for r in rows}) == 500
    for r in rows:
        a, b = r.prompt[:-1].split("+")
        assert int(r.answer) == int(a) + int(b)
    # Uniform values: one-digit operands are about 10% of draws, not 50% (uniform digit counts).
    small = sum(int(r.prompt.split("+")[0]) < 10 for r in rows) / len(rows)
    assert small < 0.2


def test_held_out_rows_never_appear_in_training(tmp_path):
    paths = prepare_task_data(DataConfig(num_train_prompts=300, num_eval_prompts=50), tmp_path)
    train = {r.prompt for r in read_jsonl(paths["train"])}
    evals = {r.prompt for r in read_jsonl(paths["eval"])}
    assert len(evals) == 50 and not (train & evals)


def test_unknown_task_and_impossible_request():
    with pytest.raises(KeyError, match="valid tasks"):
        get_task("poetry")
    with pytest.raises(ValueError, match="cannot produce"):
        generate("addition", 200, seed=0, min_digits=1, max_digits=1)  # only 100 distinct prompts exist


def test_char_tokenizer_round_trip(tmp_path):
    build_char_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    text = "12+345=357"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3


def test_rewards():
    exact = get_reward_fn("exact_match")
    assert exact(" 42 ", "42") == (1.0, True) and exact("41", "42") == (0.0, False) and exact("", "42")[1] is False
    math_answer = get_reward_fn("math_answer")
    assert math_answer("so the answer is \\boxed{1,234}", 1234)[1]
    assert math_answer("I think 3 then 7", "7")[1] and not math_answer("no number", "7")[1]
    with pytest.raises(KeyError, match="valid rewards"):
        get_reward_fn("vibes")
