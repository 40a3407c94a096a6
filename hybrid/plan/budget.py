"""What one rank measures of its own memory, and the budget check that turns an overshoot into an OOM.

``MemoryMeter(device, budget_bytes=None, nvml=None)`` is made before the engine is built (``hybrid.runtime.train
.Context`` does it), so its baseline excludes the runtime but includes everything the job allocates.
``measure()`` returns one plain dict:

* on CUDA: ``torch.cuda.max_memory_allocated`` (``peak_bytes``) and ``max_memory_reserved``
  (``reserved_bytes``) of the rank's device since the last ``measure()``, and from NVML what this process
  holds on that GPU (``nvml_used_bytes``: its record in NVML's running processes; absent where NVML cannot
  attribute memory to it, e.g. in a PID namespace), the GPU's used memory over every process
  (``nvml_device_used_bytes``, for display only: other processes' memory is not this rank's) and its total
  (``nvml_total_bytes``); the NVML figures are absent where NVML is not available. NVML is initialised once
  per process (``hybrid.plan.monitor.session``) and the GPU looked up once, when the meter is made;
* on CPU -- the stand-in that makes the closed loop testable without a GPU -- the process's peak RSS
  growth since the baseline (``peak_bytes``): Linux's ``VmHWM`` reset to the current RSS through
  ``/proc/self/clear_refs`` at the baseline, else ``ru_maxrss``, which cannot be reset (so the figure is
  the peak since the process started, less the RSS at the baseline), less the file pages (libraries' code)
  mapped since the baseline, which are no allocation of the job's. The meter first makes glibc return
  freed blocks to the system (``follow_live_tensors``), so that RSS follows the live tensors as
  ``max_memory_allocated`` does on CUDA: with glibc's defaults the heap it keeps after a peak is counted
  too, and varied by +-12 % between identical runs (which freed blocks it can reuse depends on the timing
  of the collectives' threads). That costs the CPU rank page faults on its transient buffers (steps 11-23 %
  slower in ``bench/ab_engine.py malloc``); the benchmarks build engines without a meter.

``budget_bytes`` is the rank's memory budget: the GPU's total on CUDA (NVML's, else the device's), and
on CPU the declared ``cluster.gpu_memory_gb`` the driver passes. ``used_bytes`` is what is held against it
(this process's memory by NVML where known, else the peak) and ``fraction`` their ratio. ``check(measured)`` raises
``torch.OutOfMemoryError`` when the peak exceeds the budget, the same class CUDA raises, so the driver
handles both alike; ``NEAR_OOM`` is the fraction above which the driver warns.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Optional

import torch

NEAR_OOM = 0.95
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"

OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _status_bytes(key: str) -> Optional[int]:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _reset_peak_rss() -> bool:
    """Make VmHWM equal the current RSS (Linux); False where that is not possible."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


def load_torch_runtime() -> None:
    """Import the part of torch that loads on first use before the CPU baseline: ``torch._dynamo`` (with sympy,
    ~70 MB of Python objects), which the first optimizer built imports (``Optimizer.add_param_group`` is
    wrapped to disable dynamo) and the first ``normal_`` on the meta device too. It is torch's code, not the
    job's memory, as libraries' code pages are not (``RssFile``), and where it loads must not move the figure:
    a rank forked from a process that had imported it already measured 70 MB less for the same steps."""
    import torch._dynamo  # noqa: F401


def follow_live_tensors() -> bool:
    """Make glibc serve blocks of 256 KiB and more from their own mappings and give freed heap above 2 MiB back
    at once, so the process's RSS follows its live tensors (to ~1 %); False where libc is not glibc.
    (64 KiB / 128 KiB followed them to 0.1 %, but cost a CPU step 16-31 % instead of 11-23 %. 1 MiB left a TP
    rank's activations -- 1/t of the width: 256 KiB-1 MiB at hidden 512 -- to the heap, whose holes kept
    31-55 MB, 8-15 % of the peak, beyond the live tensors: tests/dist/test_hf_memory_prediction.py.)"""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 256 << 10)) and bool(mallopt(m_trim_threshold, 2 << 20))


