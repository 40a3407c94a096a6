"""What one step moved over each link, and the error of its int8 collectives (``metrics.jsonl``'s link numbers).

``LinkMeter(engine).step()`` returns, for the step since its previous call (the first: since the engine's last
``reset_comm``), this rank's ZeRO bytes by link as ``hybrid.comm`` counts them (``dp_intra_bytes``,
``dp_inter_bytes``: ``engine.comm_report()``'s ``intra`` / ``inter``) and, where the engine quantizes, the
relative error of the values it quantized (``quant_error_weights``, ``quant_error_gradients``:
sqrt(sum err^2 / sum value^2), ``hybrid.comm.quantize``). It only reads the engine's counters, never resets
them: a caller reading ``comm_report()`` over several steps still sees all of them (a ``reset_comm`` between
two readings restarts the count from there). An engine without these reports (a test double, a user's own)
gives nothing.
"""

from __future__ import annotations

from typing import Optional

from hybrid.comm.quantize import relative_error

LINKS = ("intra", "inter")


class LinkMeter:
    def __init__(self, engine):
        self.engine = engine
        self._links: dict = {}
        self._sums: dict = {}

    def step(self) -> dict:
        report = getattr(self.engine, "comm_report", None)
        if report is None:
            return {}
        counts = report()
        if not all(isinstance(counts.get(link), (int, float)) for link in LINKS):
            return {}
        out = {}
        restarted = any(counts[link] < self._links.get(link, 0) for link in LINKS)  # reset_comm since
        for link in LINKS:
            out[f"dp_{link}_bytes"] = float(counts[link]) - (0.0 if restarted else self._links.get(link, 0.0))
        self._links = {link: float(counts[link]) for link in LINKS}
        sums = getattr(self.engine, "quantization_sums", None)
        for kind, now in (sums() if sums is not None else {}).items():
            error = relative_error(_since(now, self._sums.get(kind)))
            self._sums[kind] = now
            if error is not None:
                out[f"quant_error_{kind}"] = error
        return out


def _since(now: Optional[tuple], before: Optional[tuple]) -> Optional[tuple]:
    """The sums gathered between two readings (``now`` alone after a reset, or the first time)."""
    if now is None:
        return None
    if before is None or now[0] < before[0] or now[1] < before[1]:
        return now
    if now == before:
        return None  # nothing quantized in this step
    return now[0] - before[0], now[1] - before[1]
