"""The rank's memory meter holds this process's GPU memory against the budget, not the GPU's: another process
on the same GPU is not near-OOM of ours. NVML is initialised once per process.

The selection runs on pynvml's own process records (``c_nvmlProcessInfo_t`` through
``nvmlStructToFriendlyObject``, as ``nvmlDeviceGetComputeRunningProcesses`` returns them); the meter's NVML
is the fake module of ``test_monitor`` (no driver here) answering with those records.
"""

import os

import pynvml
import pytest

from hybrid.plan import monitor
from hybrid.plan.budget import MemoryMeter, near_oom
from launch.job.memory_view import memory_table
from tests.unit.test_monitor import FakeNvml, _two_h100s

GiB = 2**30


def process_record(pid: int, used_bytes, raw: bool = False):
    """One record of ``nvmlDeviceGetComputeRunningProcesses`` as pynvml builds it (``used_bytes`` None: NVML's
    not-available value, which pynvml turns into None; ``raw``: the C struct itself, unconverted)."""
    value = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used_bytes is None else used_bytes
    struct = pynvml.c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=value, gpuInstanceId=0, computeInstanceId=0)
    if raw:
        return struct
    record = pynvml.nvmlStructToFriendlyObject(struct)
    if record.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        record.usedGpuMemory = None
    return record


def test_own_bytes_are_this_pids_records_and_nothing_where_nvml_cannot_say():
    me, other = 4242, 777
    records = [process_record(other, 20 * GiB), process_record(me, 3 * GiB)]
    assert monitor.own_bytes(records, me) == 3 * GiB
    assert monitor.own_bytes(records + [process_record(me, GiB)], me) == 4 * GiB  # one record per context
    assert monitor.own_bytes([process_record(other, 20 * GiB)], me) is None  # a PID namespace: host PIDs
    assert monitor.own_bytes([process_record(me, None)], me) is None
    assert monitor.own_bytes([process_record(me, None, raw=True)], me) is None  # the raw not-available value
    assert monitor.own_bytes([process_record(me, 5 * GiB, raw=True)], me) == 5 * GiB
    assert monitor.own_bytes([], me) is None
    assert monitor.NOT_AVAILABLE == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value


def _gpu_shared_with_another_process(own_bytes):
    gpus = _two_h100s()
    gpus[0]["used"] = 70 * GiB  # the other process's 68 GiB and ours
    gpus[0]["processes"] = [process_record(os.getpid() + 1, 68 * GiB)]
    if own_bytes is not None:
        gpus[0]["processes"].append(process_record(os.getpid(), own_bytes))
    return gpus


def test_another_process_on_the_gpu_is_not_this_ranks_memory():
    meter = MemoryMeter("cpu", nvml=FakeNvml(_gpu_shared_with_another_process(2 * GiB)), gpu_index=0)
    m = meter.measure()
    assert m["nvml_used_bytes"] == m["used_bytes"] == 2 * GiB and not near_oom(m)
    assert m["nvml_device_used_bytes"] == 70 * GiB and m["nvml_total_bytes"] == 80 * GiB == meter.budget_bytes
    predicted = dict(params=0, grads=0, optimizer=0, model_states=0, inflight=0, optimizer_transient=0,
                     activations=0, runtime_reserve=0, peak=GiB, total=GiB)
    table = "\n".join(memory_table(predicted, {0: m}, {}))
    assert "NVML used by the rank (total)" in table and "NVML used on the whole GPU: 75.162 GB" in table


def test_without_a_record_of_this_process_the_meter_holds_its_own_peak():
    meter = MemoryMeter("cpu", budget_bytes=10**12, nvml=FakeNvml(_gpu_shared_with_another_process(None)),
                        gpu_index=0)
    m = meter.measure()
    assert "nvml_used_bytes" not in m and m["used_bytes"] == m["peak_bytes"]
    assert m["nvml_device_used_bytes"] == 70 * GiB  # still shown


class CountingNvml(FakeNvml):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_calls = 0

    def nvmlInit(self):
        self.init_calls += 1
        super().nvmlInit()


def test_nvml_is_initialised_once_per_process_and_kept():
    fake = CountingNvml(_gpu_shared_with_another_process(GiB))
    meters = [MemoryMeter("cpu", nvml=fake, gpu_index=0) for _ in range(2)]
    for _ in range(3):
        for meter in meters:
            assert meter.measure()["nvml_used_bytes"] == GiB
    assert fake.init_calls == 1 and fake.initialised == 1  # never shut down under the meters
    assert monitor.probe(fake).available and fake.initialised == 1  # a probe pairs its own init and shutdown


def test_a_failed_initialisation_is_not_tried_at_every_measurement():
    fake = CountingNvml([], fail_init=True)
    with pytest.raises(monitor.NvmlUnavailable, match="Driver Not Loaded"):
        monitor.session(fake)
    meter = MemoryMeter("cpu", budget_bytes=10**12, nvml=fake)
    for _ in range(3):
        assert "nvml_total_bytes" not in meter.measure()
    assert fake.init_calls == 1
