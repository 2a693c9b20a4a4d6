"""How long will a refit take: a cost model calibrated on the measured stages in bench/results/.

    python bench/cost_model.py --model DeepSeek-V3 --trainer tp=2,pp=16,ep=8,dp=4 \\
        --engine tp=8,ep=32,dp=2 [--gpu h100] [--mode full|delta|shard] [--fp8] [--concurrent]
    python bench/cost_model.py --check           # held-out runs: predicted vs measured
    python bench/cost_model.py --write-readme    # the "At scale" tables, docs/at-scale.md

The arithmetic is in `cost_model_core.py` (buckets, the critical path with N buffers), the
constants in `cost_model_inputs.py` (measured ones read from bench/results/ at run time, each
with its file and stamp; links; assumed ranges), the check in `cost_model_check.py` (frames
by graph replay: `cost_model_graph.py`), the at-scale model in `cost_model_scale.py` (one
ordered stream, or with `--concurrent` every source rank's buckets a stream of its own, all at
once), the docs tables in `cost_model_readme.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model_check import CALIBRATION, NOT_HELD_OUT, cases, machine, sweep_cases  # noqa: E402
from cost_model_graph import GRAPH_NOT_HELD_OUT, graph_sweep_cases  # noqa: E402
from cost_model_readme import write  # noqa: E402
from cost_model_scale import Engine, LayoutError, Links, Options, Trainer, figures, predict  # noqa: E402

CHECK_OUT = Path(__file__).resolve().parent / "results" / "cost_model_check.json"


def parse_layout(kind: type, text: str):
    """"tp=8,ep=16,dp=2" -> kind(tp=8, ep=16, dp=2); unknown keys and non-integers refused."""
    known = {f.name for f in fields(kind)}
    values = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in known or not value.strip().lstrip("-").isdigit():
            raise LayoutError(f"{kind.__name__.lower()} {part!r}: expected KEY=INT with KEY "
                              f"one of {', '.join(sorted(known))}")
        values[key.strip()] = int(value)
    return kind(**values)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="Qwen3-30B-A3B, Qwen3-8B, Qwen3-235B-A22B, DeepSeek-V3, "
                                    "Kimi-K2")
    ap.add_argument("--trainer", default="", help="tp=,pp=,ep=,etp=,dp=,gpus_per_node=")
    ap.add_argument("--engine", default="", help="tp=,ep=,dp= (replicas),gpus_per_node=")
    ap.add_argument("--gpu", default="h100", choices=["h100", "h200"])
    ap.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_GBps)
    ap.add_argument("--nics", type=int, default=Links.nics_per_node, help="NICs per node")
    ap.add_argument("--nic-gbit", type=float, default=Links.nic_Gbps)
    ap.add_argument("--mode", default="full", help="full | delta | shard")
    ap.add_argument("--density", type=float, default=0.03, help="delta: words changed")
    ap.add_argument("--fp8", action="store_true", help="1 byte per element on the wire")
    ap.add_argument("--buffers", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--interleave", action="store_true",
                    help="buckets in turn by sender (a plan built so), not in plan order")
    ap.add_argument("--concurrent", action="store_true",
                    help="concurrent sources: each source rank's buckets its own stream, on "
                         "its own communicator, all at once")
    ap.add_argument("--check", action="store_true", help="predict the held-out runs")
    ap.add_argument("--write-readme", action="store_true",
                    help="rewrite the At scale tables in docs/at-scale.md")
    return ap.parse_args(argv)


def check() -> dict:
    """The --check summary (the CLI prints it as its last line): eager frames, then frames by
    graph replay."""
    rows = cases() + sweep_cases() + graph_sweep_cases()
    kept = [abs(r["error"]) for r in rows if "exception" not in r]
    return {"cases": len(rows), "max_abs_error": round(max(kept), 3),
            "within_25pct": sum(e <= 0.25 for e in kept),
            "exceptions": [{k: r[k] for k in ("run", "list", "method", "error", "exception")}
                           for r in rows if "exception" in r],
            "not_held_out": {**NOT_HELD_OUT, **{f"{k} (graph replay)": v
                                                for k, v in GRAPH_NOT_HELD_OUT.items()}},
            "calibration": {c: machine(c).__dict__ for c in CALIBRATION}, "rows": rows}


def answer(a: argparse.Namespace) -> dict:
    """The user's case: the range, the bounding stage, each stage's total, the constants."""
    if not a.model:
        raise LayoutError("--model is required (or --check / --write-readme)")
    links = Links(a.nvlink_gbps, a.nics, a.nic_gbit, a.gpu)
    opts = Options(a.mode, a.density, 1 if a.fp8 else 2, a.buffers, a.bucket_mib << 20,
                   a.interleave, a.concurrent)
    out = predict(a.model, parse_layout(Trainer, a.trainer), parse_layout(Engine, a.engine),
                  links, opts)
    out["constants"] = {f.name: f"{f.expected:.4g} {f.unit} ({f.source}, {f.stamp})"
                        for f in figures().values()}
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    try:
        if a.check:
            result = check()
            CHECK_OUT.write_text(json.dumps(result, indent=1) + "\n")
            for r in result["rows"]:
                print(f"{r['run']:32s} {r['list']:6s} {r['method']:15s} measured "
                      f"{r['measured_s'] * 1e3:9.2f} ms predicted {r['predicted_s'] * 1e3:9.2f}"
                      f" ms error {r['error']:+.1%}")
            print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
        elif a.write_readme:
            write()
        else:
            print(json.dumps(answer(a), indent=1))
    except LayoutError as e:
        print(f"cost_model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
