"""One Python, one torch, one NCCL for the learner and the SGLang engines: the GPU image's build step that proves it.

    python tools/check_one_environment.py probe [--import MODULE ...]        # this interpreter's facts, one JSON line
    python tools/check_one_environment.py constraints constraints/cpu.txt [--ours NAME ...] [--need "WHO: REQ" ...] \\
        [--need-setup setup.py]
    python tools/check_one_environment.py check --sglang-python PY --sglang-version V --te-version V \\
        --megatron-core-version V [--baseline FILE]

Why: the `distributed` weight transport puts the learner ranks and the engines' TP ranks into one NCCL group, and
NCCL refuses peers of different versions; the CUDA-IPC handles of the `tensor` transport are opened by the engines'
torch. So the image installs Transformer Engine, megatron-core and this package into the Python SGLang's own image
ships (as slime and miles build theirs), and this script checks the result:

- `probe` prints what an interpreter imports: torch's version and file, its CUDA, the NCCL version torch loads
  (torch.cuda.nccl.version(), no GPU needed), the nvidia-nccl wheel torch pins, and the versions of the modules named
  by --import after importing them. The Dockerfile records the base image's probe before anything is installed.
- `constraints` prints pip constraints that keep every distribution this interpreter already has at its installed
  version (SGLang's torch, NCCL, transformers, ...), and take constraints/cpu.txt's pin only for what is missing;
  `--ours NAME` leaves NAME to cpu.txt (the packages the image installs by pin). So installing the learner stack can
  add packages but never move one SGLang was built with. A package installed later that needs another version of a
  frozen one (`--need`, `--need-setup`) stops it here with that package named (exit 2), not in pip's unexplained
  ResolutionImpossible.
- `check` runs the probe in `--sglang-python` (the interpreter `rollout.sglang_python` names; its default is the
  learner's own) and in this one, and prints one `[PASS]` / `[FAIL]` line per rule: same torch file and version,
  NCCL present and equal to the wheel torch pins, SGLang at the pinned version with its own torch pin met,
  Transformer Engine and megatron-core at their pins and importable, and (`--baseline`) torch and NCCL unchanged
  since the base image's probe. Exit status 1 when a rule fails.

The pins SGLang and torch declare are read from their installed metadata (importlib.metadata), so the check follows
the packages actually present: sglang 0.5.23's wheel requires `torch==2.14.1`, whose wheel requires
`nvidia-nccl-cu13==2.30.7` (their METADATA files).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Iterable, Optional

NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
"""The pip distributions that ship the NCCL a CUDA torch wheel loads (one per CUDA major)."""


def canonical(name: str) -> str:
    """A distribution name as pip compares it (PEP 503: lower case, runs of -_. as one dash)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def base_version(version: str) -> str:
    """A version without its local label (2.14.1+cu130 -> 2.14.1): what a `torch==2.14.1` pin matches."""
    return version.split("+", 1)[0]


def installed_version(name: str) -> Optional[str]:
    """The installed version of distribution `name`, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pinned_version(dist: str, name: str) -> Optional[str]:
    """The exact version distribution `dist` requires of `name` (its `name==X` requirement outside extras), or None."""
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*==\s*([^\s,;]+)\s*", spec)
        if m and canonical(m.group(1)) == canonical(name):
            return m.group(3)
    return None


def nccl_runtime_version() -> tuple[Optional[str], str]:
    """(the NCCL version torch loads as 'major.minor.patch', or None) and why not."""
    import torch

    try:
        ver = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError) as exc:  # a CPU build has no _nccl_version
        return None, f"torch {torch.__version__} has no NCCL ({type(exc).__name__}: {exc})"
    if isinstance(ver, int):  # torch < 1.13 returned one integer
        ver = (ver // 1000, ver // 100 % 10, ver % 100)
    return ".".join(str(v) for v in ver[:3]), ""


def probe(imports: Iterable[str] = ()) -> dict:
    """What this interpreter imports: torch, CUDA, NCCL (runtime and pinned wheel), and each module of `imports`."""
    import torch

    nccl, why = nccl_runtime_version()
    wheel = next((w for w in NCCL_WHEELS if installed_version(w)), None)
    facts = {
        "python": os.path.abspath(sys.executable),
        "torch": torch.__version__,
        "torch_file": os.path.realpath(torch.__file__),
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "nccl_error": why,
        "nccl_wheel": wheel,
        "nccl_wheel_version": installed_version(wheel) if wheel else None,
        "torch_nccl_pin": next(((w, pinned_version("torch", w)) for w in NCCL_WHEELS if pinned_version("torch", w)), None),
        "modules": {},
    }
    for name in imports:
        try:
            module = importlib.import_module(name)
            facts["modules"][name] = {"ok": True, "version": str(getattr(module, "__version__", "")),
                                      "file": os.path.realpath(getattr(module, "__file__", "") or "")}
        except Exception as exc:  # noqa: BLE001 - reported as a fact, judged by `check`
            facts["modules"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return facts


def merge_constraints(installed: dict[str, str], cpu_pins: str, ours: Iterable[str] = ()) -> list[str]:
    """pip constraint lines: every installed distribution at its version, except `ours`; cpu.txt's pin for the rest."""
    ours = {canonical(n) for n in ours}
    keep = {canonical(n): v for n, v in installed.items() if canonical(n) not in ours}
    lines = [f"{name}=={version}" for name, version in sorted(keep.items())]
    for line in cpu_pins.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" not in line:
            continue
        name, version = (s.strip() for s in line.split("==", 1))
        if canonical(name) not in keep:
            lines.append(f"{canonical(name)}=={version}")
    return lines


