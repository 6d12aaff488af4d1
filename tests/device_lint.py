"""A static check of the "device comes from the data" rule (DESIGN.md): tensor factory calls must say `device=`.

    python tests/device_lint.py megatron_rl/algo megatron_rl/phases megatron_rl/parallel/collectives.py

Flags every call of a torch tensor factory (torch.tensor, torch.zeros, torch.arange, torch.randperm, ...,
also when imported by name from torch) that has no `device=` keyword, unless a comment
`# device-ok: <reason>` sits on one of the call's lines. `*_like` factories and Tensor methods
(`x.new_zeros`, ...) take their device from a tensor and are not flagged. Used by
tests/test_device_placement.py; exits 1 when it finds something.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Iterable, NamedTuple

FACTORIES = frozenset({
    "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "full", "empty", "empty_strided", "arange", "range",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "tril_indices", "triu_indices",
    "sparse_coo_tensor", "from_numpy",
})
_EXEMPT = re.compile(r"#\s*device-ok:\s*\S")


class Finding(NamedTuple):
    """One factory call without a device."""

    path: str
    line: int
    call: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: torch.{self.call}(...) without device= (add device=..., or '# device-ok: <why>')"


def _torch_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module, and factory names imported from it (local name -> factory)."""
    modules, direct = {"torch"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    modules.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name in FACTORIES:
                    direct[a.asname or a.name] = a.name
    return modules, direct


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings of one module's source."""
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    modules, direct = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, name = node.func, None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules and f.attr in FACTORIES:
            name = f.attr
        elif isinstance(f, ast.Name) and f.id in direct:
            name = direct[f.id]
        if name is None or any(k.arg == "device" for k in node.keywords):
            continue
        span = lines[node.lineno - 1: (node.end_lineno or node.lineno)]
        if any(_EXEMPT.search(line) for line in span):
            continue
        found.append(Finding(path, node.lineno, name))
    return found


def check_paths(paths: Iterable[str | Path]) -> list[Finding]:
    """Findings of every .py file under `paths` (files or directories)."""
    out: list[Finding] = []
    for p in map(Path, paths):
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            out.extend(check_source(f.read_text(), str(f)))
    return out


if __name__ == "__main__":
    findings = check_paths(sys.argv[1:])
    for finding in findings:
        print(finding)
    sys.exit(1 if findings else 0)
