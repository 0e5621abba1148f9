"""Experiment and maintenance YAML read with bounds: a file too large, or one whose aliases expand to more
values than any configuration holds (a "billion laughs" bomb), is refused before anything walks it.

PyYAML's safe loader builds an alias as a shared reference, so the bomb costs nothing until something
walks it (validation, a deep copy, an error message that prints the value): then it is 10^8 items. Here
the composed node graph is measured first, each node once, counting the values it expands to.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from verl_tasks.errors import ConfigError

MAX_BYTES = 1 << 20  # far above any experiment (the shipped ones are 1-3 KB)
MAX_VALUES = 100_000  # scalars, lists and mappings after aliases are expanded


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for once every alias in it is expanded (shared nodes measured once)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = MAX_VALUES + 1  # a node that contains itself expands without end
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded(k, sizes) + _expanded(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded(item, sizes) for item in node.value)
    else:
        size = 1
    sizes[id(node)] = min(size, MAX_VALUES + 1)
    return sizes[id(node)]


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """The parsed content of a small YAML file (None when it is empty).

    Raises:
        ConfigError: the file is missing, larger than ``MAX_BYTES``, not valid YAML, or its aliases expand
            to more than ``MAX_VALUES`` values.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read ({err.strerror})") from None
    if size > MAX_BYTES:
        raise ConfigError(f"{what} {path} is {size} bytes; a configuration is at most {MAX_BYTES} bytes")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded(node, {}) > MAX_VALUES:
            raise ConfigError(f"{what} {path}: its aliases expand to more than {MAX_VALUES} values; a configuration "
                              f"needs far fewer (is it an alias bomb?): write the values out")
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {path} is not valid YAML: {err}") from None


__all__ = ["MAX_BYTES", "MAX_VALUES", "read_yaml_file"]
