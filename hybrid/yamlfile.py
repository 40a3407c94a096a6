"""Read a YAML config file strictly: UTF-8 only, duplicate keys refused, every failure one sentence.

``load_yaml(path, what)`` returns the parsed document or raises ``ConfigError`` naming the file (``what``
says which file it is, e.g. "cluster file") and the fix: a missing path, a directory, a file that cannot
be read, bytes that are not UTF-8, a YAML syntax error (with its line), or a key given twice in one
mapping (PyYAML would silently keep the last one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from hybrid.errors import ConfigError
from hybrid.validate import quote


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:  # the mapping's own keys: what a merge (<<) brings may be overridden
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: let the base class report it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {quote(key, 40)} is given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | os.PathLike, what: str = "config file") -> Any:
    """The parsed YAML document at ``path``; see the module docstring for the errors."""
    path = Path(path)
    shown = quote(str(path))
    if path.is_dir():
        raise ConfigError(f"{what} {shown} is a directory; pass the path of a YAML file.")
    if not path.exists():
        raise ConfigError(f"{what} {shown} does not exist; pass the path of a YAML file.")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} {shown} cannot be read ({err.strerror or err}); check its permissions.") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {shown} is not UTF-8 text (byte {err.start}); save it as UTF-8.") from None
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else "?"
        problem = err.problem or err.context or "syntax error"
        if "given twice" in problem:
            raise ConfigError(f"{what} {shown} line {line}: {problem}; keep one of them.") from None
        raise ConfigError(f"{what} {shown} is not valid YAML at line {line} ({problem}); "
                          "fix the indentation or quoting there.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {shown} is not valid YAML ({quote(str(err))}); fix the file.") from None
    except RecursionError:
        raise ConfigError(f"{what} {shown} nests too deeply to read; flatten it.") from None
