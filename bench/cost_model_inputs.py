"""The cost model's constants: measured ones read from `bench/results/` at run time (each names
its file and that file's stamp: the commit it was measured at, or "unstamped" for files
written before `bench/provenance.py`), link speeds with their published source, and the
assumed ranges (best / expected / worst) for what no run here has measured at scale."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Figure:
    """One constant: (best, expected, worst) in `unit`, where it comes from and how."""

    name: str
    best: float
    expected: float
    worst: float
    unit: str
    source: str  # a results file, a datasheet, or "assumed"
    stamp: str  # the results file's commit, "unstamped", or "-"
    note: str

    @property
    def measured(self) -> bool:
        return self.source.endswith(".json")

    def pick(self, case: str) -> float:
        return {"best": self.best, "expected": self.expected, "worst": self.worst}[case]


@cache
def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def stamp(name: str) -> str:
    """The results file's commit and machine, or "unstamped (<its hardware field>)"."""
    report = load(name)
    if "provenance" in report:
        p = report["provenance"]
        return f"{p['commit'][:12]}, {p.get('gpu') or p['cpu_model']}"
    hw = report.get("hardware", {})
    where = hw.get("gpu_name") or hw.get("cpu_model") or report.get("gpu") or report.get(
        "scatter", {}).get("device") or f"{hw.get('cpu_cores', '?')}-core CPU"
    return f"unstamped ({where})"


def measured(name: str, file: str, values: tuple[float, float, float], unit: str,
             note: str) -> Figure:
    return Figure(name, *values, unit, f"{file}.json", stamp(file), note)


def same(v: float) -> tuple[float, float, float]:
    return v, v, v


def assumed(name: str, values: tuple[float, float, float], unit: str, note: str) -> Figure:
    return Figure(name, *values, unit, "assumed", "-", note)


def datasheet(name: str, value: float, unit: str, source: str) -> Figure:
    return Figure(name, value, value, value, unit, source, "-", "named link speed")


# Links and memories, per direction, with their sources.
NVLINK_H100 = datasheet("nvlink_GBps", 450.0, "GB/s per GPU per direction",
                        "NVIDIA DGX H100 datasheet: NVLink 4, 900 GB/s bidirectional per GPU")
NVLINK_H200 = datasheet("nvlink_GBps", 450.0, "GB/s per GPU per direction",
                        "NVIDIA H200 datasheet: NVLink 900 GB/s bidirectional per GPU")
NIC_NDR = datasheet("nic_Gbps", 400.0, "Gb/s per NIC",
                    "NVIDIA DGX H100 user guide: 8 x ConnectX-7 NDR 400 Gb/s compute NICs")
NICS_DGX = 8  # the same guide: one per GPU
PCIE_GEN5 = datasheet("pcie_GBps", 64.0, "GB/s per direction",
                      "PCI-SIG: PCIe 5.0 x16, 32 GT/s x 16 lanes")
HBM = {"h100": datasheet("hbm_TBps", 3.35, "TB/s", "NVIDIA H100 SXM datasheet: HBM3"),
       "h200": datasheet("hbm_TBps", 4.8, "TB/s", "NVIDIA H200 datasheet: HBM3e")}
MEMORY_GB = {"h100": 80, "h200": 141}  # the same datasheets


def assumed_at_scale() -> dict[str, Figure]:
    """What no run here measured: multi-node NCCL."""
    return {f.name: f for f in (
        assumed("ib_efficiency", (0.9, 0.8, 0.6), "of NIC line rate",
                "NCCL over NDR InfiniBand; no multi-node run here"),
        assumed("collective_latency_s", (10e-6, 30e-6, 100e-6), "s per collective",
                "NCCL launch + ring latency per frame"),
        assumed("device_rate_h100", (0.70, 0.70, 0.70), "x the H200's rate",
                "memory-bound kernels scale with HBM bandwidth, 3.35 / 4.8"),
        assumed("shard_concurrency", (1.0, 1.0, 0.125), "of the node's rails",
                "need-set frames posted ahead run on all rails; worst: one collective at a "
                "time over one GPU's rail"),
    )}
