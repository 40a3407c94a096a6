"""The one vocabulary for checking user input: field-path-aware checkers and the shared constants.

Every checker takes the field's path as the user spells it (``job.steps``, ``zero.stage``, ``--gpus``)
and the value, returns the value normalised (an ``int``, a ``float``) and otherwise raises ``ConfigError``
with one sentence of the form ``<path> must be <what is allowed>, got <value>.`` Values are quoted
short (``quote``: at most ``QUOTE_LIMIT`` characters, however big the value), so an error never prints
a whole YAML bomb. A string that YAML read from something number-like (``1e3`` has no dot, so YAML 1.1
reads it as a string) is explained in the same sentence.

Constants used by more than one module live here: ``PRECISIONS``, ``STAGES``, ``MAX_SEED``. ``"auto"`` where
it is not one of the choices is explained as the Hugging Face placeholder it is (``AUTO_PLACEHOLDER``).
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any, Iterable, Mapping, Optional

from hybrid.errors import ConfigError

PRECISIONS = ("bf16", "fp32")
DEFAULT_PRECISION = "bf16"  # the GPU default: the seed's bytes (bf16 parameters and gradients, fp32 masters)
STAGES = (0, 1, 2, 3)
# Seeds feed torch.Generator.manual_seed, also as seed * 1_000_003 + step (hybrid.data): 32 bits keeps
# that product inside the generator's 64-bit range for any step count.
MAX_SEED = 2**32 - 1
QUOTE_LIMIT = 80
AUTO_PLACEHOLDER = ('"auto" is a placeholder the Hugging Face Trainer/Accelerate fill in before DeepSpeed reads '
                    'the config')

_repr = reprlib.Repr()
_repr.maxstring = QUOTE_LIMIT
_repr.maxother = QUOTE_LIMIT
_repr.maxlevel = 2
_repr.maxdict = _repr.maxlist = _repr.maxtuple = _repr.maxset = 4


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to at most ``limit`` characters (cheap even for a huge nested value)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = _repr.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join(path: str, key: Any) -> str:
    """The path of ``key`` inside the mapping at ``path`` (``""`` is the top level)."""
    return f"{path}.{key}" if path else str(key)


def invalid(path: str, need: str, value: Any) -> ConfigError:
    """The one-sentence error for a value outside what ``need`` describes."""
    return ConfigError(f"{path} must be {need}, got {quote(value)}{_yaml_hint(value)}{auto_hint(value)}.")


def auto_hint(value: Any) -> str:
    """Why ``"auto"`` is refused where it is not one of the choices: it is a Hugging Face placeholder."""
    if not (isinstance(value, str) and value == "auto"):
        return ""
    return f" ({AUTO_PLACEHOLDER}; write the real value)"


def _yaml_hint(value: Any) -> str:
    """Why a number-like value is a string: YAML 1.1 reads scientific notation as a float only with a dot
    and a signed exponent (``1.0e+3``; ``1e3``, ``1.0e3``, ``1e-3`` are strings); or it was quoted."""
    if not isinstance(value, str) or len(value) > 40:
        return ""
    text = value.strip()
    match = _YAML_STRING_FLOAT.fullmatch(text)
    if match and not ("." in match[1] and match[2]):  # 1.0e+3 itself is a string only when quoted
        mantissa, sign, exponent = match.groups()
        if "." not in mantissa:
            mantissa += ".0"
        elif mantissa.endswith("."):
            mantissa += "0"
        return (f" (YAML reads {text} as a string, a float needs a dot and a signed exponent: write "
                f"{mantissa}e{sign or '+'}{exponent} or the plain number)")
    try:
        float(text)
    except ValueError:
        return ""
    return " (a string: write the number without quotes)"


_YAML_STRING_FLOAT = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))[eE]([+-]?)([0-9]+)")


def yaml_number(value: Any) -> Any:
    """A string such as ``1e-5`` (no dot, so YAML 1.1 read it as a string) as the float it plainly is;
    anything else unchanged. For fields that can only be numbers, where reading it so is safe."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(path: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None,
            whole_floats: bool = False, need: Optional[str] = None) -> int:
    """A whole number in ``[lo, hi]``; with ``whole_floats`` a float such as ``5e8`` counts when it is
    whole."""
    if whole_floats and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        raise invalid(path, need or _int_need(lo, hi), value)
    return value


def _int_need(lo: Optional[int], hi: Optional[int]) -> str:
    if lo == 1 and hi is None:
        return "a positive integer"
    if lo is not None and hi is not None:
        return f"a whole number from {lo} to {hi}"
    if lo is not None:
        return f"a whole number, at least {lo}"
    if hi is not None:
        return f"a whole number, at most {hi}"
    return "a whole number"


