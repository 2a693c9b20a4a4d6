"""The benchmark tables of the README and docs/ are the ones generated from the committed raw
results, each in exactly one of the pages `bench/readme_tables.py` renders (`FILES`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables",
                                                  ROOT / "bench" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_tables_are_generated_from_bench_results() -> None:
    tables = _readme_tables()
    pages = {path: path.read_text() for path in tables.FILES}
    for path, text in pages.items():
        assert tables.render(text) == text, (
            f"{path.relative_to(ROOT)}'s benchmark tables differ from bench/results/: run "
            "`python bench/readme_tables.py --write`")
    assert tables.placed(list(pages.values())) == dict.fromkeys(tables.TABLES, 1), (
        "each table's <!-- table:NAME --> block belongs in exactly one page of FILES")
    text = "\n".join(pages.values())
    for name in tables.TABLES:  # every benchmark's table is there, with rows
        block = text.split(f"<!-- table:{name} -->\n", 1)[1].split("<!-- /table -->", 1)[0]
        lines = block.splitlines()
        assert len(lines) >= 3 and lines[1].startswith("| --- |"), name
        assert name in ("headline", "cuda_engine") or lines[0].startswith("| results file |")
