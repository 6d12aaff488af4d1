"""Bad config values and paths are one `error:` line naming the field (or file:line), exit code 2, and nothing
written: checked through the real `megatron-rl` CLI in a subprocess; the loaders behind it are checked in process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_runs import CONFIG, cli_env

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.yaml_io import YAMLInputError, load_yaml
from megatron_rl.study import load_study
from megatron_rl.study.spec import StudyError


def _fails_cleanly(tmp_path: Path, *args: str) -> str:
    """Run `megatron-rl ARGS` in tmp_path/cwd; assert exit 2, exactly one stderr line `error: ...`, nothing written
    under tmp_path/cwd; return that line."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert not any(cwd.iterdir()), f"left behind: {sorted(cwd.rglob('*'))}"
    return lines[0]


def _fake_warm_start(sft_dir: Path, **model) -> None:
    """sft_dir/hf as a finished warm start of the tiny model with `model` overrides (config.json; the weights are never read)."""
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.presets import hf_config, resolve_architecture

    base = load_config(CONFIG).model.model_dump(exclude_none=True)
    arch = resolve_architecture(ModelConfig(**{**base, **model}), vocab_size=64)
    hf_config(arch).save_pretrained(sft_dir / "hf")
    (sft_dir / "hf" / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize("command,tp", [("config", 3), ("train", 8)])
def test_tensor_parallel_size_that_does_not_split_the_heads(tmp_path, command, tp):
    line = _fails_cleanly(tmp_path, command, str(CONFIG), "run_dir=run", f"parallel.tensor_model_parallel_size={tp}")
    assert f"model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size={tp}" in line


def test_missing_init_checkpoint(tmp_path):
    missing = tmp_path / "no_such_model"
    line = _fails_cleanly(tmp_path, "train", str(CONFIG), "run_dir=run", f"model.init_checkpoint={missing}")
    assert line == f"error: model.init_checkpoint={missing}: no such file or directory"


def test_warm_start_of_another_architecture_names_the_fields_that_differ(tmp_path):
    _fake_warm_start(tmp_path / "other_sft", num_layers=3, hidden_size=64)
    line = _fails_cleanly(tmp_path, "train", str(CONFIG), "run_dir=run", f"sft.output_dir={tmp_path / 'other_sft'}")
    assert f"sft.output_dir={tmp_path / 'other_sft'}" in line and "holds another architecture" in line
    assert "num_layers=3 there but 2 here (model.num_layers)" in line
    assert "hidden_size=64 there but 128 here (model.hidden_size)" in line and "ffn_hidden_size" not in line


def test_duplicate_key_in_a_base_config(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(f"base: {CONFIG}\noptim:\n  lr: 1.0e-4\n  clip_grad: 1.0\n  lr: 1.0\n")
    top = tmp_path / "top.yaml"
    top.write_text("base: base.yaml\ntrain: {steps: 2}\n")
    line = _fails_cleanly(tmp_path, "train", str(top), "run_dir=run")
    assert line == f"error: {base}:5: duplicate key 'lr' (first at line 3; YAML keys must be unique)"


def test_malformed_data_file_with_a_generated_tokenizer_leaves_no_run_directory(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": \n')
    line = _fails_cleanly(tmp_path, "train", str(CONFIG), "run_dir=run", f"data.train_file={data}")
    assert line.startswith(f"error: {data}:2: invalid JSON")


def test_a_row_the_warm_start_teacher_cannot_rewrite_leaves_no_run_directory(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "7-2=", "answer": "5"}\n')
    line = _fails_cleanly(tmp_path, "train", str(CONFIG), "run_dir=run", f"data.train_file={data}", "sft.teacher_carry_drop=0.6")
    assert line.startswith(f"error: {data}:2: sft.teacher_carry_drop needs addition rows")


def test_duplicate_keys_are_errors_everywhere_yaml_is_read(tmp_path):
    with pytest.raises(YAMLInputError, match=r"^spec\.yaml:3: duplicate key 'b' \(first at line 2"):
        load_yaml("a: 1\nb: {x: 1}\nb: 2\n", "spec.yaml")
    with pytest.raises(YAMLInputError, match=r"^f:2: duplicate key 'x'"):
        load_yaml("outer:\n  - {x: 1, x: 2}\n", "f")
    assert load_yaml("a: &d {x: 1}\nb:\n  <<: *d\n  y: 2\n") == {"a": {"x": 1}, "b": {"x": 1, "y": 2}}  # merge keys stay
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        load_config(None, ["train={steps: 1, steps: 2}"])
    spec = tmp_path / "study.yaml"
    spec.write_text(f"base: {CONFIG}\noutput_dir: {tmp_path / 'out'}\nsteps: 2\nsteps: 3\narms: [{{name: a}}]\n")
    with pytest.raises(StudyError, match=f"^{spec}:4: duplicate key 'steps'"):
        load_study(spec)
    with pytest.raises(ConfigError, match=r"bad\.yaml:2: not valid YAML: expected ',' or ']'") as info:
        (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
        load_config(tmp_path / "bad.yaml")
    assert "\n" not in str(info.value)
    # what the project writes, it reads back
    cfg = load_config(CONFIG)
    assert load_yaml(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)) == cfg.model_dump(mode="json")


def test_engine_names_mismatched_tensors_in_its_own_message(tmp_path):
    """A config.json that does not match its tensors is refused with every mis-shaped tensor and both shapes."""
    import transformers

    from megatron_rl.models.presets import get_preset, hf_config
    from megatron_rl.engine.generation import load_hf_model

    config = hf_config(get_preset("tiny"))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**meta, "intermediate_size": 64}))
    with pytest.raises(ValueError) as info:
        load_hf_model(str(tmp_path / "m"))
    message = str(info.value)
    assert "does not match its config.json" in message and "report" not in message
    assert "model.layers.0.mlp.gate_proj.weight is [128, 64] in the checkpoint but [64, 64] by config.json" in message