def positive_int(path: str, value: Any, hi: Optional[int] = None, whole_floats: bool = False) -> int:
    """A whole number, at least 1 (and at most ``hi``)."""
    return integer(path, value, 1, hi, whole_floats=whole_floats)


def number(path: str, value: Any, lo: Optional[float] = None, hi: Optional[float] = None,
           lo_open: bool = False, unit: str = "", need: Optional[str] = None, hi_open: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``lo_open``, ``hi_open``: that end excluded); never NaN or infinity.
    ``need`` replaces the wording of the range in the error."""
    ok = _is_number(value) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        raise invalid(path, need or _number_need(lo, hi, lo_open, unit, hi_open), value)
    return float(value)


def _number_need(lo, hi, lo_open: bool, unit: str, hi_open: bool = False) -> str:
    unit = f" {unit}" if unit else ""
    if lo is not None and hi is not None:
        low = f"above {lo:g}" if lo_open else f"from {lo:g}"
        high = ("and" if lo_open else "to") + (" below" if hi_open else " at most" if lo_open else "")
        return f"a number {low} {high} {hi:g}{unit}"
    if lo is not None:
        return f"a number {'above' if lo_open else 'at least'} {lo:g}{unit}"
    if hi is not None:
        return f"a number {'below' if hi_open else 'at most'} {hi:g}{unit}"
    return f"a finite number{unit}"


def positive_number(path: str, value: Any, hi: Optional[float] = None, unit: str = "") -> float:
    """A finite number above 0 (and at most ``hi``)."""
    return number(path, value, 0, hi, lo_open=True, unit=unit)


def boolean(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(path, "true or false", value)
    return value


def one_of(path: str, value: Any, choices: Iterable) -> Any:
    """``value`` when it is one of ``choices`` (compared without letting ``True`` pass for ``1``)."""
    choices = tuple(choices)
    if isinstance(value, bool) or not _hashable(value) or value not in choices:
        raise invalid(path, "one of " + ", ".join(str(c) for c in choices), value)
    return value


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def stage(path: str, value: Any, auto: bool = False, whole_floats: bool = False) -> Optional[int]:
    """A ZeRO stage 0-3; with ``auto`` the string ``auto`` is allowed too and comes back as ``None``."""
    if auto and value == "auto":
        return None
    if whole_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGES:
        raise invalid(path, ("'auto' or " if auto else "") + "0, 1, 2 or 3", value)
    return value


def text(path: str, value: Any, need: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid(path, need, value)
    return value


def mapping(path: str, value: Any, allowed: Optional[Iterable[str]] = None, example: str = "") -> dict:
    """A mapping whose keys are all in ``allowed`` (when given); a typo must never fall back to a default."""
    if not isinstance(value, Mapping):
        need = f"a mapping{f' like {example}' if example else ''}"
        raise ConfigError(f"{path or 'the file'} must be {need}, got {_kind(value)}.")
    if allowed is not None:
        known_keys(path, value, allowed)
    return dict(value)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {quote(value, 40)}"


def without_nulls(d: Mapping) -> dict:
    """``d`` without its empty (YAML null) values: in a cluster file an empty value is the field left unset,
    so its default applies, the same for every field."""
    return {key: value for key, value in d.items() if value is not None}


UNKNOWN_KEYS_SHOWN = 10  # an unknown-key sentence names this many, then counts the rest


def known_keys(path: str, d: Mapping, allowed: Iterable[str]) -> None:
    """Refuse every key of ``d`` outside ``allowed``, all of them in one sentence, each named whole."""
    allowed = tuple(allowed)
    unknown = [join(path, key_name(key)) for key in d if not isinstance(key, str) or key not in allowed]
    if not unknown:
        return
    verb = "is not a known setting" if len(unknown) == 1 else "are not known settings"
    shown = unknown[:UNKNOWN_KEYS_SHOWN]
    if len(unknown) > len(shown):
        shown.append(f"{len(unknown) - len(shown)} more")
    names = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    raise ConfigError(f"{names} {verb}; use one of: {', '.join(allowed)}.")


def key_name(key: Any) -> str:
    """A mapping key as a message shows it: a printable string whole (up to ``QUOTE_LIMIT`` characters, more
    than any real setting name), anything else quoted short."""
    if isinstance(key, str) and key.isprintable():
        return key if len(key) <= QUOTE_LIMIT else key[: QUOTE_LIMIT - 3] + "..."
    return quote(key, 40)


def required(d: Mapping, path: str, key: str, need: str) -> Any:
    """``d[key]``, or the error that says the field is missing and what to put there."""
    if key not in d or d[key] is None:
        raise ConfigError(f"{join(path, key)} is missing; add it ({need}).")
    return d[key]
