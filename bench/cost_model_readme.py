"""The "At scale" tables (docs/at-scale.md), generated from the cost model (`bench/cost_model.py
--write-readme` rewrites them between their markers in every page of `FILES`;
`tests/test_cost_model.py` checks). The README's headline table quotes one of its figures
(`scale_cells`, through `bench/readme_tables.py`)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from cost_model_scale import (
    Engine,
    LayoutError,
    Links,
    Options,
    Trainer,
    concurrency,
    figures,
    predict,
)

ROOT = Path(__file__).resolve().parents[1]
# the pages that hold <!-- cost_model:NAME --> blocks; each block is rendered where it is
FILES = (ROOT / "docs" / "at-scale.md",)
H100, H200 = Links(gpu="h100"), Links(gpu="h200")
# name -> (model, trainer, engine): disaggregated nodes of 8 GPUs, 8 x 400 Gb/s NICs each
TOPOLOGIES = {
    "30B: 16 -> 16": ("Qwen3-30B-A3B", Trainer(tp=2, ep=8, dp=8), Engine(tp=4, dp=4)),
    "235B: 32 -> 16": ("Qwen3-235B-A22B", Trainer(tp=4, pp=4, ep=8, dp=2),
                       Engine(tp=8, ep=8, dp=2)),
    "235B: 8 -> 8": ("Qwen3-235B-A22B", Trainer(tp=4, ep=8, dp=2), Engine(tp=8, ep=8)),
    "V3: 128 -> 64": ("DeepSeek-V3", Trainer(tp=2, pp=16, ep=8, dp=4),
                      Engine(tp=8, ep=32, dp=2)),
    "V3: 64 -> 32": ("DeepSeek-V3", Trainer(tp=2, pp=8, ep=8, dp=4), Engine(tp=8, ep=16, dp=2)),
    "K2: 256 -> 128": ("Kimi-K2", Trainer(tp=2, pp=16, ep=8, dp=8), Engine(tp=8, ep=32, dp=4)),
}
OPTIONS = {"full": Options(), "delta 3%": Options(mode="delta"),
           "shard-to-shard": Options(mode="shard"), "fp8 wire": Options(wire_bytes=1)}
# concurrent sources: also each engine GPU's own slices in fp8 (Perplexity's Kimi-K2 case);
# and DeepSeek-V3 with expert-TP = TP (Megatron's default): half as many owners, each with an
# expert-TP peer that runs its experts' gathers and sends dense tensors
CONCURRENT = {**OPTIONS, "shard-to-shard fp8": Options(mode="shard", wire_bytes=1)}
CONCURRENT_TOPOLOGIES = {**TOPOLOGIES, "V3: 128 -> 64, ETP2": (
    "DeepSeek-V3", Trainer(tp=2, pp=16, ep=4, etp=2, dp=4), Engine(tp=8, ep=32, dp=2))}
# published figures: (who, what, seconds, hardware as stated, topology, links)
PEERS = [
    ("NeMo-RL (seed)", "Qwen3-30B-A3B, BF16", "1.5", "DGX H100", "30B: 16 -> 16", H100),
    ("NeMo-RL reshard", "Qwen3-30B-A3B", "0.74-1.53", "H100", "30B: 16 -> 16", H100),
    ("NeMo-RL (seed)", "Qwen3-235B-A22B, BF16", "5", "DGX H100", "235B: 32 -> 16", H100),
    ("vLLM `sharded_rdt`", "Qwen3-235B-A22B", "3.3", "8 -> 8 H100", "235B: 8 -> 8", H100),
    ("NeMo-RL (seed)", "DeepSeek-V3, BF16", "14", "DGX H100", "V3: 128 -> 64", H100),
    ("prime-rl", "GLM-5.2 (modelled with DeepSeek-V3's shapes)", "2.84", "64 -> 32 H200",
     "V3: 64 -> 32", H200),
    ("Perplexity", "Kimi-K2, BF16 -> FP8", "1.3", "256 -> 128 GPUs (modelled as H100)",
     "K2: 256 -> 128", H100),
    ("checkpoint-engine", "Kimi-K2, FP8", "16-20", "not in the issue (modelled as H100)",
     "K2: 256 -> 128", H100),
]


def _layout(t: Trainer, e: Engine) -> str:
    etp = f" ETP{t.etp}" if t.etp > 1 else ""
    return (f"trainer TP{t.tp} PP{t.pp} EP{t.ep}{etp} DP{t.dp}; engines TP{e.tp} EP{e.ep} x "
            f"{e.dp}")


def _cells(model: str, t: Trainer, e: Engine, links: Links, options: dict[str, Options],
           **flags: bool) -> list[str]:
    try:
        return [_range(predict(model, t, e, links, replace(o, **flags)))
                for o in options.values()]
    except LayoutError as err:  # e.g. bf16 weights that do not fit the engine's GPUs
        return [f"does not fit: {err}"] + ["-"] * (len(options) - 1)


def scale_cells(topology: str, links: Links, interleave: bool = False) -> dict[str, str]:
    """One `TOPOLOGIES` case on `links`: option -> "best / expected / worst (bound)" seconds
    (`interleave`: the buckets in turn by sender, `cost_model_core.interleave`)."""
    return dict(zip(OPTIONS, _cells(*TOPOLOGIES[topology], links, OPTIONS,
                                    interleave=interleave), strict=True))


def _range(p: dict) -> str:
    s = p["seconds"]
    return f"{s['best']:.2f} / {s['expected']:.2f} / {s['worst']:.2f} ({p['bound']})"


def _table(columns: list[str], cells, topologies: dict = TOPOLOGIES) -> str:
    """A row per case of `topologies` and GPU: its model, GPUs, layout, then `cells(model,
    trainer, engine, links)` under `columns`."""
    rows = [f"| {model} | {name} {links.gpu.upper()} | {_layout(t, e)} | "
            + " | ".join(cells(model, t, e, links)) + " |"
            for name, (model, t, e) in topologies.items() for links in (H100, H200)]
    return _markdown(["model", "GPUs (trainer -> engines)", "layout", *columns], rows)


def _markdown(head: list[str], rows: list[str]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *rows])


def scale_table(interleave: bool = False) -> str:
    return _table(list(OPTIONS), lambda *case: _cells(*case, OPTIONS, interleave=interleave))


def concurrent_table() -> str:
    """Concurrent sources (`cost_model_scale.concurrent_timeline`), then how many sources and
    their imbalance: the busiest source's bytes over the mean, and the busiest engine GPU's."""
    def cells(model: str, t: Trainer, e: Engine, links: Links) -> list[str]:
        out = _cells(model, t, e, links, CONCURRENT, concurrent=True)
        if out[-1] == "-":  # does not fit
            return [*out, "-"]
        c = concurrency(model, t, e)
        i = c["imbalance"]
        return [*out, f"{c['sources']} ({i['source_bytes']:.2f} / {i['engine_worker_bytes']:.2f})"]
    return _table([*CONCURRENT, "sources (imbalance: source / engine GPU)"], cells,
                  CONCURRENT_TOPOLOGIES)


def peers_table() -> str:
    rows = []
    for who, what, secs, hw, topo, links in PEERS:
        cells = scale_cells(topo, links).values()
        rows.append(f"| {who} | {what} | {secs} | {hw} | {topo} {links.gpu.upper()} | "
                    + " | ".join(cells) + " |")
    return _markdown(["peer", "model", "their s", "their hardware", "modelled as", *OPTIONS],
                     rows)


def constants_table() -> str:
    rows = [f"| `{f.name}` | {f.best:.4g} / {f.expected:.4g} / {f.worst:.4g} {f.unit} | "
            f"{'measured' if f.measured else 'assumed'} | {f.source} | {f.stamp} | {f.note} |"
            for f in figures().values()]
    return _markdown(["constant", "best / expected / worst", "kind", "source", "stamp", "what"],
                     rows)


TABLES = {"scale": scale_table, "scale_interleaved": lambda: scale_table(interleave=True),
          "scale_concurrent": concurrent_table, "peers": peers_table,
          "constants": constants_table}


BLOCK = re.compile(r"(<!-- cost_model:(\w+) -->\n)(?:(?!<!--).)*(<!-- /cost_model -->)", re.S)


def render(text: str) -> str:
    """`text` (one page of `FILES`) with each cost-model table it holds replaced by the model's
    output."""
    return BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(3), text)


def write() -> None:
    """Rewrite the tables in every page of `FILES`; each table must be in one of them."""
    pages = {path: path.read_text() for path in FILES}
    found = {m.group(2) for text in pages.values() for m in BLOCK.finditer(text)}
    if missing := set(TABLES) - found:
        raise SystemExit(f"no <!-- cost_model:NAME --> block for {missing} in "
                         f"{', '.join(str(p.relative_to(ROOT)) for p in FILES)}")
    for path, text in pages.items():
        path.write_text(render(text))
