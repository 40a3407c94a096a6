"""hybrid.plan.monitor: NVML numbers through an injected fake module and through the real pynvml over a stand-in
of its C library (pynvml's own structures, string decoding and error classes), ``hybrid monitor``'s lines and
JSON for them, and the exact no-driver fallback of this machine."""

import ctypes
import json
import sys
import time
from types import SimpleNamespace

import pynvml
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


class NvmlLibrary:
    """Stands in for libnvidia-ml.so.1 under the real ``pynvml``: every entry point takes and returns what the C
    one does -- out-parameters written through ``byref`` pointers and string buffers, an ``nvmlReturn_t`` -- so
    pynvml's own wrappers, ``c_nvmlMemory_t`` / ``c_nvmlUtilization_t`` structures, bytes-to-str conversion and
    ``NVMLError`` classes turn it into what ``monitor`` parses."""

    def __init__(self, gpus, init_result=0):
        self.gpus, self.init_result, self.calls = gpus, init_result, []

    def _gpu(self, handle):
        return self.gpus[ctypes.cast(handle, ctypes.c_void_p).value - 1]

    def nvmlInitWithFlags(self, flags):
        self.calls.append("init")
        return self.init_result

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0

    def nvmlSystemGetDriverVersion(self, buffer, size):
        buffer.value = b"550.54.15"
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, device):
        ctypes.cast(device, ctypes.POINTER(ctypes.c_void_p)).contents.value = index.value + 1
        return 0

    def nvmlDeviceGetName(self, handle, buffer, size):
        buffer.value = self._gpu(handle)["name"].encode()
        return 0

    def nvmlDeviceGetUUID(self, handle, buffer, size):
        buffer.value = self._gpu(handle)["uuid"].encode()
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        gpu, out = self._gpu(handle), memory._obj
        out.total, out.used, out.free = gpu["total"], gpu["used"], gpu["total"] - gpu["used"] - gpu["reserved"]
        return 0

    def nvmlDeviceGetUtilizationRates(self, handle, utilization):
        gpu = self._gpu(handle)
        if gpu["util"] is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        utilization._obj.gpu, utilization._obj.memory = gpu["util"], 3
        return 0


H200 = {"name": "NVIDIA H200", "uuid": "GPU-5f3c2a8e-0d1b-4c7e-9a6f-1e2d3c4b5a69", "total": 150_754_820_096,
        "used": 1_073_741_824, "reserved": 536_870_912, "util": 37}
MIG = {"name": "NVIDIA H200 MIG 1g.18gb", "uuid": "MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", "total": 19_327_352_832,
       "used": 0, "reserved": 0, "util": None}  # a MIG slice: utilization is "Not Supported"


@pytest.fixture
def real_pynvml(monkeypatch):
    """The installed pynvml with its C library replaced by ``NvmlLibrary`` (``install(gpus)``)."""
    monkeypatch.setattr(monitor, "NVML", None)  # monitor imports the real pynvml

    def install(gpus, init_result=0):
        library = NvmlLibrary(gpus, init_result)
        monkeypatch.setattr(pynvml, "nvmlLib", library)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
        monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
        return library

    return install


def test_probe_parses_what_pynvml_returns_from_the_library(real_pynvml):
    library = real_pynvml([H200, MIG])
    result = probe()
    assert result == NodeProbe(True, "NVML: 2 GPU(s), driver 550.54.15", [
        monitor.GpuInfo(0, "NVIDIA H200", 150_754_820_096, 1_073_741_824, 149_144_207_360, 37.0, H200["uuid"]),
        monitor.GpuInfo(1, "NVIDIA H200 MIG 1g.18gb", 19_327_352_832, 0, 19_327_352_832, None, MIG["uuid"])])
    assert library.calls == ["init", "shutdown"]
    # free is NVML's own figure (here total - used - 512 MiB reserved), not total - used
    assert result.gpus[0].free_bytes != result.gpus[0].total_bytes - result.gpus[0].used_bytes


def test_a_failing_nvml_init_is_the_reason_in_nvmls_words(real_pynvml):
    real_pynvml([H200], init_result=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert probe() == NodeProbe(False, "NVML initialisation failed (Driver Not Loaded)", [])


def test_hybrid_monitor_prints_each_gpu_and_its_json_is_the_probe(real_pynvml, capsys):
    from launch.cli import main

    real_pynvml([H200, MIG])
    assert main(["monitor"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "NVML: 2 GPU(s), driver 550.54.15",
        "GPU 0: NVIDIA H200, 1.1 GB used / 150.8 GB total (149.1 GB free), utilization 37%",
        "GPU 1: NVIDIA H200 MIG 1g.18gb, 0.0 GB used / 19.3 GB total (19.3 GB free), utilization n/a"]
    assert main(["monitor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "available": True, "reason": "NVML: 2 GPU(s), driver 550.54.15", "gpus": [
            {"index": 0, "name": "NVIDIA H200", "total_bytes": 150_754_820_096, "used_bytes": 1_073_741_824,
             "free_bytes": 149_144_207_360, "utilization": 37.0, "uuid": H200["uuid"]},
            {"index": 1, "name": "NVIDIA H200 MIG 1g.18gb", "total_bytes": 19_327_352_832, "used_bytes": 0,
             "free_bytes": 19_327_352_832, "utilization": None, "uuid": MIG["uuid"]}]}


def _nvml_library_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_the_no_gpu_fallback_on_this_machine(capsys):
    """The real pynvml on this machine: without the NVML library (no NVIDIA driver) the exact fallback fields,
    and ``hybrid monitor`` says so; with it, every GPU NVML counts."""
    from launch.cli import main

    result = probe()
    if not _nvml_library_loads():
        assert result == NodeProbe(False, "NVML initialisation failed (NVML Shared Library Not Found)", [])
        assert result.as_dict() == {"available": False, "gpus": [],
                                    "reason": "NVML initialisation failed (NVML Shared Library Not Found)"}
        assert main(["monitor"]) == 0
        assert capsys.readouterr().out == "no NVML: NVML initialisation failed (NVML Shared Library Not Found)\n"
    else:  # a machine with an NVIDIA driver
        pynvml.nvmlInit()
        try:
            count, driver = pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        assert result.available and result.reason == f"NVML: {count} GPU(s), driver {driver}"
        assert [g.index for g in result.gpus] == list(range(count))
        assert all(g.total_bytes >= g.used_bytes + g.free_bytes > 0 and g.name for g in result.gpus), result


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