class MemoryMeter:
    def __init__(self, device="cpu", budget_bytes: Optional[float] = None, nvml=None,
                 gpu_index: Optional[int] = None):
        self.device = torch.device(device)
        self.nvml = nvml  # a pynvml-compatible module (hybrid.plan.monitor); None: pynvml, on CUDA only
        # which NVML GPU this rank's device is: NVML's index given, else CUDA_VISIBLE_DEVICES' entry for it
        self._visible = str(gpu_index) if gpu_index is not None else visible_device(self.device.index or 0)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = 0
            self._hwm = False
            self._file_baseline = None
        else:
            load_torch_runtime()
            follow_live_tensors()
            self._hwm = _reset_peak_rss()
            self.baseline = _status_bytes("VmRSS") if self._hwm else _maxrss_bytes()
            self._file_baseline = _status_bytes("RssFile")
        self._gpu = self._nvml_gpu()  # (NVML module, handle, total bytes) of this rank's GPU, or None
        self.budget_bytes = float(budget_bytes) if budget_bytes else self._device_total()

    # -- reading --------------------------------------------------------------------------------------
    def _nvml_gpu(self) -> Optional[tuple]:
        """``(module, handle, total bytes)`` of this rank's GPU in NVML (initialised once per process), or
        None where NVML cannot tell."""
        if not self.cuda and self.nvml is None:
            return None
        from hybrid.plan import monitor

        try:
            module = monitor.session(self.nvml)
            gpu = nvml_gpu(monitor.read_gpus(module), self._visible)
            return None if gpu is None else (module, module.nvmlDeviceGetHandleByIndex(gpu.index), gpu.total_bytes)
        except Exception:  # NVML missing, or a query the driver refused: the meter goes without it
            return None

    def _nvml_figures(self) -> dict:
        """NVML's figures of this rank's GPU now (see the module docstring); {} where NVML cannot tell."""
        if self._gpu is None:
            return {}
        from hybrid.plan import monitor

        module, handle, total = self._gpu
        try:
            device_used = int(module.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # the GPU fell off the bus, the driver went away: no figures this time
            return {}
        out = {"nvml_device_used_bytes": device_used, "nvml_total_bytes": int(total)}
        own = monitor.process_bytes(module, handle)
        if own is not None:
            out["nvml_used_bytes"] = own
        return out

    def _device_total(self) -> Optional[float]:
        if self._gpu is not None:
            return float(self._gpu[2])
        if self.cuda:
            return float(torch.cuda.get_device_properties(self.device).total_memory)
        return None

    def _code_pages_mapped(self) -> int:
        """Bytes of file pages (libraries' code and data) mapped since the baseline: RSS, but not memory the
        job allocated, and how many a first call faults in depends on the page cache (a fresh install
        measured ~45 MB more than a warm one for the same steps)."""
        now = _status_bytes("RssFile")
        return max(0, now - self._file_baseline) if now is not None and self._file_baseline is not None else 0

    def resident_growth(self) -> int:
        """CPU: the RSS growth now (not the peak), counted as ``measure`` counts its peak."""
        return max(0, (_status_bytes("VmRSS") or 0) - self.baseline - self._code_pages_mapped())

    def measure(self) -> dict:
        """This rank's memory now (see the module docstring); the CUDA peaks are reset for the next call."""
        out: dict = {"device": self.device.type}
        if self.cuda:
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            out["reserved_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            out["source"] = "torch.cuda.max_memory_allocated"
        else:
            peak = _status_bytes("VmHWM") if self._hwm else _maxrss_bytes()
            out["peak_bytes"] = max(0, int(peak or 0) - self.baseline - self._code_pages_mapped())
            out["source"] = "peak RSS growth since the engine was built (CPU stand-in)"
        out.update(self._nvml_figures())
        used = out.get("nvml_used_bytes", out["peak_bytes"])
        out["used_bytes"] = int(used)
        if self.budget_bytes:
            out["budget_bytes"] = int(self.budget_bytes)
            out["fraction"] = used / self.budget_bytes
        return out

    # -- the budget -----------------------------------------------------------------------------------
    def check(self, measured: dict) -> None:
        """Raise ``OutOfMemoryError`` when the measured peak (or this process's memory by NVML) exceeds the
        budget."""
        budget = measured.get("budget_bytes")
        if not budget:
            return
        used = max(measured["peak_bytes"], measured.get("nvml_used_bytes", 0))
        if used > budget:
            raise OutOfMemoryError(
                f"measured {used / 1e9:.3f} GB exceeds this rank's memory budget of {budget / 1e9:.3f} GB "
                f"({measured['source']})")


def visible_device(cuda_index: int) -> str:
    """How ``CUDA_VISIBLE_DEVICES`` names ``cuda:<cuda_index>`` (an index, a ``GPU-`` or ``MIG-`` UUID);
    the index itself where the variable does not list it. NVML ignores the variable, CUDA does not."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[cuda_index] if cuda_index < len(visible) else str(cuda_index)


def nvml_gpu(gpus: list, name: str):
    """The NVML GPU that ``name`` (``visible_device``'s answer) denotes, or None where NVML cannot say.

    A UUID may be given by a unique prefix, as CUDA accepts. A MIG instance is None: NVML's figures for
    its parent GPU are not the instance's, so the caller falls back to CUDA's own total.
    """
    if name.isdigit():
        return next((g for g in gpus if g.index == int(name)), None)
    if name.startswith("MIG-"):
        return None
    matches = [g for g in gpus if g.uuid and g.uuid.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def near_oom(measured: dict) -> bool:
    """Whether a measurement is above ``NEAR_OOM`` of its budget."""
    return (measured.get("fraction") or 0) > NEAR_OOM


def should_measure(step: int, every: int, first: int = 3) -> bool:
    """Measure after each of the first ``first`` steps of an attempt, then every ``every`` steps."""
    return step <= first or (every > 0 and step % every == 0)


__all__ = ["MemoryMeter", "follow_live_tensors", "OutOfMemoryError", "NEAR_OOM", "near_oom", "should_measure"]
