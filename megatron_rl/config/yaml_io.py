"""The one YAML reader of the project: PyYAML's safe loader, but a duplicate key is an error naming file:line.

    tree = load_yaml_file(Path("examples/configs/tiny_grpo.yaml"))   # YAMLInputError on a duplicate key or bad syntax

PyYAML keeps the last of two equal keys in a mapping without a word (`lr: 1e-3` then `lr: 1.0` trains at
1.0); YAML 1.2 says mapping keys are unique. PyYAML has no option for it (its issue #41), so the safe
loader's mapping constructor is extended here rather than adding another YAML library for one check.
Every error is one line: `<file>:<line>: <problem>`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YAMLInputError(ValueError):
    """A YAML file (or override value) that cannot be read: bad syntax or a duplicate key; one line naming file:line."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader whose mappings reject a key given twice."""

    def construct_mapping(self, node, deep=False):
        """The mapping of `node`, after checking that no key occurs twice in it (merge keys `<<` excepted)."""
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # an unhashable key fails in the base constructor with its own message
                line = key_node.start_mark.line + 1
                if key in first:
                    raise YAMLInputError(f"{key_node.start_mark.name}:{line}: duplicate key {key!r} "
                                         f"(first at line {first[key]}; YAML keys must be unique)")
                first[key] = line
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def load_yaml(text: str, name: str = "<string>") -> Any:
    """Parse YAML `text` (named `name` in errors) with unique mapping keys; YAMLInputError on any problem."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        raise YAMLInputError(f"{where}: not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise YAMLInputError(f"{name}: not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> Any:
    """Parse the YAML file at `path` (see `load_yaml`); errors name the file and line."""
    return load_yaml(Path(path).read_text(), str(path))
