"""Read a YAML config file strictly: a regular file of at most 16 MiB, UTF-8 only, duplicate keys refused, every
failure one sentence.

``load_yaml(path, what)`` returns the parsed document or raises ``ConfigError`` naming the file (``what``
says which file it is, e.g. "cluster file") and the fix: a missing path, a directory or anything else that is
not a regular file (a FIFO would block the read forever, ``/dev/zero`` never ends), a file that cannot be
read, one over ``MAX_YAML_BYTES``, bytes that are not UTF-8, a YAML syntax error (with its line), a key given
twice in one mapping (PyYAML would silently keep the last one), or a value Python cannot convert (an integer
of more than 4300 digits, a 13th month). ``not_a_file(path)`` says why a path cannot be read as one, for
a caller that checks a config path before reading it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

import yaml

from hybrid.errors import ConfigError, first_line
from hybrid.config.validate import quote

MAX_YAML_BYTES = 16 * 2**20  # far above any config; a bound on what a wrong path can make us read
_INT_TAG = "tag:yaml.org,2002:int"


class _Refused(yaml.constructor.ConstructorError):
    """A value the loader refuses, with the fix the message gives."""

    def __init__(self, problem: str, fix: str, mark):
        super().__init__(None, None, problem, mark)
        self.fix = fix


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, and turns a value Python cannot
    convert (its ``ValueError``) into a marked error."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as err:
            raise _unconvertible(node, err) from None

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
                    raise _Refused(f"key {quote(key, 40)} is given twice", "keep one of them", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 numbers that surprise: ``1:30`` is 90 (base 60), ``010`` is 8 (octal), ``1_0`` is 10. A config
# number is decimal (``0x``/``0o`` prefixes kept) with ``_`` only between groups of three digits, as
# ``hybrid.plan.memory.parse_count`` reads counts; any other such scalar stays text, which the field's check names.
_FLOAT_TAG = "tag:yaml.org,2002:float"
_DECIMAL = r"(?:[0-9]{1,3}(?:_[0-9]{3})+|[0-9]+)"
_INT = re.compile(rf"^[-+]?(?:{_DECIMAL}|0x[0-9a-fA-F]+|0o[0-7]+)$")
_FLOAT = re.compile(rf"""^(?:[-+]?{_DECIMAL}\.[0-9]*(?:[eE][-+][0-9]+)?
                    |[-+]?\.[0-9]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X)


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    base = {"0x": 16, "0o": 8}.get(digits[:2], 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in entries if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()}
StrictLoader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
StrictLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
StrictLoader.add_constructor(_INT_TAG, _construct_int)


def _unconvertible(node, err: ValueError) -> _Refused:
    value = node.value if isinstance(node, yaml.ScalarNode) else ""
    if node.tag == _INT_TAG:  # Python converts at most sys.get_int_max_str_digits() digits
        digits = sum(c.isalnum() for c in value)
        return _Refused(f"an integer of {digits} digits is too long to read", "write a smaller number",
                        node.start_mark)
    return _Refused(f"{quote(value, 40)} cannot be read ({first_line(err)})",
                    "correct it, or quote it to keep it as text", node.start_mark)


def _mode_problem(mode: int) -> Optional[str]:
    if stat.S_ISDIR(mode):
        return "is a directory"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    return None


def not_a_file(path: str | os.PathLike) -> Optional[str]:
    """Why ``path`` cannot be read as a config file -- ``does not exist``, ``is a directory``, ``is not a regular
    file`` (a FIFO, a device) or ``cannot be read (<reason>)`` -- or None when it is a regular file."""
    try:
        return _mode_problem(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"


def read_regular_file(path: Path, named: str, fix: str = "pass the path of a YAML file") -> bytes:
    """The bytes of the regular file ``path``, at most ``MAX_YAML_BYTES``; ``named`` opens every error, ``fix``
    ends those about the kind of file (missing, a directory, a pipe or device)."""
    try:
        # non-blocking: opening a FIFO must not wait for a writer before fstat can refuse it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{named} does not exist; {fix}.") from None
    except IsADirectoryError:
        raise ConfigError(f"{named} is a directory; {fix}.") from None
    except OSError as err:
        raise _unreadable(named, err) from None
    problem = _mode_problem(os.fstat(fd).st_mode)
    if problem:
        os.close(fd)
        raise ConfigError(f"{named} {problem}; {fix}.")
    with os.fdopen(fd, "rb") as file:
        try:
            raw = file.read(MAX_YAML_BYTES + 1)
        except OSError as err:
            raise _unreadable(named, err) from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{named} is larger than {MAX_YAML_BYTES // 2**20} MiB, more than any config file; "
                          "check that the path names the YAML file you meant.")
    return raw


def _unreadable(named: str, err: OSError) -> ConfigError:
    return ConfigError(f"{named} cannot be read ({err.strerror or err}); check its permissions.")


def load_yaml(path: str | os.PathLike, what: str = "config file") -> Any:
    """The parsed YAML document at ``path``; see the module docstring for the errors."""
    path = Path(path)
    shown = quote(str(path))
    raw = read_regular_file(path, f"{what} {shown}")
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
        if isinstance(err, _Refused):
            raise ConfigError(f"{what} {shown} line {line}: {problem}; {err.fix}.") from None
        raise ConfigError(f"{what} {shown} is not valid YAML at line {line} ({problem}); "
                          "fix the indentation or quoting there.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {shown} is not valid YAML ({quote(str(err))}); fix the file.") from None
    except RecursionError:
        raise ConfigError(f"{what} {shown} nests too deeply to read; flatten it.") from None
