"""An engine hosted in a real Ray actor (`RayEngine`), refit through the same interface as
the other hosts: it joins, takes a refit as version 1 and then generates exactly what a fresh
engine started on the new weights generates."""

from __future__ import annotations

import time

import pytest
import torch

from tests.dtensor.models import make_model
from tests.dtensor_vllm.helpers import (
    PROMPTS,
    KillingSource,
    engine_config,
    greedy,
    join_one_trainer,
    start_engine,
    wait_gone,
)
from tests.ray_start import init_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    init_ray(ray, address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def serving(ray_cluster, tmp_path_factory):
    """One AsyncLLM engine actor on random starting weights: (its engine, those weights, its
    config), for the in-flight test and then the kill test, which kills it (it runs last)."""
    from common.clients.ray_engine import RayEngine
    from common.engine.config import EngineConfig
    from tests.serve.conftest import MAX_MODEL_LEN, save_qwen3

    start = {n: t.clone() for n, t in make_model("qwen3", dtype=torch.bfloat16)
             .state_dict().items()}
    path = tmp_path_factory.mktemp("serving") / "v0"
    save_qwen3(start, path)
    config = EngineConfig(model=str(path), llm_kwargs={
        "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 4})
    engine = RayEngine.start(config, serving=True, name="served")
    try:
        yield engine, start, config
    finally:
        engine.close()


def test_an_engine_in_a_ray_actor_refits_like_a_fresh_engine(ray_cluster, tmp_path) -> None:
    from common.clients.ray_engine import RayEngine

    old = make_model("qwen3", dtype=torch.bfloat16)
    old.save_pretrained(tmp_path / "v0")
    new_state = {n: (t * 1.5 if t.dim() > 1 else t).contiguous()
                 for n, t in old.state_dict().items()}
    old.load_state_dict(new_state)
    old.save_pretrained(tmp_path / "v1")
    engine = RayEngine.start(engine_config(str(tmp_path / "v0")))
    try:
        before = greedy(engine)
        trainer = join_one_trainer([engine], new_state)
        stats = trainer.refit(1, mode="abort")
        assert sorted(stats.receivers) == [1] and engine.weight_version() == "1"
        got = greedy(engine)
        (out,) = engine.generate([PROMPTS[0]], 4)
        assert out.weight_versions == [("1", 0, 4)]
        trainer.group.destroy()
    finally:
        engine.close()
    with start_engine(str(tmp_path / "v1")) as fresh:
        assert got == greedy(fresh)
    assert got["tokens"] != before["tokens"]


def test_a_serving_engine_actor_keeps_a_request_in_flight_across_a_refit(ray_cluster, serving):
    """AsyncLLM in an async actor: a long request runs while the engine is paused (keep),
    refit and resumed; its tokens carry version 0, then 1. Then one cut short by a refit in
    mode abort is continued by the recipes' driver: versions 1, then 2, all its tokens."""
    engine, start, _ = serving
    new_state = {n: (t * 1.5 if t.dim() > 1 else t).contiguous() for n, t in start.items()}
    trainer = join_one_trainer([engine], new_state)
    tokens = 1024  # seconds of generation: each refit below meets the request in flight
    in_flight = engine.remote("generate", prompts=[[3, 1, 4, 1, 5]], max_tokens=tokens,
                              sampling={"ignore_eos": True})
    (warm,) = engine.generate([[2, 7]], 4)  # served concurrently with the long request
    assert warm.weight_versions == [("0", 0, 4)]
    trainer.refit(1, mode="keep")
    (out,) = ray_cluster.get(in_flight, timeout=120)
    (first, _, k), (second, k2, end) = out["weight_versions"]
    assert (first, second, k2, end) == ("0", "1", k, tokens) and 0 < k < tokens, out
    assert engine.weight_version() == "1"
    # Mode abort cuts a request short; the Ray recipes' driver continues it afterwards.
    from recipes.ray_loop import collect, generate_async

    batch = [[2, 7, 1, 8]]  # as long as the first: the refit meets it the same way
    pending = generate_async([engine], batch, tokens)
    engine.generate([[2, 7]], 4)  # returns while the long request is under way
    trainer.refit(2, mode="abort")
    (sample,) = collect(pending, batch, tokens, timeout_s=120)
    assert sample["versions"] == ["1", "2"], sample
    assert len(sample["tokens"]) == len(batch[0]) + tokens
    trainer.group.destroy()


def test_a_serving_engine_actor_killed_mid_refit_fails_the_trainer_and_leaves_nothing(
        ray_cluster, serving) -> None:
    """`ray.kill` of the engine actor mid-refit: the trainer raises within the timeout + a
    margin naming the engine, no process of the actor's tree survives, and a replacement
    engine joins a rebuilt group and takes the next refit."""
    from common.clients.ray_engine import RayEngine
    from common.errors import RefitError

    engine, state, config = serving
    pids = engine._call("pids")
    assert len(pids) >= 2  # the actor and vLLM's engine core at least
    held = engine.weight_version()  # what the in-flight test left ("0" run alone)
    version = int(held) + 1

    trainer = join_one_trainer([engine], state, timeout_s=60)  # noticed long before it
    slow = KillingSource(state, lambda: ray_cluster.kill(engine.actor), after=5)
    with pytest.raises(RefitError) as failure:
        trainer.fleet.refit(lambda: trainer.sender.refit(slow, version), version)
    elapsed = time.monotonic() - slow.killed_at
    print(f"[ray] the trainer raised {elapsed:.2f} s after the kill: {failure.value}")
    # vLLM's worker (a grandchild of the actor) exits a few seconds after the actor; the
    # trainer notices at once when it does, whatever the (long) timeout.
    assert elapsed < 10 and "engine served" in str(failure.value)
    assert wait_gone(pids) == [], "processes of the killed engine survived"
    trainer.group.destroy()
    replacement = RayEngine.start(config, serving=True, name="replacement")
    try:
        fresh = join_one_trainer([replacement], {n: t * 2 for n, t in state.items()})
        fresh.refit(1)
        assert replacement.weight_version() == "1"
        (out,) = replacement.generate([PROMPTS[0]], 4)
        assert out.weight_versions == [("1", 0, 4)]
        fresh.group.destroy()
    finally:
        replacement.close()
