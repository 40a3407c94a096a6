"""hybrid.plan.monitor: NVML numbers through an injected fake module, and the real no-driver fallback."""

import sys
import time
from types import SimpleNamespace

import pytest

from hybrid.plan import monitor
from hybrid.plan.monitor import NodeProbe, Sampler, probe

GiB = 2**30


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """The pynvml calls monitor.py makes, answered from a list of GPUs; used memory can move per call."""

    def __init__(self, gpus, fail_init=False, util_supported=True):
        self.gpus = gpus
        self.fail_init = fail_init
        self.util_supported = util_supported
        self.initialised = 0
        self.memory_reads = 0

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle):
        return handle["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.memory_reads += 1
        used = handle["used"] + handle.get("grow", 0) * self.memory_reads
        return SimpleNamespace(total=handle["total"], used=used, free=handle["total"] - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return handle.get("processes", [])

    def nvmlDeviceGetUtilizationRates(self, handle):
        if not self.util_supported:
            raise FakeNvmlError("Not Supported")
        return SimpleNamespace(gpu=handle["util"], memory=0)


def _two_h100s():
    return [
        {"name": b"NVIDIA H100 80GB HBM3", "total": 80 * GiB, "used": 1 * GiB, "util": 37},
        {"name": "NVIDIA H100 80GB HBM3", "total": 80 * GiB, "used": 3 * GiB, "util": 0},
    ]


def test_probe_reads_every_gpu_from_nvml():
    fake = FakeNvml(_two_h100s())
    result = probe(nvml=fake)
    assert result.available and "2 GPU(s)" in result.reason and "550.54.15" in result.reason
    first, second = result.gpus
    assert first == monitor.GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GiB, 1 * GiB, 79 * GiB, 37.0)
    assert second == monitor.GpuInfo(1, "NVIDIA H100 80GB HBM3", 80 * GiB, 3 * GiB, 77 * GiB, 0.0)
    assert fake.initialised == 0  # shut down again


def test_probe_uses_module_attribute_and_tolerates_unsupported_utilization(monkeypatch):
    monkeypatch.setattr(monitor, "NVML", FakeNvml(_two_h100s(), util_supported=False))
    result = probe()
    assert result.available and [g.utilization for g in result.gpus] == [None, None]


def test_probe_reports_failed_init_without_raising():
    result = probe(nvml=FakeNvml([], fail_init=True))
    assert result == NodeProbe(False, "NVML initialisation failed (Driver Not Loaded)", [])


def test_probe_reports_missing_package(monkeypatch):
    monkeypatch.setattr(monitor, "NVML", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    result = probe()
    assert not result.available and "nvidia-ml-py" in result.reason


def test_probe_on_this_machine_never_raises():
    result = probe()  # the real pynvml
    assert isinstance(result, NodeProbe) and result.reason
    if result.available:  # a machine with an NVIDIA driver
        assert all(gpu.total_bytes > 0 for gpu in result.gpus)
    else:
        assert result.gpus == [] and "NVML" in result.reason


def _wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "sampler produced no samples in time"
        time.sleep(0.005)


def test_sampler_records_until_stopped():
    gpus = _two_h100s()
    gpus[0]["grow"] = 1024  # used memory rises with every read
    fake = FakeNvml(gpus)
    sampler = Sampler(interval_s=0.01, nvml=fake).start()
    assert sampler.available
    _wait_for(lambda: len(sampler.samples) >= 3)
    samples = sampler.stop()
    assert len(samples) >= 3 and fake.initialised == 0
    assert all(len(s.gpus) == 2 for s in samples)
    assert [s.time for s in samples] == sorted(s.time for s in samples)
    assert sampler.peak_used_bytes()[0] == samples[-1].gpus[0].used_bytes > samples[0].gpus[0].used_bytes
    count = len(sampler.samples)
    time.sleep(0.05)
    assert len(sampler.samples) == count  # nothing after stop()


def test_sampler_context_manager_without_nvml():
    with Sampler(interval_s=0.01, nvml=FakeNvml([], fail_init=True)) as sampler:
        assert not sampler.available and "Driver Not Loaded" in sampler.reason
    assert sampler.samples == [] and sampler.peak_used_bytes() == {}


def test_sampler_stops_cleanly_when_a_query_fails():
    fake = FakeNvml(_two_h100s())
    sampler = Sampler(interval_s=0.01, nvml=fake).start()
    _wait_for(lambda: len(sampler.samples) >= 1)
    fake.gpus = None  # the next nvmlDeviceGetCount raises
    _wait_for(lambda: not sampler.available)
    sampler.stop()
    assert "NVML query failed" in sampler.reason and fake.initialised == 0


def test_sampler_rejects_bad_interval():
    with pytest.raises(ValueError):
        Sampler(interval_s=0)
