"""Every number the time model (``hybrid.plan.cost``) assumes, in one place, each with its source.

Three tables and a few factors:

* ``GPUS``: known GPUs by their NVML name (``nvmlDeviceGetName``, what ``hybrid monitor`` prints): dense peak
  FLOP/s in bf16 (tensor cores) and fp32 (CUDA cores: torch leaves TF32 off for matmuls), device memory
  bandwidth, NVLink and PCIe bandwidth per direction. ``gpu_spec(name)`` finds one by its NVML name or a
  short name (``H100``, ``a100-40gb``).
* ``LINKS``: known links by the names cluster.yaml's ``interconnect`` takes (``nvlink``, ``pcie``,
  ``infiniband``, ``roce``, ``ethernet``, ``loopback``): bandwidth per direction of one port (one GPU's
  NVLink or PCIe, one NIC), the latency of a collective on it, and how many ports a node has by default.
* ``EFFICIENCY``: what fraction of a peak real training reaches, and how much traffic hides behind compute.
* ``NVME``: a node's local NVMe disk, where NVMe offload keeps the optimizer states (sequential read and write
  rates of one drive, the drives a node has).

Bandwidths are bytes per second in one direction (datasheets often quote both directions added: NVLink 4's
"900 GB/s" is 450 GB/s each way); 1 Gb/s = 0.125 GB/s; GB = 10^9. Measured figures (``hybrid probe``)
replace these; ``cluster.gpu_tflops`` and ``cluster.interconnect.*_gbps`` replace them as declared facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GpuSpec:
    name: str            # NVML's name
    bf16_flops: float    # dense tensor-core peak, FLOP/s
    fp32_flops: float    # dense CUDA-core fp32 peak, FLOP/s (torch's default: no TF32 in matmuls)
    memory_bandwidth: float  # device memory, bytes/s
    nvlink: Optional[float]  # per GPU, one direction, bytes/s; None: no NVLink
    pcie: float          # host link per GPU, one direction, bytes/s
    source: str

    def peak(self, precision: str) -> float:
        return self.bf16_flops if precision == "bf16" else self.fp32_flops


# PCIe per direction, x16 (PCI-SIG: 16 GT/s Gen4, 32 GT/s Gen5, 128b/130b encoding).
PCIE_GEN4 = 31.5 * GB
PCIE_GEN5 = 63.0 * GB

GPUS = {g.name: g for g in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity (989.4 dense), FP32 67
    # TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both directions).
    GpuSpec("NVIDIA H100 80GB HBM3", 989.4 * TFLOPS, 66.9 * TFLOPS, 3350 * GB, 450 * GB, PCIE_GEN5,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"),
    # Same datasheet, H100 PCIe column: BF16 1,513 sparse (756 dense), FP32 51, 2 TB/s, NVLink bridge 600 GB/s.
    GpuSpec("NVIDIA H100 PCIe", 756.0 * TFLOPS, 51.2 * TFLOPS, 2000 * GB, 300 * GB, PCIE_GEN5,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column"),
    # H100 NVL column: BF16 1,671 sparse (835.5 dense), FP32 60, 3.9 TB/s, NVLink bridge 600 GB/s.
    GpuSpec("NVIDIA H100 NVL", 835.5 * TFLOPS, 60.0 * TFLOPS, 3900 * GB, 300 * GB, PCIE_GEN5,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 sparse (989 dense), FP32 67, HBM3e 4.8 TB/s,
    # NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    GpuSpec("NVIDIA H200", 989.4 * TFLOPS, 66.9 * TFLOPS, 4800 * GB, 450 * GB, PCIE_GEN5,
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 dense (624 sparse), FP32 19.5, NVLink 600 GB/s,
    # PCIe Gen4 64 GB/s; HBM2e 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe), HBM2 1,555 GB/s (40GB).
    GpuSpec("NVIDIA A100-SXM4-80GB", 312.0 * TFLOPS, 19.5 * TFLOPS, 2039 * GB, 300 * GB, PCIE_GEN4,
            "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column"),
    GpuSpec("NVIDIA A100-SXM4-40GB", 312.0 * TFLOPS, 19.5 * TFLOPS, 1555 * GB, 300 * GB, PCIE_GEN4,
            "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column"),
    GpuSpec("NVIDIA A100 80GB PCIe", 312.0 * TFLOPS, 19.5 * TFLOPS, 1935 * GB, 300 * GB, PCIE_GEN4,
            "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe column"),
    GpuSpec("NVIDIA A100-PCIE-40GB", 312.0 * TFLOPS, 19.5 * TFLOPS, 1555 * GB, 300 * GB, PCIE_GEN4,
            "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB PCIe column"),
    # NVIDIA HGX B200 datasheet (8 GPUs): BF16 36 PFLOPS sparse (2.25 dense per GPU), FP32 600 TFLOPS (75 per
    # GPU), HBM3e 64 TB/s (8 per GPU), NVLink 5 1.8 TB/s per GPU (both directions), PCIe Gen5 host link.
    GpuSpec("NVIDIA B200", 2250.0 * TFLOPS, 75.0 * TFLOPS, 8000 * GB, 900 * GB, PCIE_GEN5,
            "NVIDIA HGX B200 datasheet, per GPU"),
    # NVIDIA L40S datasheet: BF16 733 sparse (362.05 dense), FP32 91.6, GDDR6 864 GB/s, PCIe Gen4 x16, no NVLink.
    GpuSpec("NVIDIA L40S", 362.05 * TFLOPS, 91.6 * TFLOPS, 864 * GB, None, PCIE_GEN4, "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: BF16 242 sparse (121 dense), FP32 30.3, 300 GB/s, PCIe Gen4 x16.
    GpuSpec("NVIDIA L4", 121.0 * TFLOPS, 30.3 * TFLOPS, 300 * GB, None, PCIE_GEN4, "NVIDIA L4 datasheet"),
    # NVIDIA A10 datasheet: BF16 250 sparse (125 dense), FP32 31.2, 600 GB/s, PCIe Gen4 x16.
    GpuSpec("NVIDIA A10", 125.0 * TFLOPS, 31.2 * TFLOPS, 600 * GB, None, PCIE_GEN4, "NVIDIA A10 datasheet"),
)}

# Short names a user may write (``hybrid estimate --gpu H100``): the SXM part where there are several.
GPU_ALIASES = {"h100": "NVIDIA H100 80GB HBM3", "h100-sxm": "NVIDIA H100 80GB HBM3", "h100-pcie": "NVIDIA H100 PCIe",
               "h100-nvl": "NVIDIA H100 NVL", "h200": "NVIDIA H200", "a100": "NVIDIA A100-SXM4-80GB",
               "a100-80gb": "NVIDIA A100-SXM4-80GB", "a100-40gb": "NVIDIA A100-SXM4-40GB",
               "a100-pcie": "NVIDIA A100 80GB PCIe", "b200": "NVIDIA B200", "l40s": "NVIDIA L40S", "l4": "NVIDIA L4",
               "a10": "NVIDIA A10"}


def gpu_spec(name: str) -> Optional[GpuSpec]:
    """The table's GPU of NVML name (or short name) ``name``; None when unknown. NVML names carry variants
    (``NVIDIA H100 80GB HBM3``, ``NVIDIA H200 NVL``): an exact name first, then an alias, then the longest
    table name that is a prefix of it."""
    if name in GPUS:
        return GPUS[name]
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    if key in GPU_ALIASES:
        return GPUS[GPU_ALIASES[key]]
    prefixes = [g for g in GPUS if name.startswith(g)]
    return GPUS[max(prefixes, key=len)] if prefixes else None


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth: float  # one port, one direction, bytes/s
    latency: float    # seconds per collective call (small messages), order of magnitude
    ports: Optional[int]  # ports per node for inter-node links; None: one per GPU (rail-optimized)
    source: str


LINKS = {lk.name: lk for lk in (
    # NVLink 4 (H100/H200): 900 GB/s both directions per GPU (H100 datasheet); the GPU's own generation
    # (GPUS[...].nvlink) replaces it where the GPU is known. Latency: NCCL small-message all-reduce inside a
    # DGX, ~10 us (nccl-tests all_reduce_perf at 8 B-1 KB).
    LinkSpec("nvlink", 450 * GB, 10e-6, None, "NVLink 4, NVIDIA H100 datasheet (900 GB/s both directions)"),
    # PCIe Gen4 x16 per GPU (PCI-SIG); GPUs talking through the host bridge.
    LinkSpec("pcie", PCIE_GEN4, 20e-6, None, "PCIe Gen4 x16, PCI-SIG 4.0 (16 GT/s x 16 lanes, 128b/130b)"),
    # NDR InfiniBand 400 Gb/s per port (NVIDIA ConnectX-7 datasheet); DGX H100: 8 single-port ConnectX-7 for
    # compute, one per GPU (DGX H100 datasheet). Latency ~20 us for a NCCL collective across nodes.
    LinkSpec("infiniband", 400 / 8 * GB, 20e-6, None, "NDR 400 Gb/s per NIC, NVIDIA ConnectX-7 datasheet; "
             "one NIC per GPU as in the DGX H100 datasheet"),
    # RoCE at 400 GbE per port, one per GPU (Meta's Llama 3 RoCE cluster: 400 Gbps per GPU, Llama 3 paper §3.3.1).
    LinkSpec("roce", 400 / 8 * GB, 25e-6, None, "400 GbE RoCE per GPU, The Llama 3 Herd of Models, sec. 3.3.1"),
    # Plain Ethernet: one 100 GbE port per node, TCP (NCCL's socket transport), ~50 us per collective.
    LinkSpec("ethernet", 100 / 8 * GB, 50e-6, 1, "100 GbE, one port per node (IEEE 802.3ba line rate)"),
    # Ranks on one host: collectives are memory copies through shared memory (hybrid.comm.shm) or gloo over
    # TCP loopback. No datasheet: the order measured by `hybrid probe` on a 2-core Xeon (bench/RESULTS.md).
    LinkSpec("loopback", 2 * GB, 100e-6, 1, "one host's shared-memory copies, measured by hybrid probe "
             "(bench/RESULTS.md); run hybrid probe for this machine's"),
)}
# cluster.yaml may leave the interconnect unspecified: NVLink inside a node and InfiniBand across nodes,
# the setting of clusters/dgx-h100-8x8.yaml and of most published training runs.
DEFAULT_INTRA, DEFAULT_INTER = "nvlink", "infiniband"

# Fraction of a link's line rate a ring collective reaches: nccl-tests' bus bandwidth on DGX H100 is
# ~360 GB/s of NVLink 4's 450 GB/s and ~45 GB/s of a 50 GB/s NDR port (NVIDIA, "NCCL tests" README, bus
# bandwidth; DGX SuperPOD H100 reference architecture). Applied to table bandwidths only, never to probed ones.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Efficiency:
    compute: float         # of the datasheet peak: what a transformer's whole step reaches in matmuls
    compute_measured: float  # of a probed large matmul's rate (the rest: small matmuls, norms, softmax)
    compute_measured_cpu: float  # the same for CPU ranks, at their share of the host's cores
    overlap: float         # fraction of the overlappable traffic that hides behind compute (GPUs)
    overlap_cpu: float     # the same for CPU ranks
    host_adam: float       # parameters per second one host core steps with fused AdamW (offload)


EFFICIENCY = Efficiency(
    # Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
    # Megatron-LM", SC'21) sustain 44-52% of A100 peak; Megatron-Core reports up to 47% MFU on H100:
    # half the datasheet peak is what tuned transformer training gets from its matmuls.
    compute=0.5,
    # A whole step against one large matmul on the same device: small matmuls, layer norms, softmax, the
    # loss and Python overhead. The bench's 4M GPT (bench/time_model.py's) did forward + backward at 0.5-0.8 of
    # a 1024^3 fp32 matmul's rate on one core of the 2-core Xeon (micro-batches 2-8, a busy machine): 0.7.
    compute_measured=0.7,
    # CPU ranks sharing a host's cores (the probe gives each its share: launch.planning.probe_figures): the 24
    # layouts of bench/time_model.py (4 ranks on 2 cores, 2026-12-04, with the shared rate at 0.7) measured
    # 1.16-1.73x the prediction, 1.4x typical -- each rank's Python, copies and collectives' own CPU work take
    # turns with its matmuls on the same cores: 0.5, checked on a second run (bench/RESULTS.md). Since the
    # per-micro-step cost is a term of its own (hybrid.plan.cost: ops and passes over the parameters, which
    # this factor had absorbed), 0.6: the factor that centres the 18 layouts of the 30-step run (measured /
    # predicted 0.83-1.24, geometric mean 1.0), checked on a fresh run (bench/RESULTS.md).
    compute_measured_cpu=0.6,
    # Bucketed reduce-scatter in backward and stage-3 prefetch hide most of their traffic (PyTorch FSDP
    # paper, Zhao et al. 2023, fig. 7: backward prefetch ~ no exposed all-gather); 0.8 leaves a margin
    # for the last bucket and stream contention.
    overlap=0.8,
    # CPU ranks: hybrid.comm.shm copies in the calling thread (the collective returns done) and gloo's worker
    # threads share the rank's one core with its compute, so nothing hides.
    overlap_cpu=0.0,
    # hybrid.zero.optimizer: fused AdamW over 4.3M fp32 elements took 9.2 ms on one core (~470M/s).
    host_adam=4.7e8,
)

# Bytes one Adam(W) step touches per parameter: read fp32 master, both moments and the gradient (16 B),
# write master and moments (12 B): 28 B at the device's memory bandwidth (memory bound).
ADAM_BYTES_PER_PARAM = 28

# Host time per eager op a micro-step dispatches (hybrid.plan.cost's per-micro-step term): PyTorch's dispatcher,
# autograd's bookkeeping and, on a GPU, the kernel launch (CUDA's launch alone takes ~5 us: NVIDIA's CUDA C++ Best
# Practices Guide, "kernel launch overhead"; eager PyTorch adds its dispatch on top): 10 us per op on a GPU. A CPU
# rank: 5.6 us per op of a small layer norm, linear, GELU, linear forward and backward measured on one core of
# the 2-core Xeon (the probe's own workload, hybrid.runtime.probe). `hybrid probe` measures either.
OP_OVERHEAD = {"gpu": 10e-6, "cpu": 5.6e-6}

# Host cores per GPU stepping an offloaded optimizer: a DGX H100 has 112 cores for 8 GPUs (DGX H100 datasheet).
HOST_CORES_PER_GPU = 14


@dataclass(frozen=True)
class DiskSpec:
    name: str
    read: float    # one drive, sequential, bytes/s
    write: float   # one drive, sequential, bytes/s
    drives: int    # drives per node, striped together (RAID-0)
    source: str


# The DGX H100 datasheet lists 8 x 3.84 TB NVMe U.2 data drives (plus two M.2 boot drives), which DGX OS
# stripes into one RAID-0 array (/raid); a PCIe Gen4 U.2 data-centre drive of that size reads ~7.0 GB/s and
# writes ~3.8 GB/s sequentially (Samsung PM1733 3.84 TB datasheet). No measurement here: `hybrid probe`
# measures the disk's free space, not its speed.
NVME = DiskSpec("nvme", 7.0 * GB, 3.8 * GB, 8, "8 x PCIe Gen4 U.2 drives in RAID-0 (DGX H100 datasheet), 7.0 GB/s "
                "read and 3.8 GB/s write each (Samsung PM1733 3.84 TB datasheet)")
# Of the drives' sequential rates, what the swap store's large aligned O_DIRECT transfers through a filesystem
# and a RAID layer are taken to reach: a margin, not a measurement (as LINK_EFFICIENCY is for links).
DISK_EFFICIENCY = 0.8


def nvme_disk():
    """A node's NVMe disk as the time model sees it (``hybrid.plan.cost.Disk``): the table's drives at
    ``DISK_EFFICIENCY``."""
    from hybrid.plan.cost import Disk

    return Disk(NVME.read * NVME.drives * DISK_EFFICIENCY, NVME.write * NVME.drives * DISK_EFFICIENCY,
                f"{NVME.source}, at {DISK_EFFICIENCY:g} of them")

# A CPU rank (no GPU: ranks on cores, gloo): one core's fp32 matmul rate, AVX-512 FMA at ~2.5 GHz
# (2 x 16 fp32 FMA lanes x 2 FLOP x 2.5 GHz = 160 GFLOP/s), memory ~10 GB/s per core. Only a placeholder
# until `hybrid probe` measures the real ones.
CPU_RANK = GpuSpec("cpu", 160e9, 160e9, 10 * GB, None, 10 * GB, "one AVX-512 core at 2.5 GHz (no datasheet: "
                   "run hybrid probe)")


# ------------------------------------------------------------------------------------- the model's input

def _link_spec(name: Optional[str], default: str) -> LinkSpec:
    return LINKS[name if name in LINKS else default]


def build_hardware(device: Optional[str], precision: str, intra: Optional[str], inter: Optional[str],
                   gpus_per_node: int, *, nics_per_node: Optional[int] = None, gpu_tflops: Optional[float] = None,
                   intra_gbps: Optional[float] = None, inter_gbps: Optional[float] = None,
                   probe: Optional[dict] = None):
    """The ``hybrid.plan.cost.Hardware`` for a cluster: the probe's figures (``probe.json``, see
    ``launch.planning.probe_figures``) where it measured them, else the declared ones (``gpu_tflops``: peak TFLOP/s per
    GPU; ``*_gbps``: line rate of one port in Gb/s, one direction; ``nics_per_node``), else the tables.
    ``device``: the GPU's NVML name, ``cpu`` for CPU ranks, None when not known (the table's default GPU,
    an H100 SXM, said in the sources). ``intra`` / ``inter``: cluster.yaml's link names."""
    from hybrid.plan.cost import Hardware, Link

    sources = []
    if device == "cpu":
        gpu = CPU_RANK
    else:
        gpu = gpu_spec(device) if device else None
        if gpu is None:
            gpu = GPUS[GPU_ALIASES["h100"]]
            sources.append(("GPU", f"{device or 'not known before probing'}: not in the table, taken as {gpu.name}"))
    peak, efficiency = gpu.peak(precision), EFFICIENCY.compute
    peak_source = gpu.source
    if gpu_tflops is not None:
        peak, peak_source = gpu_tflops * TFLOPS, "cluster.gpu_tflops"
    elif device == "cpu":
        efficiency = EFFICIENCY.compute_measured
    optimizer_rate = gpu.memory_bandwidth / ADAM_BYTES_PER_PARAM if device != "cpu" else EFFICIENCY.host_adam
    intra_spec = _link_spec(intra, "loopback" if device == "cpu" else DEFAULT_INTRA)
    inter_spec = _link_spec(inter, "loopback" if device == "cpu" else DEFAULT_INTER)
    intra_bw = (gpu.nvlink if intra_spec.name == "nvlink" and gpu.nvlink else
                gpu.pcie if intra_spec.name == "pcie" else intra_spec.bandwidth)
    intra_source = intra_spec.source if intra_spec.name != "nvlink" or not gpu.nvlink else f"NVLink of {gpu.source}"
    if intra_gbps is not None:
        intra_bw, intra_source = intra_gbps / 8 * GB, "cluster.interconnect.intra_node_gbps"
    ports = nics_per_node or inter_spec.ports or gpus_per_node
    inter_bw, inter_source = inter_spec.bandwidth, inter_spec.source
    if inter_gbps is not None:
        inter_bw, inter_source = inter_gbps / 8 * GB, "cluster.interconnect.inter_node_gbps"
    intra_link = Link(intra_bw * LINK_EFFICIENCY, intra_spec.latency, intra_source)
    inter_link = Link(inter_bw * ports * LINK_EFFICIENCY, inter_spec.latency,
                      f"{ports} x {inter_bw * 8 / GB:g} Gb/s: {inter_source}")
    pcie = Link(gpu.pcie * LINK_EFFICIENCY, LINKS["pcie"].latency, gpu.source)
    if probe:
        peak, efficiency, optimizer_rate, intra_link, inter_link, measured = _probed(
            probe, precision, peak, efficiency, optimizer_rate, intra_link, inter_link, gpu_tflops is not None,
            device == "cpu")
        sources += measured
    sources += [("peak", f"{peak / TFLOPS:g} TFLOP/s {precision} per GPU at {efficiency:g} efficiency: {peak_source}"
                 if not probe else f"{peak / TFLOPS:.3g} TFLOP/s measured matmul at {efficiency:g} efficiency"),
                ("intra-node", f"{intra_link.bandwidth / GB:.3g} GB/s per GPU, {intra_link.latency * 1e6:.0f} us: "
                               f"{intra_link.source}"),
                ("inter-node", f"{inter_link.bandwidth / GB:.3g} GB/s per node, {inter_link.latency * 1e6:.0f} us: "
                               f"{inter_link.source}")]
    host_rate = EFFICIENCY.host_adam * HOST_CORES_PER_GPU
    if device == "cpu":  # the host is the device: one core steps the optimizer either way
        host_rate = optimizer_rate = EFFICIENCY.host_adam if not probe or not probe.get("optimizer_rate") \
            else optimizer_rate
    op_overhead, memory_bandwidth = OP_OVERHEAD["cpu" if device == "cpu" else "gpu"], gpu.memory_bandwidth
    if probe:
        op_overhead, memory_bandwidth, measured = _probed_host(probe, op_overhead, memory_bandwidth)
        sources += measured
    sources.append(("per micro-step", f"{op_overhead * 1e6:.3g} us per op, {memory_bandwidth / GB:.3g} GB/s memory"
                    + ("" if probe and probe.get("op_rate") else f": {OP_OVERHEAD_SOURCE}")))
    overlap = EFFICIENCY.overlap_cpu if device == "cpu" else EFFICIENCY.overlap
    disk = nvme_disk()
    sources.append(("nvme", f"{disk.read / GB:.3g} GB/s read, {disk.write / GB:.3g} GB/s write per node: "
                            f"{disk.source}"))
    return Hardware(device or gpu.name, peak, efficiency, optimizer_rate, intra_link, inter_link, pcie, host_rate,
                    overlap, tuple(sources), disk, op_overhead, memory_bandwidth)


