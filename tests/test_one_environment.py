"""tools/check_one_environment.py, the GPU image's proof that learner and engines import one torch and one NCCL: its
rules on probes of two interpreters, the constraints that keep the SGLang image's packages, and the command on this
CPU box (where the NCCL rules must fail: a CPU torch has no NCCL). The real SGLang 0.5.23 metadata is read in
tests/conformance/test_conformance_one_environment.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_one_environment.py"
sys.path.insert(0, str(ROOT / "tools"))

import check_one_environment as one  # noqa: E402

PINS = dict(sglang_version="0.5.23", te_version="2.20.2", megatron_core_version="0.16.1")


def image_probe(**changes) -> dict:
    """A probe as the GPU image's python3 would print it (sglang 0.5.23 on torch 2.14.1 with its NCCL wheel)."""
    facts = {"python": "/usr/bin/python3", "torch": "2.14.1+cu130", "torch_file": "/usr/lib/python3/torch/__init__.py",
             "cuda": "13.0", "nccl": "2.30.7", "nccl_error": "", "nccl_wheel": "nvidia-nccl-cu13",
             "nccl_wheel_version": "2.30.7", "torch_nccl_pin": ["nvidia-nccl-cu13", "2.30.7"],
             "modules": {"sglang": {"ok": True}, "transformer_engine.pytorch": {"ok": True}, "megatron.core": {"ok": True}},
             "sglang_dist": "0.5.23", "sglang_torch_pin": "2.14.1", "transformer_engine_dist": "2.20.2",
             "megatron_core_dist": "0.16.1"}
    facts.update(changes)
    return facts


def verdicts(learner: dict, engine: dict, baseline=None) -> dict[str, bool]:
    return {name: ok for ok, name, _ in one.rules(learner, engine, **PINS, baseline=baseline)}


def test_the_image_passes_every_rule():
    img = image_probe()
    got = verdicts(img, img, baseline=img)
    assert got == {"same_torch_and_nccl": True, "nccl_present": True, "nccl_is_torchs_pin": True, "sglang_version": True,
                   "sglang_torch_pin": True, "transformer_engine": True, "megatron_core": True,
                   "base_image_torch_kept": True}


@pytest.mark.parametrize("engine_changes,failing", [
    # the old image: SGLang in a virtual environment with its own torch and NCCL, the learner on NGC's
    (dict(torch_file="/opt/sglang/lib/python3.12/site-packages/torch/__init__.py"), {"same_torch_and_nccl"}),
    (dict(nccl="2.27.3"), {"same_torch_and_nccl"}),
    (dict(sglang_dist="0.5.8"), {"sglang_version"}),
    (dict(sglang_torch_pin="2.13.0"), {"sglang_torch_pin"}),
    (dict(modules={"sglang": {"ok": False, "error": "ImportError: libcuda.so.1"}}), {"sglang_version"}),
])
def test_a_second_environment_or_a_wrong_pin_fails_its_rule(engine_changes, failing):
    got = verdicts(image_probe(), image_probe(**engine_changes))
    assert {name for name, ok in got.items() if not ok} == failing


def test_nccl_rules():
    # torch loads another NCCL than the wheel it pins (a system libnccl first on the library path)
    assert not verdicts(image_probe(nccl="2.21.5"), image_probe(nccl="2.21.5"))["nccl_is_torchs_pin"]
    assert not verdicts(image_probe(nccl_wheel_version="2.29.1"), image_probe())["nccl_is_torchs_pin"]
    # a torch that builds NCCL in (no nvidia-nccl requirement) passes on its runtime version alone
    built_in = image_probe(torch_nccl_pin=None, nccl_wheel=None, nccl_wheel_version=None)
    assert verdicts(built_in, built_in)["nccl_is_torchs_pin"]
    no_nccl = image_probe(nccl=None, nccl_error="CPU build", torch_nccl_pin=None)
    assert {n for n, ok in verdicts(no_nccl, no_nccl).items() if not ok} == {"nccl_present", "nccl_is_torchs_pin"}


def test_installing_the_learner_must_not_move_torch():
    moved = image_probe(torch="2.13.0+cu130", torch_file="/usr/lib/python3/torch/__init__.py")
    got = verdicts(moved, moved, baseline=image_probe())
    assert not got["base_image_torch_kept"] and not got["sglang_torch_pin"]
    assert not verdicts(image_probe(), image_probe(), baseline=image_probe(nccl="2.27.3"))["base_image_torch_kept"]


def test_te_and_megatron_core_pins():
    got = verdicts(image_probe(transformer_engine_dist="2.8.0", megatron_core_dist="0.19.2"), image_probe())
    assert not got["transformer_engine"] and not got["megatron_core"]
    broken = image_probe(modules={"transformer_engine.pytorch": {"ok": False, "error": "undefined symbol"},
                                  "megatron.core": {"ok": True}})
    assert not verdicts(broken, image_probe())["transformer_engine"]


