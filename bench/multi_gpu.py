"""Every multi-GPU refit measurement in one command, into one JSON (a multi-GPU lend is short).

    python3 bench/multi_gpu.py --out bench/results/multi_gpu_<kind>.json

Runs, one after another, each in its own processes (one rank per GPU, NCCL):
  1. `broadcast_bench.py`: the fixed synthetic MoE / dense lists (naive, coalesced 1/2/3
     buffers, one raw broadcast as the ceiling, pack throughput);
  2. `broadcast_bench.py --models --forward`: lists shaped like Qwen3-30B-A3B and Qwen3-8B, full
     group (half the GPUs train, each sending its contiguous share, like pipeline stages), and,
     with 2+ training ranks, the same with every share forwarded to rank 0 first;
     each share its own stream sent at once (concurrent sources, the default), and the same
     as one ordered stream (`REFIT_CONCURRENT_SOURCES=0`): `moe_concurrent_over_one_stream`;
  3. the same with `--trainers 1` (the minimal group: rank 0 sends everything), 3+ GPUs only;
  4. with megatron-core importable, 3+ GPUs: `mcore_refit_bench.py`, Megatron TP2 (dense) and
     EP2 (MoE) training ranks gathering while the other GPUs receive;
  5. the NCCL tests: a 100-refit soak with training-group gathers interleaved with the refit
     broadcasts, and a receiver killed mid-refit (`tests/test_multi_rank_soak.py`).
The headline keys are the Qwen3-30B-A3B-shaped run's. The sender's native checks need a C++
compiler and ninja on PATH (each report's `hardware.native_checks` says whether they ran): on
the H200 machines carry the ninja and megatron-core wheels (`.whl/`) and `pip install` them
first. `--quick` checks the runner on CPU (gloo, small lists, no NCCL tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from broadcast_bench import NO_MULTICAST
from provenance import save

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEADLINE = ("moe_double_buffer_fraction_of_ceiling", "moe_coalesced_speedup_vs_naive",
            "moe_double_buffer_time_over_raw", "dense_double_buffer_fraction_of_ceiling",
            "moe_forwarded_time_over_owner_fed", "moe_concurrent_over_one_stream")
ONE_STREAM = {"REFIT_CONCURRENT_SOURCES": "0"}


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **NO_MULTICAST, "PYTHONPATH": path, **(extra or {})}


def bench(name: str, extra: list[str], args: argparse.Namespace,
          script: str = "broadcast_bench.py",
          variables: dict[str, str] | None = None) -> dict[str, Any]:
    """One benchmark run (`variables`: environment variables of its own); its report, or
    what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, os.path.join(HERE, script), "--out", out, *extra]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env(variables), capture_output=True, text=True,
                              timeout=args.step_timeout)
        print(f"[{name}] rc {done.returncode} in {time.perf_counter() - t0:.0f}s: "
              f"{' '.join(cmd[1:])}", flush=True)
        if done.returncode != 0:
            return {"error": f"rc {done.returncode}", "tail": done.stdout[-2000:]
                    + done.stderr[-4000:]}
        print("\n".join(done.stdout.splitlines()[:-1]), flush=True)  # a table, if any
        with open(out) as f:
            return json.load(f)


def nccl_tests(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "tests/test_multi_rank_soak.py", "-k", "nccl"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=args.step_timeout)
    lines = done.stdout.strip().splitlines()
    print(f"[nccl tests] rc {done.returncode} in {time.perf_counter() - t0:.0f}s: "
          f"{lines[-1] if lines else done.stderr[-500:]}", flush=True)
    return {"rc": done.returncode, "summary": lines[-1] if lines else "",
            "tail": "\n".join(lines[-40:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the combined JSON goes")
    ap.add_argument("--quick", action="store_true", help="check the runner on CPU (gloo)")
    ap.add_argument("--step-timeout", type=float, default=1800, help="seconds per step")
    args = ap.parse_args()
    gpus = 0 if args.quick else torch.cuda.device_count()
    if not args.quick and gpus < 2:
        raise SystemExit(f"needs 2+ GPUs of one host ({gpus} visible); --quick checks on CPU")
    t0 = time.perf_counter()
    runs = {"synthetic": bench("synthetic", [], args),
            "models_full_group": bench("models, full group", ["--models", "--forward"], args),
            "models_one_stream": bench("models, one ordered stream", ["--models"], args,
                                       variables=ONE_STREAM)}
    if args.quick or gpus >= 3:
        runs["models_minimal_group"] = bench("models, minimal group",
                                             ["--models", "--trainers", "1"], args)
        if importlib.util.find_spec("megatron") is not None:  # the megatron-core wheel
            for label, layout in (("megatron_tp2", ["--tp", "2"]),
                                  ("megatron_moe_ep2", ["--moe", "--ep", "2", "--tp", "1"])):
                runs[label] = bench(label, [*layout, "--receivers", str(max(1, gpus - 2))],
                                    args, "mcore_refit_bench.py")
    report: dict[str, Any] = {"gpus": gpus, "runs": runs}
    headline = runs["models_full_group"]
    report.update({k: headline.get(k) for k in HEADLINE})
    report["moe_like"] = headline.get("shapes", {}).get("moe", {}).get("like")
    key, one = "moe_double_buffer_time_over_raw", runs["models_one_stream"]
    if headline.get(key) and one.get(key):  # each over the raw broadcast of its own run
        report["moe_concurrent_over_one_stream"] = round(headline[key] / one[key], 3)
    if not args.quick:
        report["nccl_tests"] = nccl_tests(args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save(report, args.out)
    print(json.dumps({k: report[k] for k in (*HEADLINE, "moe_like", "wall_s")}))
    failed = [k for k, v in runs.items() if "error" in v]
    if failed or report.get("nccl_tests", {}).get("rc", 0) not in (0, 5):
        raise SystemExit(f"failed: {failed or 'nccl tests'} (details in {args.out})")


if __name__ == "__main__":
    main()
