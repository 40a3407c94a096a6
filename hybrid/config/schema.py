"""One schema per config section: a frozen dataclass whose fields carry their default and their check.

A section (``ZeroConfig``, ``JobSpec``, ``GPTConfig``, ...) subclasses ``Section`` and declares each field with
``setting(default, check, ...)``; the field's metadata (a ``Setting``) holds

- ``check``: ``(path, value) -> value``, a checker of ``hybrid.config.validate`` bound to its bounds
  (``partial(v.positive_int, hi=MAX_STEPS)``); it returns the value normalised (``5e8`` -> ``500000000``);
- ``help``: what to write there (also what the missing-key sentence asks for);
- ``deepspeed``: DeepSpeed's name for the key (``train_micro_batch_size_per_gpu``), read in either spelling and
  named in errors as the user wrote it; ``aliases``: other names DeepSpeed reads for it
  (``stage3_prefetch_bucket_size``), named in errors by the field; ``deepspeed_default``: the default in
  DeepSpeed's form where it differs from ours;
- ``key``: where the key sits when not directly in the section (``interconnect.intra_node``);
  ``yaml_number``: a string YAML read from scientific notation (``1e-5``) is the number it plainly is;
  ``auto``: ``None`` is written ``auto``.

From that one declaration come the four things that used to restate it:

- construction: ``Section.__post_init__`` checks every field once, under the path the errors name, then the
  section's cross-field rule (``_check_together``). A field whose default is ``None`` may be ``None`` (unset).
  ``where`` (an init-only keyword) is that path: ``Where(section, paths)``, the section as the user wrote it
  (``zero_optimization``, ``train.optimizer``) and any key written elsewhere or in another spelling; built
  directly, a section is named by its ``SECTION`` (``zero``);
- reading: ``spelled(cls, mapping, where)`` folds a user's mapping into field values (every unknown key named
  in one sentence, a key given in two spellings refused, a missing required key asked for with its help) and
  the ``Where`` they were written at; ``read`` then constructs, so a file's values are checked by the
  constructor, once;
- ``defaults(cls)``: the defaults, as a dict;
- ``echo(obj)``: the section in the spelling a user writes (``auto`` for unset levers, unset optional fields
  left out, paths as text).

Plain dataclasses and not pydantic: the checks are ``hybrid.config.validate``'s, whose one-sentence errors
(``<path> must be <what>, got <value>.``, with the YAML and ``auto`` hints) tests and users rely on; pydantic
would bring its own multi-line errors to translate back, a dependency into every rank, and an alias model
that names errors by field, not by the spelling and section the user wrote. Field metadata carries all a
schema needs here in a few lines.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import MISSING, InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Union

from hybrid.config import validate as v
from hybrid.errors import ConfigError

Check = Callable[[str, Any], Any]


class _Unset:
    """No DeepSpeed-form default of its own: the field's default holds there too."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass(frozen=True)
class Setting:
    """What the schema knows about one field besides its default (see the module docstring)."""

    check: Optional[Check] = None
    help: str = ""
    deepspeed: Optional[str] = None
    aliases: tuple = ()
    deepspeed_default: Any = UNSET
    key: Optional[str] = None
    yaml_number: bool = False
    auto: bool = False
    derived: bool = False  # set by the section's reader from what was written, never a key of its own


_METADATA = "hybrid.setting"


def setting(default: Any = MISSING, check: Optional[Check] = None, *, factory: Any = MISSING, help: str = "",
            deepspeed: Optional[str] = None, aliases: Iterable[str] = (), deepspeed_default: Any = UNSET,
            key: Optional[str] = None, yaml_number: bool = False, auto: bool = False, derived: bool = False):
    """A dataclass field with its default (``default``, or ``factory()``; neither: required) and its ``Setting``;
    ``derived``: a fact the section's reader derives from what the user wrote (no key of its own)."""
    meta = {_METADATA: Setting(check, help, deepspeed, tuple(aliases), deepspeed_default, key, yaml_number, auto,
                               derived)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def setting_of(cls_or_obj, name: str) -> Setting:
    """The ``Setting`` of field ``name``."""
    return _setting(next(f for f in fields(cls_or_obj) if f.name == name))


def default_of(cls, name: str) -> Any:
    """The default of field ``name`` of ``cls``."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def _setting(f: dataclasses.Field) -> Setting:
    return f.metadata.get(_METADATA) or Setting()


def optional(check: Check) -> Check:
    """``check``, letting ``None`` through (for a field whose default is not ``None`` but that may be unset)."""
    return lambda path, value: None if value is None else check(path, value)


def path_value(path: str, value: Any) -> Path:
    """A filesystem path (``str`` or ``os.PathLike``) as a ``Path``."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    raise v.invalid(path, "a path", value)


@dataclass(frozen=True)
class Where:
    """The paths a section's errors name: ``section`` as the user wrote it (``zero_optimization``, ``""`` for
    the top level) and ``paths``, the full path of any field written elsewhere or in another spelling."""

    section: str = ""
    paths: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str) -> str:
        return self.paths.get(name) or v.join(self.section, name)

    def also(self, **paths: str) -> "Where":
        return Where(self.section, {**self.paths, **paths})


def _where(where: Union[None, str, Where], default: str) -> Where:
    if isinstance(where, Where):
        return where
    return Where(default if where is None else where)