def test_constraints_keep_the_images_versions():
    installed = {"torch": "2.14.1+cu130", "transformers": "5.19.0", "Nvidia_NCCL_cu13": "2.30.7", "sglang-router": "0.2.0"}
    cpu = "# comment\ntorch==2.13.0\ntransformers==5.24.0\npyarrow==26.0.1  # not in the image\nsglang-router==0.3.2\n"
    lines = one.merge_constraints(installed, cpu, ours=["sglang-router"])
    assert "torch==2.14.1+cu130" in lines and "transformers==5.19.0" in lines and "nvidia-nccl-cu13==2.30.7" in lines
    assert "pyarrow==26.0.1" in lines and "sglang-router==0.3.2" in lines
    assert not any(ln in lines for ln in ("torch==2.13.0", "transformers==5.24.0", "sglang-router==0.2.0"))
    names = [ln.split("==")[0] for ln in lines]
    assert len(names) == len(set(names))


def test_pinned_version_reads_installed_metadata():
    # pydantic pins its pydantic-core exactly (the `==` requirement is what the tool reads of sglang and torch)
    assert one.pinned_version("pydantic", "pydantic_core") == one.installed_version("pydantic-core") is not None
    # megatron-core 0.16.1 requires torch>=2.6.0: no exact pin; an unknown distribution has none either
    assert one.pinned_version("megatron-core", "torch") is None
    assert one.pinned_version("no-such-distribution", "torch") is None


def test_check_command_on_this_cpu_box(tmp_path):
    """The command end to end: this venv against itself passes the same-torch rule and fails the NCCL and SGLang
    ones; an engine interpreter with another torch fails the same-torch rule."""
    args = [sys.executable, str(TOOL), "check", "--sglang-version", "0.5.23", "--te-version", "2.20.2",
            "--megatron-core-version", "0.16.1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    status = {ln.split()[1]: ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("[")}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert status["same_torch_and_nccl"] == "[PASS]"
    assert status["nccl_present"] == status["sglang_version"] == "[FAIL]"
    assert status["megatron_core"] == "[PASS]"

    other = tmp_path / "python"  # an interpreter whose probe reports another torch (a second environment)
    fake = dict(image_probe(), python=str(other))
    other.write_text(f"#!/bin/sh\necho '{json.dumps(fake)}'\n")
    other.chmod(0o755)
    proc = subprocess.run([*args, "--sglang-python", str(other)], capture_output=True, text=True, timeout=300)
    line = next(ln for ln in proc.stdout.splitlines() if "same_torch_and_nccl" in ln)
    assert line.startswith("[FAIL]") and "2.14.1+cu130" in line, proc.stdout
    proc = subprocess.run([*args, "--sglang-python", str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout.startswith("[FAIL] probe"), proc.stdout


def test_a_frozen_version_a_later_install_cannot_use_is_named():
    """The freeze keeps the base image's versions; a package installed later that needs another one is named with both
    versions and who needs it, instead of pip's bare ResolutionImpossible."""
    installed = {"packaging": "23.2", "torch": "2.14.1+cu130", "numpy": "2.3.1"}
    needs = ["megatron-core 0.16.1: packaging>=24.2", "megatron-core 0.16.1: torch>=2.6.0", "setup.py: numpy>=1.26",
             "setup.py: rich>=13"]  # rich: not in the image, cpu.txt's pin applies
    (line,) = one.freeze_conflicts(installed, needs)
    assert line.startswith("packaging: the base image has 23.2") and "megatron-core 0.16.1 needs packaging>=24.2" in line
    assert "--ours packaging" in line
    assert one.freeze_conflicts(installed, needs, ours=["packaging"]) == []  # moved on purpose: not frozen
    assert one.freeze_conflicts({"torch": "2.5.1"}, ["megatron-core: torch>=2.6.0"])[0].startswith("torch: ")


def test_the_constraints_command_stops_on_a_conflict(tmp_path):
    from importlib.metadata import version

    setup = tmp_path / "setup.py"
    setup.write_text('from setuptools import setup\nsetup(name="x", install_requires=["pyyaml>=6", "rich>=1000"])\n')
    assert one.setup_requirements(str(setup)) == ["pyyaml>=6", "rich>=1000"]
    cmd = [sys.executable, str(TOOL), "constraints", str(ROOT / "constraints" / "cpu.txt"), "--need-setup", str(setup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"freeze conflict: rich: the base image has {version('rich')}" in proc.stderr and "rich>=1000" in proc.stderr
    ok = subprocess.run(cmd[:-2] + ["--need", "x: pyyaml>=6"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "pyyaml==" in ok.stdout