OP_OVERHEAD_SOURCE = "hybrid.plan.hardware.OP_OVERHEAD and the GPU's memory bandwidth (run hybrid probe)"


def _probed_host(probe: dict, op_overhead: float, memory_bandwidth: float):
    """The per-micro-step figures ``hybrid probe`` measured (``op_rate``: eager ops per second;
    ``memory_bandwidth``), over the table's; a probe file written before they were measured has neither."""
    measured = []
    if probe.get("op_rate"):
        op_overhead = 1.0 / float(probe["op_rate"])
        measured.append(("ops", f"{op_overhead * 1e6:.3g} us per eager op measured"))
    if probe.get("memory_bandwidth"):
        memory_bandwidth = float(probe["memory_bandwidth"])
        measured.append(("memory", f"{memory_bandwidth / GB:.3g} GB/s measured"))
    return op_overhead, memory_bandwidth, measured


def _probed(probe: dict, precision: str, peak, efficiency, optimizer_rate, intra, inter, peak_declared: bool,
            cpu: bool = False):
    """The figures ``hybrid probe`` measured, over the declared or table ones (see ``build_hardware``)."""
    from hybrid.plan.cost import Link

    measured = []
    matmul = (probe.get("matmul_flops") or {}).get(precision)
    if matmul and not peak_declared:
        peak, efficiency = float(matmul), EFFICIENCY.compute_measured_cpu if cpu else EFFICIENCY.compute_measured
    if probe.get("optimizer_rate"):
        optimizer_rate = float(probe["optimizer_rate"])
        measured.append(("optimizer", f"{optimizer_rate / 1e6:.3g}M parameters/s measured"))
    for key, link, scale in (("intra", intra, 1), ("inter", inter, None)):
        fit = probe.get(key)
        if not fit or not fit.get("bandwidth"):
            continue
        groups = scale or int(fit.get("concurrent_groups", 1))  # the node's rings ran together
        how = "in training's rhythm, after compute" if fit.get("loaded") else "back to back"
        new = Link(float(fit["bandwidth"]) * groups, float(fit.get("latency", link.latency)),
                   f"measured by hybrid probe ({fit.get('group_size', '?')} ranks per group, {how})")
        if key == "intra":
            intra = new
        else:
            inter = new
    return peak, efficiency, optimizer_rate, intra, inter, measured
