"""docs/config.md is the rendered config reference, and every config field's doc stays short."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.config.reference import MAX_DOC_CHARS, REGENERATE, render_reference, walk_fields

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_the_rendered_reference():
    assert PAGE.exists(), f"docs/config.md is missing; write it with: {REGENERATE}"
    assert PAGE.read_text() == render_reference(), (
        f"docs/config.md differs from the config classes (megatron_rl/config/*.py); regenerate it with: {REGENERATE}")


def test_reference_lists_every_field_with_its_doc():
    page = render_reference()
    fields = list(walk_fields(RunConfig))
    assert len(fields) > 150  # the walk finds the fields (a broken walk would pass vacuously)
    for name, field in fields:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} has no row in the reference"
        assert " ".join((field.description or "").split()).replace("|", "\\|") in row, name
    for section in ("rollout", "train", "algo", "precision", "algo.calibration", "rollout.weight_sync"):
        assert f"`{section}`" in page and re.search(rf"^#+ `{re.escape(section)}`$", page, re.M), section


def test_reference_shows_types_defaults_and_ranges():
    rows = {line.split(" | ")[0][3:-1]: line for line in render_reference().splitlines() if line.startswith("| `")}
    assert rows["train.steps"] == (
        "| `train.steps` | `int` | `50` | `>= 1` | " + RunConfig.model_fields["train"].annotation.model_fields["steps"].description + " |")
    assert '`"none", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"`' in rows["precision.recipe"]
    assert "`>= 0, < 1`" in rows["algo.calibration.smoothing"]
    assert "`int \\| None`" in rows["model.num_layers"] and "`null`" in rows["model.num_layers"]


def test_every_field_doc_is_at_most_300_characters():
    long = {name: len(field.description or "") for name, field in walk_fields(RunConfig)
            if len(field.description or "") > MAX_DOC_CHARS}
    assert not long, (f"config field docstrings over {MAX_DOC_CHARS} characters (say what the field does and its range "
                      f"in at most 2 sentences; the why goes into the docs): {long}")


def test_cli_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "config", "--reference"], capture_output=True,
                         text=True, check=True).stdout
    assert out == render_reference()