def _requirement(text: str):
    """A PEP 508 requirement object (packaging's, or pip's vendored copy where packaging is not installed)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries one
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(text)


def freeze_conflicts(installed: dict[str, str], needs: Iterable[str], ours: Iterable[str] = ()) -> list[str]:
    """One line per need ("WHO: REQUIREMENT") whose package the freeze keeps at a version outside the requirement.

    pip would only say ResolutionImpossible; this names the package, the base image's version, who needs what, and
    the two ways out. Packages in `ours` are not frozen, and a need whose package the image lacks is cpu.txt's.
    """
    ours = {canonical(n) for n in ours}
    have = {canonical(n): v for n, v in installed.items()}
    out = []
    for need in needs:
        who, sep, text = need.partition(":")
        who, text = (who.strip(), text.strip()) if sep else ("this install", need.strip())
        req = _requirement(text)
        name = canonical(req.name)
        version = have.get(name)
        if version is None or name in ours or req.specifier.contains(version, prereleases=True):
            continue
        out.append(f"{name}: the base image has {version}, which the freeze keeps (constraints/image.txt); {who} needs "
                   f"{req}: let it move on purpose with --ours {name} (cpu.txt's pin then applies), or install a version of "
                   f"what needs it that accepts {name} {version}")
    return out


def setup_requirements(setup_py: str) -> list[str]:
    """The install_requires strings of a setup.py, read from its source (nothing is executed)."""
    import ast

    with open(setup_py) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires" and isinstance(node.value, ast.List):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def installed_distributions() -> dict[str, str]:
    """name -> version of every distribution this interpreter has (the first one found per name, as import does)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in out:
            out[canonical(name)] = dist.version
    return out


