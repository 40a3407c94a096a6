"""GPU facts from NVML (nvidia-ml-py): a one-shot ``probe()`` of this node, a background ``Sampler``, and
``session()``, NVML initialised once for the whole process (the rank's memory meter reads it every few
steps), with ``process_bytes`` reading what one process holds on a GPU.

Neither ever raises because NVML is missing or failing (no driver, no GPU, a query the GPU does not
support): ``probe()`` then returns ``NodeProbe(available=False, reason=...)`` and the caller falls back to
the memory declared in cluster.yaml; a ``Sampler`` records nothing and carries the same reason.

The NVML module is injectable: pass ``nvml=`` to ``probe``/``Sampler``, or set ``monitor.NVML`` (``None``
means ``import pynvml``). Utilization is NVML's GPU busy percentage (0-100), ``None`` where unsupported.

A GPU's ``used_bytes`` is device-wide: every process's memory on it, and the driver's. What one process
holds is its record in ``nvmlDeviceGetComputeRunningProcesses`` (``own_bytes`` picks it from the records);
NVML cannot say where the record is missing (a PID namespace: NVML lists host PIDs) or the figure is not
available.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field

NVML = None  # the pynvml-compatible module to use; None: import pynvml on first use
# NVML's "not available" (NVML_VALUE_NOT_AVAILABLE as an unsigned long long), which pynvml turns into None
NOT_AVAILABLE = (1 << 64) - 1


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization: float | None
    uuid: str = ""  # NVML's "GPU-..." identifier, what CUDA_VISIBLE_DEVICES may name instead of an index


@dataclass(frozen=True)
class NodeProbe:
    available: bool
    reason: str
    gpus: list[GpuInfo] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Sample:
    time: float  # time.time() when taken
    gpus: list[GpuInfo]


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised; the message says why."""


def _module(nvml):
    if nvml is not None:
        return nvml
    if NVML is not None:
        return NVML
    try:
        import pynvml
    except ImportError as err:
        raise NvmlUnavailable(f"nvidia-ml-py is not importable ({err})") from None
    return pynvml


def _init(nvml):
    """Load and initialise NVML, returning the module; ``NvmlUnavailable`` if either fails."""
    module = _module(nvml)
    try:
        module.nvmlInit()
    except Exception as err:  # pynvml raises NVMLError subclasses; a broken library may raise anything
        raise NvmlUnavailable(f"NVML initialisation failed ({err})") from None
    return module


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus(nvml) -> list[GpuInfo]:
    """Every GPU of this node, from ``nvml`` (initialised)."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # not supported on some GPUs (e.g. MIG slices)
            utilization = None
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception:  # an older library or a fake without it: the index still selects the GPU
            uuid = ""
        gpus.append(
            GpuInfo(
                index=index,
                name=_text(nvml.nvmlDeviceGetName(handle)),
                total_bytes=int(memory.total),
                used_bytes=int(memory.used),
                free_bytes=int(memory.free),
                utilization=utilization,
                uuid=uuid,
            )
        )
    return gpus


_sessions: dict = {}  # id(module) -> (module, None once initialised, or the NvmlUnavailable it failed with)
_sessions_lock = threading.Lock()


def session(nvml=None):
    """The NVML module (``nvml``, ``monitor.NVML`` or pynvml), initialised once for this process and kept
    initialised: later calls return it without initialising again. Raises ``NvmlUnavailable`` where NVML
    cannot be loaded or initialised (a failed initialisation is not tried again)."""
    module = _module(nvml)
    with _sessions_lock:
        if id(module) not in _sessions:  # the module is kept in the entry, so its id is never reused
            try:
                _sessions[id(module)] = (_init(module), None)
            except NvmlUnavailable as err:
                _sessions[id(module)] = (module, err)
        _, error = _sessions[id(module)]
    if error is not None:
        raise NvmlUnavailable(str(error))
    return module


def own_bytes(processes, pid: int):
    """Bytes the process ``pid`` holds according to NVML process records (``nvmlDeviceGetComputeRunningProcesses``'
    ``pid`` and ``usedGpuMemory``): the sum of its records, or None where it has none or NVML gives no figure
    for one (None, or NVML's not-available value)."""
    mine = [p for p in processes if int(p.pid) == pid]
    if not mine:
        return None
    used = [p.usedGpuMemory for p in mine]
    if any(u is None or int(u) == NOT_AVAILABLE for u in used):
        return None
    return sum(int(u) for u in used)


def process_bytes(nvml, handle, pid: int = None):
    """Bytes process ``pid`` (default: this one) holds on the GPU ``handle`` names, or None where NVML cannot
    tell (see ``own_bytes``; also where the query itself is not supported)."""
    try:
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # not supported (some vGPU and MIG set-ups), no permission, or an older library
        return None
    return own_bytes(processes, os.getpid() if pid is None else pid)


def _shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


def probe(nvml=None) -> NodeProbe:
    """The GPUs of this node as NVML sees them, or ``available=False`` with the reason."""
    try:
        module = _init(nvml)
    except NvmlUnavailable as err:
        return NodeProbe(available=False, reason=str(err))
    try:
        gpus = read_gpus(module)
        try:
            driver = f", driver {_text(module.nvmlSystemGetDriverVersion())}"
        except Exception:
            driver = ""
    except Exception as err:
        return NodeProbe(available=False, reason=f"NVML query failed ({err})")
    finally:
        _shutdown(module)
    return NodeProbe(available=True, reason=f"NVML: {len(gpus)} GPU(s){driver}", gpus=gpus)


class Sampler:
    """Reads every GPU of this node each ``interval_s`` seconds on a daemon thread, from start() to stop().

    Use as a context manager or call ``start()``/``stop()``. ``samples`` is a snapshot list of ``Sample``;
    ``peak_used_bytes()`` the highest used memory seen per GPU index. When NVML is unavailable,
    ``available`` is False, ``reason`` says why, and nothing is recorded.
    """

    def __init__(self, interval_s: float = 1.0, nvml=None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self.available = False
        self.reason = "not started"
        self._nvml_arg = nvml
        self._nvml = None
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Sampler":
        if self._thread is not None:
            return self
        try:
            self._nvml = _init(self._nvml_arg)
        except NvmlUnavailable as err:
            self.available, self.reason = False, str(err)
            return self
        self.available, self.reason = True, "sampling"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hybrid-nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        """Stop sampling, release NVML, and return the samples."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            _shutdown(self._nvml)
            self._nvml = None
            if self.available:
                self.reason = "stopped"
        return self.samples

    def _run(self) -> None:
        while True:
            try:
                gpus = read_gpus(self._nvml)
            except Exception as err:
                self.available, self.reason = False, f"NVML query failed ({err})"
                return
            with self._lock:
                self._samples.append(Sample(time.time(), gpus))
            if self._stop.wait(self.interval_s):
                return

    @property
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def peak_used_bytes(self) -> dict[int, int]:
        peaks: dict[int, int] = {}
        for sample in self.samples:
            for gpu in sample.gpus:
                peaks[gpu.index] = max(peaks.get(gpu.index, 0), gpu.used_bytes)
        return peaks

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
