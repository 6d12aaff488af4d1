"""Conformance with Transformer Engine (pinned in constraints/conformance.txt) and megatron-core (constraints/cpu.txt).

(f) Everything megatron_rl/precision/te.py takes from TE (recipe classes and their constructor keywords, Format
    members, recipe fields it reads, autocast / fp8_autocast keywords, the NVTE_* variables the launcher exports)
    exists in the pinned TE. TE needs CUDA to import, so both sides are read as source: te.py's own uses are
    collected from its AST (a new use is checked without editing this test), TE's definitions from the Python files
    of its pure-Python wheel.
(g) megatron-core's TransformerConfig builds, with the FP8/FP4 fields te.py gives it, for every recipe the
    precision config accepts, through the project's own build_transformer_config (GPU path, no CUDA needed).

Run: pytest -q tests/conformance/test_conformance_te_megatron.py
"""
from __future__ import annotations

import ast
import typing
from pathlib import Path
from typing import Optional

import pytest

from conformance_packages import ConformanceSetupError, pins, te_source, trainer_pin
from megatron_rl.config.precision import PrecisionConfig

pytestmark = pytest.mark.conformance
ROOT = Path(__file__).resolve().parents[2]
TE_PY = ROOT / "megatron_rl" / "precision" / "te.py"


@pytest.fixture(scope="module")
def te_root() -> Path:
    try:
        return te_source()
    except ConformanceSetupError as exc:
        pytest.fail(str(exc), pytrace=False)