def _run_probe(python: str, imports: Iterable[str]) -> dict:
    """`probe` run in another interpreter (a subprocess of `python`)."""
    exe = shutil.which(python) or python
    cmd = [exe, os.path.abspath(__file__), "probe", *[a for name in imports for a in ("--import", name)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{exe} could not run the probe (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}")
    return json.loads(lines[-1])


def rules(learner: dict, engine: dict, sglang_version: str, te_version: str, megatron_core_version: str,
          baseline: Optional[dict] = None) -> list[tuple[bool, str, str]]:
    """(ok, name, detail) of every rule, from the learner's and the engines' probes (and the base image's)."""
    out = []
    same = (learner["torch_file"], learner["torch"], learner["nccl"]) == (engine["torch_file"], engine["torch"], engine["nccl"])
    out.append((same, "same_torch_and_nccl",
                f"learner {learner['python']}: torch {learner['torch']} ({learner['torch_file']}), NCCL {learner['nccl']}; "
                f"engines {engine['python']}: torch {engine['torch']} ({engine['torch_file']}), NCCL {engine['nccl']}"))
    out.append((learner["nccl"] is not None, "nccl_present",
                f"NCCL {learner['nccl']}" if learner["nccl"] else learner["nccl_error"]))
    pin = learner.get("torch_nccl_pin")
    if pin:
        wheel, want = pin
        # a wheel version may carry a fourth part (2.21.5.post1); NCCL reports major.minor.patch
        ok = learner["nccl_wheel_version"] == want and learner["nccl"] == ".".join(re.findall(r"\d+", want)[:3])
        out.append((ok, "nccl_is_torchs_pin", f"torch pins {wheel}=={want}; installed {learner['nccl_wheel']}=="
                    f"{learner['nccl_wheel_version']}; torch loads NCCL {learner['nccl']}"))
    else:
        out.append((learner["nccl"] is not None, "nccl_is_torchs_pin",
                    f"torch {learner['torch']} pins no nvidia-nccl wheel (NCCL built in); it loads NCCL {learner['nccl']}"))
    sg = engine["modules"].get("sglang", {})
    got = engine.get("sglang_dist")
    out.append((bool(sg.get("ok")) and got == sglang_version, "sglang_version",
                f"sglang {got} installed (pinned {sglang_version}); import: {'ok' if sg.get('ok') else sg.get('error')}"))
    want_torch = engine.get("sglang_torch_pin")
    out.append((want_torch is not None and want_torch == base_version(engine["torch"]), "sglang_torch_pin",
                f"sglang {got} requires torch=={want_torch}; its interpreter has torch {engine['torch']}"))
    for key, module, want in (("transformer_engine", "transformer_engine.pytorch", te_version),
                              ("megatron_core", "megatron.core", megatron_core_version)):
        mod = learner["modules"].get(module, {})
        have = learner.get(f"{key}_dist")
        out.append((bool(mod.get("ok")) and have == want, key,
                    f"{key.replace('_', '-')} {have} installed (pinned {want}); import {module}: "
                    f"{'ok' if mod.get('ok') else mod.get('error')}"))
    if baseline is not None:
        kept = (baseline["torch"], baseline["torch_file"], baseline["nccl"]) == (learner["torch"], learner["torch_file"], learner["nccl"])
        out.append((kept, "base_image_torch_kept",
                    f"base image: torch {baseline['torch']}, NCCL {baseline['nccl']}; now: torch {learner['torch']}, "
                    f"NCCL {learner['nccl']}"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="print this interpreter's torch / NCCL / module facts as one JSON line")
    pr.add_argument("--import", dest="imports", action="append", default=[], help="also import MODULE and record its version")
    co = sub.add_parser("constraints", help="pip constraints: installed versions first, then CPU_TXT's pins")
    co.add_argument("cpu_txt")
    co.add_argument("--ours", action="append", default=[], help="a distribution the image installs by its own pin")
    co.add_argument("--need", action="append", default=[],
                    help='"WHO: REQUIREMENT" a package installed later needs; a frozen version outside it is named, exit 2')
    co.add_argument("--need-setup", help="a setup.py whose install_requires are needs too")
    ch = sub.add_parser("check", help="learner and engines import one torch and one NCCL; one line per rule")
    ch.add_argument("--sglang-python", default=sys.executable, help="the interpreter rollout.sglang_python names")
    ch.add_argument("--sglang-version", required=True)
    ch.add_argument("--te-version", required=True)
    ch.add_argument("--megatron-core-version", required=True)
    ch.add_argument("--baseline", help="the base image's `probe` output, recorded before the learner stack went in")
    args = p.parse_args(argv)

    if args.cmd == "probe":
        facts = probe(args.imports)
        facts["sglang_dist"] = installed_version("sglang")
        facts["sglang_torch_pin"] = pinned_version("sglang", "torch")
        facts["transformer_engine_dist"] = installed_version("transformer-engine")
        facts["megatron_core_dist"] = installed_version("megatron-core")
        print(json.dumps(facts))
        return 0
    if args.cmd == "constraints":
        installed = installed_distributions()
        needs = list(args.need)
        if args.need_setup:
            needs += [f"{args.need_setup} install_requires: {r}" for r in setup_requirements(args.need_setup)]
        conflicts = freeze_conflicts(installed, needs, args.ours)
        for line in conflicts:
            print(f"freeze conflict: {line}", file=sys.stderr)
        if conflicts:
            return 2
        with open(args.cpu_txt) as f:
            print("\n".join(merge_constraints(installed, f.read(), args.ours)))
        return 0
    try:
        engine = _run_probe(args.sglang_python, ["sglang"])
        learner = _run_probe(sys.executable, ["transformer_engine.pytorch", "megatron.core"])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"[FAIL] probe {exc}")
        return 1
    baseline = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.loads(f.read().strip().splitlines()[-1])
    results = rules(learner, engine, args.sglang_version, args.te_version, args.megatron_core_version, baseline)
    for ok, name, detail in results:
        print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)
    failed = [name for ok, name, _ in results if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
