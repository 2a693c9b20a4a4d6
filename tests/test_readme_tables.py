"""The README's benchmark tables are the ones generated from the committed raw results."""

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
    readme = (ROOT / "README.md").read_text()
    assert tables.render(readme) == readme, (
        "README.md's benchmark tables differ from bench/results/: run "
        "`python bench/readme_tables.py --write`")
    for name in tables.TABLES:  # every benchmark's table is there, with rows
        block = readme.split(f"<!-- table:{name} -->\n", 1)[1].split("<!-- /table -->", 1)[0]
        assert block.startswith("| results file |") and len(block.splitlines()) >= 3, name