# ------------------------------------------------------------------------------------------------ te.py's uses
def te_uses(source: str) -> list[tuple[str, list[str], list[str]]]:
    """(TE module, attribute chain, keyword names) for every TE name te.py reads or calls."""
    tree = ast.parse(source)
    alias: dict[str, tuple[str, list[str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("transformer_engine") and a.asname:
                    alias[a.asname] = (a.name, [])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer_engine"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                # `from transformer_engine.common import recipe` names a module; otherwise a member of node.module
                alias[a.asname or a.name] = (sub, []) if a.name == "recipe" else (node.module, [a.name])

    def chain(node) -> Optional[tuple[str, list[str]]]:
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in alias:
            module, base = alias[node.id]
            return module, base + attrs[::-1]
        return None

    uses, seen = [], set()
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and not isinstance(getattr(node, "ctx", None), ast.Store):
            found = chain(node)
            if found is None or not found[1]:
                continue
            call = calls.get(id(node))
            kwargs = sorted(k.arg for k in call.keywords if k.arg) if call else []
            key = (found[0], tuple(found[1]), tuple(kwargs))
            if key not in seen:
                seen.add(key)
                uses.append((found[0], found[1], kwargs))
    # drop prefixes of longer chains (te.Float8BlockScaling is covered by te.Float8BlockScaling.fp8_quant_fwd_inp)
    return [u for u in uses if u[2] or not any(v[0] == u[0] and len(v[1]) > len(u[1]) and v[1][:len(u[1])] == u[1]
                                               for v in uses)]


class TeSource:
    """Definitions in TE's Python source, followed through `from X import Y` re-exports."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, name: str) -> Optional[Path]:
        path = self.root / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        return path if name.startswith("transformer_engine") and path.is_file() else None

    def module(self, name: str) -> ast.Module:
        return ast.parse(self._path(name).read_text())

    def lookup(self, module: str, name: str):
        """The ClassDef / FunctionDef `name` of TE's `module`, following re-exports (None outside TE's source)."""
        if self._path(module) is None:
            return None
        tree = self.module(module)
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return node
        package = module if self._path(module).name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                real = next(a.name for a in node.names if (a.asname or a.name) == name)
                if node.level == 0:
                    target = node.module or ""
                else:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                return self.lookup(target, real)
        return None

    def members(self, cls: ast.ClassDef, module: str) -> dict[str, Optional[ast.expr]]:
        """Field / member name -> its value expression, bases included."""
        out: dict[str, Optional[ast.expr]] = {}
        for base in cls.bases:
            found = self.lookup(module, ast.unparse(base)) if isinstance(base, ast.Name) else None
            if isinstance(found, ast.ClassDef):
                out.update(self.members(found, module))
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt.value
            elif isinstance(stmt, ast.Assign):
                out.update({t.id: stmt.value for t in stmt.targets if isinstance(t, ast.Name)})
        return out

    def check(self, module: str, attrs: list[str], kwargs: list[str]) -> list[str]:
        """Problems with using module.attrs[0].attrs[1]...(**kwargs)."""
        node = self.lookup(module, attrs[0])
        where = f"{module}.{'.'.join(attrs)}"
        if node is None:
            return [f"{where}: {attrs[0]} is not defined in {module}"]
        for attr in attrs[1:]:
            if not isinstance(node, ast.ClassDef):
                return [f"{where}: {attr} read from something that is not a class"]
            members = self.members(node, module)
            if attr not in members:
                return [f"{where}: {node.name} has no member {attr}"]
            value = members[attr]
            node = self.lookup(module, ast.unparse(value.func)) if isinstance(value, ast.Call) else value
        if kwargs:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) \
                if isinstance(node, ast.ClassDef) else None
            if init is not None:  # a class with its own constructor (TE's autocast): its parameters
                accepted = {a.arg for a in init.args.args + init.args.kwonlyargs}
            elif isinstance(node, ast.ClassDef):  # a dataclass (the recipes): its fields
                accepted = set(self.members(node, module))
            elif isinstance(node, ast.FunctionDef):
                accepted = {a.arg for a in node.args.args + node.args.kwonlyargs}
            else:
                return [f"{where} is not callable"]
            return [f"{where}: no keyword {k}" for k in kwargs if k not in accepted]
        return []


def test_te_py_uses_only_what_the_pinned_te_defines(te_root):
    uses = te_uses(TE_PY.read_text())
    names = {".".join(u[1]) for u in uses}
    # the collector sees what te.py does today (a use it missed would go unchecked)
    assert {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
            "Format.E4M3", "Format.HYBRID", "Float8BlockScaling.fp8_quant_fwd_inp.power_2_scale",
            "NVFP4BlockScaling.disable_rht", "autocast", "fp8_autocast"} <= names, names
    te = TeSource(te_root)
    problems = [p for module, attrs, kwargs in uses for p in te.check(module, attrs, kwargs)]
    assert not problems, problems


def test_the_te_check_can_fail(te_root):
    te = TeSource(te_root)
    assert te.check("transformer_engine.common.recipe", ["DelayedScaling"], ["margin", "amax_history_len"]) == []
    assert te.check("transformer_engine.common.recipe", ["DelayedScaling"], ["no_such_kw"]) != []
    assert te.check("transformer_engine.common.recipe", ["NoSuchRecipe"], []) != []
    assert te.check("transformer_engine.pytorch", ["autocast"], ["fp8_recipe"]) != [], "autocast takes recipe="


def test_launcher_variables_are_read_by_the_pinned_te(te_root):
    from megatron_rl.precision import te as te_map

    recipe_src = (te_root / "transformer_engine" / "common" / "recipe" / "__init__.py").read_text()
    exported = {n for cfg in (PrecisionConfig(recipe="blockwise"),
                              PrecisionConfig(recipe="nvfp4", fp4_hadamard_wgrad=False, fp4_stochastic_rounding=False))
                for n in te_map.launcher_env(cfg)}
    assert exported == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"}
    for name in exported:
        assert f'os.getenv("{name}"' in recipe_src, name
    version = (te_root / "transformer_engine-{}.dist-info".format(pins()["transformer-engine"])).exists()
    assert version, "the unpacked TE is the pinned version"


# ------------------------------------------------------------------------------------------------ (g) megatron
def _recipes() -> list[PrecisionConfig]:
    out = []
    for recipe in typing.get_args(PrecisionConfig.model_fields["recipe"].annotation):
        for fmt in ("e4m3", "hybrid"):
            k = 0 if recipe in ("delayed", "none") else 1
            kw = {"recipe": recipe, "fp8_format": fmt, "first_last_layers_high_precision": k}
            if recipe == "nvfp4":
                kw.update(fp4_hadamard_wgrad=False)
            out.append(PrecisionConfig(**kw))
    return out


@pytest.mark.parametrize("precision", _recipes(), ids=lambda p: f"{p.recipe}-{p.fp8_format}")
def test_transformer_config_builds_for_every_recipe(precision):
    import megatron.core

    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.models.presets import resolve_architecture
    from megatron_rl.trainer.model import build_transformer_config

    assert megatron.core.__version__ == trainer_pin("megatron-core")
    arch = resolve_architecture(ModelConfig(preset="tiny"), 64)
    build = lambda: build_transformer_config(arch, ParallelConfig(), OptimConfig(params_dtype="bf16"), precision, on_gpu=True)  # noqa: E731
    if precision.recipe == "mxfp4":  # a CPU emulation only: refused with its field named, never handed to megatron
        with pytest.raises(ValueError, match="precision.recipe=mxfp4"):
            build()
        return
    tc = build()
    if precision.recipe == "none":
        assert tc.fp8 is None and tc.fp4 is None
    elif precision.recipe == "nvfp4":
        assert (tc.fp4, tc.fp4_recipe, tc.fp8) == ("e2m1", "nvfp4", None)
    else:
        assert (tc.fp8, tc.fp8_recipe) == (precision.fp8_format, precision.recipe)
    assert tc.first_last_layers_bf16 == (precision.first_last_layers_high_precision > 0)


# ------------------------------------------------------------------------------------------------ (h) capability
def _te_support_functions(te_root: Path) -> dict:
    """TE's own `_compute_*_support` functions, executed against a stated device (no CUDA: their inputs are stubbed)."""
    source = (te_root / "transformer_engine" / "pytorch" / "quantization.py").read_text()
    tree = ast.parse(source)
    wanted = {"_compute_fp8_support": "fp8", "_compute_fp8_block_scaling_support": "blockwise",
              "_compute_mxfp8_support": "mxfp8", "_compute_nvfp4_support": "nvfp4"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in funcs} == set(wanted), "the pinned TE decides support in these functions"
    return {wanted[f.name]: ast.unparse(f) for f in funcs}


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_recipe_capability_rules_match_the_pinned_te(te_root, capability):
    """precision/device.py's table = what TE's support checks answer on that GPU (with CUDA 12.9, a new cuBLASLt)."""
    import types

    from megatron_rl.precision.device import recipe_capability_error

    namespace = {"get_device_compute_capability": lambda: capability, "Tuple": tuple,
                 "torch": types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.9")),
                 "tex": types.SimpleNamespace(get_cublasLt_version=lambda: 130000)}
    te_says = {}
    for key, code in _te_support_functions(te_root).items():
        exec(code, namespace)  # noqa: S102 - TE's own function, run with stubbed device queries
        te_says[key] = namespace[code.split("(")[0].split()[-1]]()[0]
    for recipe, te_key in (("delayed", "fp8"), ("tensorwise", "fp8"), ("blockwise", "blockwise"), ("mxfp8", "mxfp8"),
                           ("nvfp4", "nvfp4")):
        assert (recipe_capability_error(recipe, capability) is None) == te_says[te_key], (recipe, capability, te_says)
    assert recipe_capability_error("mxfp4", capability) is not None  # no TE recipe at all


# ------------------------------------------------------------------------ megatron-core's imports from TE
# What megatron-core 0.16.1 imports from TE but the pinned TE no longer defines, each with why it is harmless: the
# Dockerfile pairs megatron-core 0.16.1 with a TE newer than its tested range (its dev extra: < 2.12) on this evidence.
MEGATRON_TE_NAMES_ABSENT = {
    ("transformer_engine.pytorch.attention", "_SplitAlongDim"): "try/except: megatron splits q/k/v with torch.split",
    ("transformer_engine.pytorch.module.base", "get_workspace"): "try/except: te_general_gemm unset (unused here)",
    ("transformer_engine.pytorch.attention", "apply_rotary_pos_emb"): "the TE < 2.3 branch (attention.rope's is used)",
}


def megatron_te_imports(root: Path) -> set[tuple[str, str]]:
    """(TE module, name) of every `from transformer_engine... import name` in megatron-core's source."""
    out = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("transformer_engine"):
                out.update((node.module, a.name) for a in node.names)
    return out


def te_defines(te: TeSource, module: str, name: str) -> bool:
    """Whether TE's `module` has `name`: a definition, a submodule, a module-level assignment or a re-export, or a name
    it takes from its compiled extension (transformer_engine_torch, not in the Python source)."""
    if te.lookup(module, name) is not None or te._path(f"{module}.{name}") is not None:
        return True
    path = te._path(module)
    if path is None:
        return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) in (name, "*") for a in node.names):
            if node.module == "transformer_engine_torch" or any(a.name == "*" for a in node.names):
                return True
            if any((a.asname or a.name) == name for a in node.names):
                return True
    return False


def test_megatron_cores_te_imports_resolve_in_the_pinned_te(te_root):
    import megatron.core

    wanted = megatron_te_imports(Path(megatron.core.__file__).parent)
    assert len(wanted) > 30  # the collector sees megatron-core's TE extension module
    te = TeSource(te_root)
    absent = {(m, n) for m, n in wanted if not te_defines(te, m, n)}
    assert absent == set(MEGATRON_TE_NAMES_ABSENT), sorted(absent ^ set(MEGATRON_TE_NAMES_ABSENT))
