"""The cost model's constants: measured ones read from `bench/results/` at run time (each names
its file and that file's stamp: the commit it was measured at, or "unstamped" for files
written before `bench/provenance.py`), link speeds with their published source, and the
assumed ranges (best / expected / worst) for what no run here has measured at scale; and
what a case is given: the layouts, links and options."""

from __future__ import annotations

import json
import statistics
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


# A case: the trainer's and the engines' layouts, the links, the refit's options.
@dataclass(frozen=True)
class Trainer:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Engine:
    tp: int = 1
    ep: int = 1
    dp: int = 1  # engine replicas
    gpus_per_node: int = 8

    @property
    def gpus_each(self) -> int:
        return max(self.tp, self.ep)


@dataclass(frozen=True)
class Links:
    nvlink_GBps: float = NVLINK_H100.expected
    nics_per_node: int = NICS_DGX
    nic_Gbps: float = NIC_NDR.expected
    gpu: str = "h100"


@dataclass(frozen=True)
class Options:
    mode: str = "full"  # full | delta | shard
    density: float = 0.03  # delta: the fraction of 2-byte words changed
    wire_bytes: int = 2  # per element on the wire: 2 (bf16) or 1 (fp8)
    buffers: int = 2
    bucket_bytes: int = 256 << 20
    interleave: bool = False  # buckets in turn by sender, not in plan order (`interleave`)
    concurrent: bool = False  # each source its own stream (`concurrent_timeline`)


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
        assumed("source_rail", (1.0, 1.0, 1.0), "x its GPU's share of the node's NICs",
                "concurrent sources: a source's stream leaves by its own GPU's NIC(s) (NCCL "
                "with one GPU of a node in the communicator); other GPUs' NICs relay none"),
        assumed("concurrent_shard_rails", (1.0, 1.0, 0.5), "of the node's rails",
                "concurrent sources, shard-to-shard: the need-set frames of the streams into "
                "an engine node keep all its NICs busy (each worker takes its own on its "
                "GPU's rail); worst: half, the frames in flight bunched on some workers"),
    )}


FP8_RUN = "fp8_h100_run14b"  # the quantize kernel of 4851373; the slowest of its lend's three runs
# The host's pace between lends: 2.2x per tensor between the calibration lend and another
# lend's sweep (issue 37: one H200, same code). Best and expected are the lends measured here.
LEND_SPREAD = 2.2


def host_range(values: list[float]) -> tuple[float, float, float]:
    mean = statistics.mean(values)
    return min(values), mean, mean * LEND_SPREAD


def quantize_figure() -> Figure:
    """The FP8 quantize's cost on the sender: an FP8 refit's time less the bf16 refit's of the
    same list (its pack), in copies of the list's bf16 bytes; none below zero."""
    runs = [v for v in load(FP8_RUN).values() if isinstance(v, dict) and "fp8_refit_s" in v]
    extra = [max(0.0, (r["fp8_refit_s"] - r["bf16_refit_s"]) / r["copy_s"]) for r in runs]
    return measured("quantize_over_copy", FP8_RUN, (min(extra), max(extra),
                                                    max(extra) * LEND_SPREAD), "x one copy",
                    "an FP8 refit less the bf16 refit of the same list, one GPU "
                    f"(best / expected: the two lists; worst: {LEND_SPREAD}x)")


CUDA_ENGINE_RUN = "cuda_engine_h100_run3"  # the newest `bench/cuda_engine_bench.py` run


def cuda_engine_figures() -> tuple[Figure, Figure]:
    """A CUDA vLLM engine's apply (learned map) and pause, measured on one GPU: the apply over
    one device copy in that run, times the scatter kernel's rate over a copy's (the H200's)."""
    ce = load(CUDA_ENGINE_RUN)
    scatter_over_copy = load("receiver_scatter_h200")["scatter"]["scatter_over_one_copy"]
    over = {n: ce[n]["apply_over_copy"] * scatter_over_copy for n in ("dense", "moe")}
    pause = max(max(ce[n]["pause_resume_s"].values()) for n in ("dense", "moe"))
    return (measured("apply_over_scatter", CUDA_ENGINE_RUN,
                     (over["dense"], over["moe"], over["moe"]), "x the scatter kernel",
                     "a CUDA vLLM engine's learned-map apply (copies, vLLM's layer and post-load "
                     "processing), vLLM 0.26: best the Qwen3-8B-shaped layers, expected and "
                     "worst the 20,000-tensor MoE"),
            measured("pause_s", CUDA_ENGINE_RUN, (pause, pause, 0.3), "s",
                     "an idle CUDA engine's pause + resume (keep and abort, the slower); "
                     "worst 0.3 s assumed: a pause that waits for an engine step in flight"))
