"""The GPU catalog (memory, bandwidth, dense FLOP/s per dtype, interconnect) and detection of the local GPU.

Figures are datasheet dense (no sparsity) numbers; `measured_*` fields hold what we measured ourselves on
that GPU (bench/), which the speed models prefer when present. advise and profile share this catalog, so a
prediction and a measurement speak the same units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusteropt_cli.errors import BadInputError

MiB = 1024**2
GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class GPUSpec:
    name: str
    label: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    tflops: dict[str, float]  # dense TFLOP/s by dtype: fp32, tf32, bf16, fp16, fp8, int8
    compute_capability: tuple[int, int] | None  # None for non-NVIDIA
    intra_node_bandwidth: float  # bytes/s per GPU, one direction (NVLink or PCIe)
    inter_node_bandwidth: float  # bytes/s per GPU (typical InfiniBand/RoCE NIC)
    interconnect: str
    vendor: str = "nvidia"
    measured: dict[str, float] = field(default_factory=dict)  # e.g. bf16_tflops, copy_bandwidth

    @property
    def supports_fp8(self) -> bool:
        if self.vendor == "amd":
            return "fp8" in self.tflops
        return self.compute_capability is not None and self.compute_capability >= (8, 9)

    @property
    def supports_bf16(self) -> bool:
        if self.vendor == "amd":
            return True
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype (fp8 falls back to bf16 where unsupported)."""
        key = {"bf16": "bf16", "fp16": "fp16", "fp32": "tf32", "fp8": "fp8", "int8": "int8", "int4": "bf16"}.get(
            dtype, "bf16"
        )
        if key not in self.tflops:
            key = "bf16"
        return self.tflops[key] * TB


def _nv(name, label, mem_mib, bw_tbs, tflops, cc, nvlink_gbs, net_gbs, interconnect, measured=None) -> GPUSpec:
    return GPUSpec(name, label, int(mem_mib * MiB), bw_tbs * TB, tflops, cc, nvlink_gbs * GB, net_gbs * GB,
                   interconnect, measured=measured or {})


CATALOG: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        _nv("a100-40g", "NVIDIA A100-SXM4-40GB", 40960, 1.555,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "int8": 624}, (8, 0), 300, 25, "NVLink 3"),
        _nv("a100-80g", "NVIDIA A100-SXM4-80GB", 81920, 2.039,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "int8": 624}, (8, 0), 300, 25, "NVLink 3"),
        _nv("h100-sxm", "NVIDIA H100 80GB HBM3", 81559, 3.35,
            {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}, (9, 0),
            450, 50, "NVLink 4"),
        _nv("h100-pcie", "NVIDIA H100 PCIe", 81559, 2.0,
            {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513}, (9, 0), 64, 50,
            "PCIe 5"),
        _nv("h200", "NVIDIA H200", 143771, 4.8,
            {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}, (9, 0),
            450, 50, "NVLink 4",
            # measured on an H200 (docs/benchmarks.md#h200-baselines): 8192^3 matmuls, device-to-device copy
            measured={"bf16_tflops": 774.0, "fp8_tflops": 1421.0, "copy_bandwidth": 4.26e12}),
        _nv("h20", "NVIDIA H20", 97871, 4.0,
            {"fp32": 44, "tf32": 74, "bf16": 148, "fp16": 148, "fp8": 296, "int8": 296}, (9, 0), 450, 50,
            "NVLink 4"),
        _nv("h800", "NVIDIA H800", 81559, 3.35,
            {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}, (9, 0),
            200, 50, "NVLink 4 (400 GB/s)"),
        _nv("b200", "NVIDIA B200", 183359, 8.0,
            {"fp32": 80, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500, "int8": 4500, "fp4": 9000},
            (10, 0), 900, 50, "NVLink 5"),
        _nv("l40s", "NVIDIA L40S", 46068, 0.864,
            {"fp32": 91.6, "tf32": 183, "bf16": 362, "fp16": 362, "fp8": 733, "int8": 733}, (8, 9), 32, 25,
            "PCIe 4"),
        _nv("rtx4090", "NVIDIA GeForce RTX 4090", 24564, 1.008,
            {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6}, (8, 9), 32,
            12.5, "PCIe 4"),
        GPUSpec("mi300x", "AMD Instinct MI300X", 196592 * MiB, 5.3 * TB,
                {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "int8": 2614.9},
                None, 448 * GB, 50 * GB, "Infinity Fabric", vendor="amd"),
    ]
}

_ALIASES = {"h100": "h100-sxm", "a100": "a100-80g", "4090": "rtx4090", "h200-sxm": "h200"}


def get_gpu(name: str) -> GPUSpec:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG:
        raise BadInputError(f"Unknown GPU '{name}' for --gpu.", hint=f"Choose one of: {', '.join(CATALOG)}")
    return CATALOG[key]


def match_catalog(device_name: str, memory_bytes: int | None = None) -> GPUSpec | None:
    """Map a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') to a catalog entry."""
    n = device_name.lower()
    rules = [
        ("h200", "h200"), ("h800", "h800"), ("h20", "h20"), ("b200", "b200"), ("l40s", "l40s"),
        ("4090", "rtx4090"), ("mi300x", "mi300x"),
    ]
    for needle, key in rules:
        if needle in n:
            return CATALOG[key]
    if "h100" in n:
        return CATALOG["h100-pcie" if "pcie" in n else "h100-sxm"]
    if "a100" in n:
        big = memory_bytes is None or memory_bytes > 60 * 1024**3 or "80" in n
        return CATALOG["a100-80g" if big else "a100-40g"]
    return None


@dataclass
class DetectedGPU:
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    supports_bf16: bool
    supports_fp8: bool
    catalog: str | None


def detect_gpus() -> list[DetectedGPU]:
    """The CUDA GPUs torch sees (imports torch; call only when needed)."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cc = (props.major, props.minor)
        spec = match_catalog(props.name, props.total_memory)
        gpus.append(DetectedGPU(i, props.name, int(props.total_memory), cc, cc >= (8, 0), cc >= (8, 9),
                                spec.name if spec else None))
    return gpus


def detect_gpu_spec() -> GPUSpec | None:
    """The catalog entry of GPU 0, when there is one and it is known."""
    gpus = detect_gpus()
    if not gpus or gpus[0].catalog is None:
        return None
    return CATALOG[gpus[0].catalog]