@dataclass(frozen=True)
class Section:
    """A config section: its fields are checked once, on construction (see the module docstring)."""

    SECTION: ClassVar[str] = ""  # the path errors name when the section is built directly
    SORTED_KEYS: ClassVar[bool] = False  # list the accepted keys sorted (DeepSpeed's sections), else in field order

    where: InitVar[Union[None, str, Where]] = field(default=None, kw_only=True)

    def __post_init__(self, where: Union[None, str, Where]) -> None:
        where = _where(where, self.SECTION)
        for f in fields(self):
            check = _setting(f).check
            value = getattr(self, f.name)
            if check is None or (value is None and f.default is None):
                continue
            self._set(f.name, check(where(f.name), value))
        self._check_together(where)

    def _check_together(self, where: Where) -> None:
        """The rules between fields (each field alone is checked already)."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalised values are stored while constructing


def _required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def defaults(cls) -> dict:
    """The default of every field of ``cls`` that has one."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def deepspeed_defaults(cls) -> dict:
    """The defaults of ``cls``'s DeepSpeed form where they differ from ours (``Setting.deepspeed_default``)."""
    return {f.name: _setting(f).deepspeed_default for f in fields(cls) if _setting(f).deepspeed_default is not UNSET}


def keys(cls, also: Iterable[str] = ()) -> list:
    """The keys a user may write in ``cls``'s section (and ``also``), in the order errors list them."""
    out: list = []
    for f in fields(cls):
        s = _setting(f)
        if s.derived:
            continue
        for name in ((s.key or f.name).split(".")[0], s.deepspeed, *s.aliases):
            if name and name not in out:
                out.append(name)
    out += [name for name in also if name not in out]
    return sorted(out) if cls.SORTED_KEYS else out


def spelled(cls, section: Any, where: str = "", *, also: Iterable[str] = (), example: str = "",
            examples: Optional[Mapping[str, str]] = None, nulls_unset: bool = False,
            need: Optional[str] = None) -> tuple[dict, Where]:
    """The field values of the user's mapping ``section`` (at ``where``) and the ``Where`` they were written at.

    Every key outside ``keys(cls)`` and ``also`` (keys the caller reads itself) is refused, all in one sentence;
    a key given in two spellings is refused; a required key missing (or null) is asked for with its help
    (``need`` instead, when given). ``nulls_unset``: a null value is the key left out (cluster files).
    ``example`` shows the section's shape in the not-a-mapping error, ``examples`` a nested mapping's."""
    d = v.mapping(where, section, example=example)
    if nulls_unset:
        d = v.without_nulls(d)
    v.known_keys(where, d, keys(cls, also))
    nested = _nested_keys(cls)
    values: dict = {}
    paths: dict = {}
    for f in fields(cls):
        s = _setting(f)
        if s.derived:
            continue
        found = _found(d, f.name, s, where, nested, examples or {}, nulls_unset)
        if len(found) > 1:
            names = " and ".join(v.join(where, key) for key, _ in found)
            raise ConfigError(f"{names} are both set; keep one")
        if found:
            key, value = found[0]
            values[f.name] = v.yaml_number(value) if s.yaml_number else value
            if key != f.name and key not in s.aliases:  # another spelling or place: named as written
                paths[f.name] = v.join(where, key)
        if _required(f):
            v.required(values, where, f.name, need or s.help)
    return values, Where(where, paths)


def _nested_keys(cls) -> dict:
    """``{outer: (inner, ...)}`` for the fields of ``cls`` whose key is ``outer.inner``."""
    out: dict = {}
    for f in fields(cls):
        key = _setting(f).key
        if key and "." in key:
            outer, inner = key.split(".", 1)
            out[outer] = (*out.get(outer, ()), inner)
    return out


def _found(d: dict, name: str, s: Setting, where: str, nested: dict, examples: Mapping[str, str],
           nulls_unset: bool) -> list:
    """``(key as written, value)`` of every spelling of the field present in ``d``: its own name first."""
    if s.key and "." in s.key:
        outer, inner = s.key.split(".", 1)
        if d.get(outer) is None:
            return []
        inside = v.mapping(v.join(where, outer), d[outer], nested[outer], example=examples.get(outer, ""))
        inside = v.without_nulls(inside) if nulls_unset else inside
        return [(s.key, inside[inner])] if inner in inside else []
    return [(key, d[key]) for key in (s.key or name, s.deepspeed, *s.aliases) if key and key in d]


def read(cls, section: Any, where: Optional[str] = None, **options):
    """``cls`` built from the user's mapping ``section`` (``spelled``'s options), checked by its constructor."""
    values, at = spelled(cls, section, cls.SECTION if where is None else where, **options)
    return cls(**values, where=at)


def section_check(cls, reader: Optional[Callable[[Any, str], Any]] = None) -> Check:
    """The check of a field holding a section: an instance as it is, ``None`` the section's defaults, a mapping
    read at the field's path (by ``reader``, default ``read``)."""

    def check(path: str, value: Any):
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        return reader(value, path) if reader else read(cls, value, path)

    return check


def echo(obj) -> dict:
    """``obj`` as a user writes it: our spelling, nested keys nested, ``auto`` for an unset lever, paths as text,
    sections as mappings."""
    out: dict = {}
    for f in fields(obj):
        s = _setting(f)
        if s.derived:
            continue
        value = getattr(obj, f.name)
        if value is None and not s.auto:
            continue  # an optional field left unset is not written
        if value is None:
            value = "auto"
        elif isinstance(value, Section):
            value = echo(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        target, name = out, s.key or f.name
        while "." in name:
            outer, name = name.split(".", 1)
            target = target.setdefault(outer, {})
        target[name] = value
    return out
