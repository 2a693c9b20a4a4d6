"""Every code block of README.md and docs/ runs in a test, taken from the Markdown.

Each block carries a marker on the line before its fence naming it (`<!-- run: NAME -->`, or
`<!-- newcomer: NAME -->` for the quick starts), and `RUNNERS` says which test runs it; that
file must take the block by its marker (`tests.docs_blocks.block`). The make commands are CI's
(`.ci/run` runs each). The core block (docs/architecture.md) runs here: two trainer ranks and
one receiver over gloo, its names given by a prelude, the receiver's tensors checked after.
"""

from __future__ import annotations

from recipes.rank_runner import run_ranks
from tests.docs_blocks import ROOT, block, blocks

RUNNERS = {  # marker -> the file that runs its block
    "run: ci": ".ci/run",
    "newcomer: fsdp2": "tests/serve/test_newcomer.py",
    "newcomer: megatron": "tests/serve/test_newcomer.py",
    "run: serve-command": "tests/test_packaging.py",
    "run: core": "tests/test_docs.py",
    "run: llm-host": "tests/dtensor_vllm/test_docs_llm_host.py",
    "run: ray-recipes": "tests/ray/test_ray_recipes.py",
}
CORE_PRELUDE = '''
import torch
from common.source import DictWeightSource
addr, port, r, step = "127.0.0.1", {port}, {rank}, 1
T, I = 2, 1  # two training ranks, one inference rank
tensors = {{"layer.weight": torch.arange(12.0).reshape(3, 4), "layer.bias": torch.ones(5)}}
source = DictWeightSource(tensors)  # every trainer holds them; rank 0 sends


class Model:  # the receiver's stand-in for an engine's load_weights
    got = {{}}

    def load_weights(self, items):
        self.got.update((name, t.clone()) for name, t in items)


model = Model()
'''
CORE_EPILOGUE = '''
result = {name: torch.equal(t, tensors[name]) for name, t in model.got.items()} if r >= T else {}
group.destroy()
'''


def test_every_code_block_is_run_by_a_test() -> None:
    found = blocks()
    unmarked = [f"{b.path.relative_to(ROOT)}:{b.line} (```{b.lang})" for b in found
                if b.marker not in RUNNERS]
    assert not unmarked, (f"code blocks no test runs: {unmarked}; mark each "
                          f"<!-- run: NAME --> and run it in a test (RUNNERS)")
    for marker, runner in RUNNERS.items():
        assert sum(b.marker == marker for b in found) == 1, f"one block marked {marker!r}"
        if marker != "run: ci":
            assert f'"{marker}"' in (ROOT / runner).read_text(), \
                f"{runner} does not take the block marked {marker!r}"


def test_ci_runs_the_readme_make_commands() -> None:
    ci = (ROOT / ".ci/run").read_text().splitlines()
    for line in block("run: ci").splitlines():
        command = line.split("#")[0].strip()
        assert command in ci, f".ci/run does not run the README's {command!r}"


def _core_rank(rank: int, world: int, port: int, code: str) -> dict[str, bool]:
    namespace: dict = {}
    exec(compile(CORE_PRELUDE.format(port=port, rank=rank) + code + CORE_EPILOGUE,
                 "the core block", "exec"), namespace)
    return namespace["result"]


def test_the_core_block_refits_a_receiver() -> None:
    out = run_ranks(_core_rank, 3, block("run: core"), timeout=120)
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert out[2][1] == {"layer.weight": True, "layer.bias": True}, out[2]
