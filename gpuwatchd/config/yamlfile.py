"""YAML as the project reads every file: the safe loader, and a key given twice refused.

PyYAML keeps the last of two equal keys in a mapping and says nothing, so
`http:` written twice silently drops the first section. Every YAML file a
config names (the config itself, the web config, hang signatures, diag
floors) goes through `load_yaml`, which names the file, the key path and
both lines instead.
"""

from __future__ import annotations

import functools
from typing import IO, Any

from gpuwatchd.config.problems import raise_all
from gpuwatchd.errors import ConfigError
from gpuwatchd.logs import escape_control

__all__ = ["load_yaml"]

MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml(source: str | bytes | IO[str] | IO[bytes], file: str) -> Any:
    """The document in `source`; ConfigError(file, where, problem) for bad YAML or a repeated key.

    Several repeated keys are reported together, one line each.
    """
    import yaml  # here: a node without a config file needs no YAML parser

    loader = _loader()(source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        duplicates = _duplicates(loader, node, file)
        raise_all(duplicates)
        return loader.construct_document(node)
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(file, where, f"invalid YAML: {problem}") from None
    finally:
        loader.dispose()


@functools.cache
def _loader() -> Any:
    import yaml

    # libyaml's parser when PyYAML was built with it: the same documents, several times faster
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _duplicates(loader: Any, root: Any, file: str) -> list[ConfigError]:
    """A ConfigError for each key given twice in one mapping, in document order."""
    import yaml

    found: list[tuple[int, ConfigError]] = []
    seen_nodes: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:  # an alias: its node was walked where the anchor is
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            children: list[tuple[Any, str]] = []
            for key_node, value_node in node.value:
                if key_node.tag == MERGE_TAG:
                    children.append((value_node, path))
                    continue
                key = _key_of(loader, key_node)
                shown = escape_control(str(key), 64)
                where = f"{path}.{shown}" if path else shown
                line = key_node.start_mark.line + 1
                try:
                    earlier = first.get(key)
                    if earlier is None:
                        first[key] = line
                except TypeError:  # an unhashable key: the constructor refuses it
                    earlier = None
                if earlier is not None:
                    problem = f"key given twice (lines {earlier} and {line}); give it once"
                    found.append((line, ConfigError(file, where, problem)))
                children.append((value_node, where))
            stack.extend(reversed(children))
    return [e for _, e in sorted(found, key=lambda x: x[0])]


def _key_of(loader: Any, node: Any) -> Any:
    """The key as the loader would build it (`yes` and `true` are one key), else its text."""
    import yaml

    if not isinstance(node, yaml.ScalarNode):
        return ("<complex key>", id(node))
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError):
        return node.value
