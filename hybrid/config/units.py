"""The one way bytes are printed: decimal units as the seed writes them (208 GB, 71.5 GB, 3.25 GB); and
counts of things (``count(1, "node")``: ``1 node``).

``human_bytes(n)`` picks the largest of GB, MB, KB (powers of 1000) that ``n`` reaches, else B, and prints
at most three decimals with trailing zeros dropped, so two sizes that differ at the scale shown never print
alike and the memory table, the reason line and the progress display agree to the digit. Exact inputs
(ints, ``Fraction``) are divided exactly before rounding.
"""

from __future__ import annotations

from fractions import Fraction

_UNITS = ((10**9, "GB"), (10**6, "MB"), (10**3, "KB"))


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "node")`` is ``1 node``, ``count(2, "rank")``
    ``2 ranks``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def human_bytes(value) -> str:
    """``value`` bytes as text, e.g. ``18.661 GB``, ``539.648 KB``, ``60 B``."""
    exact = Fraction(value)
    for scale, unit in _UNITS:
        if abs(exact) >= scale:
            break
    else:
        scale, unit = 1, "B"
    text = f"{float(exact / scale):.3f}".rstrip("0").rstrip(".")
    return f"{'0' if text == '-0' else text} {unit}"
