"""FP8 refits over real gloo refit groups: the engine's block-FP8 checkpoint says which weights
it holds in FP8; two trainers quantize those and send fp8 bytes and scales in the same buckets;
receivers check every byte against vLLM's own reference quantizer (`per_block_cast_to_fp8`)
applied to the same bf16 weights: whole frames, compact (shard-to-shard) frames, deltas,
checksums, and a weight with a NaN refused by name and rolled back by the undo log.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from common.errors import FormatMismatchError, RefitError
from common.plan import RefitPlan, TensorSpec
from common.quant.fp8_blocks import BlockFp8Format
from common.quant.fp8_plan import Fp8Source, Fp8Targets, fp8_specs, scale_name
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok
from tests.test_shard_core import CONFIG, TwoSources, bucket_image, needs_for

TRAINERS, WORLD = 2, 4  # rank 2 takes whole frames, rank 3 half of every tensor (compact)
# interleaved: the trainers' buckets in turn, so the FP8 source's order is not the listed one
FP8_CONFIG = dataclasses.replace(CONFIG, delta=True, undo_bytes=64 << 20, interleave=True)
EXPERTS = 6
QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}


def bf16_weights(version: int, nan_in: str | None = None) -> dict[str, torch.Tensor]:
    """A small MoE layer, HF names: FP8 projections (odd shapes: partial blocks), a bf16
    embedding, router and norm, the fp32 router bias. Each later version changes 3% of the
    last's elements (an RL step); `nan_in` puts a NaN into that weight."""
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(96, 64, generator=g),
           "model.layers.0.self_attn.q_proj.weight": torch.randn(200, 130, generator=g),
           "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 300, generator=g) * 1e-3,
           **{f"model.layers.0.mlp.experts.{i}.{p}.weight": torch.randn(48, 64, generator=g)
              for i in range(EXPERTS) for p in ("gate_proj", "down_proj")},
           "model.layers.0.mlp.gate.weight": torch.randn(EXPERTS, 64, generator=g),
           "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(EXPERTS, generator=g),
           "model.norm.weight": torch.randn(64, generator=g)}
    out = {n: t if n.endswith("bias") else t.bfloat16() for n, t in out.items()}
    for v in range(2, version + 1):
        step = torch.Generator().manual_seed(v)
        for name, t in out.items():
            pick = torch.rand(t.shape, generator=step) < 0.03
            out[name] = t + pick * torch.randn(t.shape, generator=step).to(t.dtype)
    if nan_in is not None:
        out[nan_in] = out[nan_in].clone()
        out[nan_in][3, 5] = float("nan")
    return out


def is_target(name: str) -> bool:
    return name.endswith("proj.weight")


def reference(version: int) -> dict[str, torch.Tensor]:
    """The engine checkpoint's tensors for `version`, quantized by vLLM's reference."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out = {}
    for name, t in bf16_weights(version).items():
        if is_target(name):
            out[name], out[scale_name(name)] = per_block_cast_to_fp8(t, [128, 128])
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Fp8Targets, dict[int, dict[str, torch.Tensor]]]:
    """An FP8 checkpoint on disk (v1) and the reference tensors of versions 1-4."""
    path = tmp_path_factory.mktemp("fp8_ckpt")
    refs = {v: reference(v) for v in (1, 2, 4)}
    save_file(refs[1], str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": QUANT_CONFIG}))
    return Fp8Targets.from_checkpoint(path), refs


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def fp8_rank(rank: int, world: int, port: int, targets: Fp8Targets, refs: dict) -> dict:
    """v1, v2 (delta), v3 with a NaN in a weight trainer 1 sends (refused, rolled back),
    v4 (delta against v2); receivers check every byte of every frame."""
    torch.set_num_threads(1)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=TRAINERS, timeout_s=FP8_CONFIG.timeout_s)
    nan_in = "model.layers.0.mlp.experts.5.down_proj.weight"
    if group.is_trainer:
        source = Fp8Source(TwoSources(bf16_weights(1)), targets)
        plan = RefitPlan.build(source.plan_specs(), FP8_CONFIG)
        assert [s.name for s in plan.specs] != [s.name for s in source.plan_specs()]
        sender, out = RefitSender.setup(group, plan), {}
        for version in (1, 2, 3, 4):
            source.inner = TwoSources(bf16_weights(version, nan_in if version == 3 else None))
            try:
                stats = sender.refit(source, version)
                out[version] = {r: t["delta_frames"] for r, t in stats.receivers.items()}
            except RefitError as e:
                out[version] = f"failed: {e}"
        return out
    receiver = RefitReceiver.setup(group)
    if rank == 3:
        receiver.needs = needs_for(receiver.plan, 0)
    out = {}
    for version in (1, 2, 3, 4):
        check = ByteCheck(receiver, refs[2 if version == 3 else version])
        try:
            stats = receiver.receive(check.whole, on_compact=check.compact, version=version)
            out[version] = {"checked": check.good, "bad": check.bad,
                            "delta_frames": stats.delta_frames}
        except RefitError as e:
            check.good, check.bad = 0, []  # what landed before the abort was v3's
            out[version] = {"failed": str(e), "rolled_back": receiver.roll_back(
                check.whole, check.compact), "checked_back": check.good, "bad": check.bad}
    out["plan"] = [(s.name, s.dtype) for s in receiver.plan.specs]
    return out


class ByteCheck:
    """Receive callbacks counting the tensors (whole frames) and frames (compact) whose every
    byte equals `want`'s, and naming the others."""

    def __init__(self, receiver: RefitReceiver, want: dict[str, torch.Tensor]) -> None:
        self.receiver, self.want, self.good, self.bad = receiver, want, 0, []

    def whole(self, items: list) -> None:
        for name, got in items:
            if torch.equal(bytes_of(got), bytes_of(self.want[name])):
                self.good += 1
            else:
                self.bad.append(name)

    def compact(self, index: int, payload: torch.Tensor) -> None:
        plan, ranges = self.receiver.plan, self.receiver.needs.buckets[index]
        image, got = bucket_image(plan, index, self.want), payload.numpy()
        same = all(np.array_equal(got[place : place + n], image[start : start + n])
                   for place, start, n in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                              strict=True))
        if same:
            self.good += 1
        else:
            self.bad.append(f"bucket {index}")


def test_fp8_refit_bit_for_bit_with_deltas_shards_and_a_refused_nan(checkpoint) -> None:
    targets, refs = checkpoint
    assert targets.names == {n for n in bf16_weights(1) if is_target(n)}
    res = expect_ok(run_ranks(fp8_rank, WORLD, targets, refs))
    plan = dict(res[2]["plan"])
    assert plan["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert plan["model.layers.0.self_attn.q_proj.weight_scale_inv"] == torch.float32
    assert plan["model.layers.0.mlp.gate.e_score_correction_bias"] == torch.float32
    assert plan["model.embed_tokens.weight"] == torch.bfloat16
    whole, compact = res[2], res[3]
    for v in (1, 2, 4):
        assert whole[v]["checked"] == len(refs[v]) and not whole[v]["bad"], whole[v]
        assert compact[v]["checked"] > 0 and not compact[v]["bad"], compact[v]
        assert (whole[v]["delta_frames"] > 0) == (v > 1) == (compact[v]["delta_frames"] > 0)
    for rank in (0, 1, 2, 3):  # v3 refused on every rank, naming the weight and the NaN
        failed = res[rank][3] if rank < TRAINERS else res[rank][3]["failed"]
        assert "experts.5.down_proj.weight" in failed and "NaN" in failed, (rank, failed)
    for r in (whole, compact):  # each rolled back to v2, every byte checked
        assert r[3]["rolled_back"] > 0 and r[3]["checked_back"] > 0 and not r[3]["bad"], r[3]


@pytest.mark.parametrize("inner", ["dict", "items"])
def test_fp8_source_hands_whole_buckets_to_the_sender_by_address(inner: str) -> None:
    """A bucket whose weights all quantize goes as one `PreparedBucket` (no tensor per item):
    its addresses are those of its tensors, in plan order, and those equal the quantizer's
    (scales sent in a later bucket than their weight too); a bucket holding a NaN goes item
    by item, the weight and its scale refused by name. The inner source's tensors taken
    straight from its dict (`MappingItems`) or from its items (a read-only view of the dict),
    alike."""
    from types import MappingProxyType

    from common.quant.fp8_blocks import quantize
    from common.source import (
        DictWeightSource,
        MappingItems,
        PreparedBucket,
        RefusedTensor,
        iter_items,
    )

    weights = bf16_weights(1)
    targets = Fp8Targets(BlockFp8Format(), frozenset(n for n in weights if is_target(n)))
    held = DictWeightSource(weights if inner == "dict" else MappingProxyType(weights))
    source = Fp8Source(held, targets)
    plan = RefitPlan.build(source.plan_specs(), dataclasses.replace(CONFIG, bucket_bytes=1 << 14))
    inner_items = held.iter_tensors(RefitPlan.build(held.plan_specs(), CONFIG))
    assert isinstance(inner_items, MappingItems) == (inner == "dict")
    items = list(source.iter_tensors(plan))
    with_target = [tuple(s.name for s in plan.bucket_specs(b)) for b in plan.buckets
                   if any(s.name in targets.names for s in plan.bucket_specs(b))]
    prepared = [b for b in items if isinstance(b, PreparedBucket)]
    assert [b.names for b in prepared] == with_target and len(with_target) > 2
    for b in prepared:  # the rest (embedding, norms, router, a scale alone): item by item
        assert b.ptrs.tolist() == [t.data_ptr() for t in b.views()]
    got = dict(iter_items(items))
    assert got.keys() == {s.name for s in plan.specs}
    for name in targets.names:
        q, s = quantize(name, weights[name].float().bfloat16(), targets.fmt)
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(got[scale_name(name)], s), name
    bad = "model.layers.0.mlp.experts.5.down_proj.weight"
    weights[bad] = weights[bad].clone()
    weights[bad][3, 5] = float("nan")
    items = dict(iter_items(source.iter_tensors(plan)))
    for name in (bad, scale_name(bad)):
        assert isinstance(items[name], RefusedTensor) and "NaN" in items[name].reason, name


def test_fp8_frames_by_address_hold_the_quantizers_bytes() -> None:
    """gloo, world size 1: the frames the sender packed from buckets handed over by address
    (`tests/fp8_frames.py`; the GPU machine runs it on NCCL, eager and by graph replay)."""
    from tests.fp8_frames import frames_hold_the_quantizers_bytes

    assert frames_hold_the_quantizers_bytes("cpu") == 2 * len(fp8_specs(
        [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in bf16_weights(1).items()],
        Fp8Targets(BlockFp8Format(), frozenset(n for n in bf16_weights(1) if is_target(n)))))


def test_fp8_specs_turn_targets_into_the_checkpoint_format() -> None:
    fmt = BlockFp8Format()
    specs = [TensorSpec("a.weight", (200, 130), torch.bfloat16, 1),
             TensorSpec("norm.weight", (64,), torch.bfloat16, 0)]
    out = fp8_specs(specs, Fp8Targets(fmt, frozenset({"a.weight"})))
    assert out == [TensorSpec("a.weight", (200, 130), torch.float8_e4m3fn, 1),
                   TensorSpec("a.weight_scale_inv", (2, 2), torch.float32, 1), specs[1]]


@pytest.mark.parametrize("specs, names, says", [
    ([TensorSpec("a.weight", (4, 4), torch.bfloat16)], {"b.weight"}, "no such tensor"),
    ([TensorSpec("a.weight", (16,), torch.bfloat16)], {"a.weight"}, "2-D bf16"),
    ([TensorSpec("a.weight", (4, 4), torch.int32)], {"a.weight"}, "2-D bf16"),
    ([TensorSpec("a.weight", (4, 4), torch.bfloat16),
      TensorSpec("a.weight_scale_inv", (1, 1), torch.float32)], {"a.weight"}, "computed by refit"),
])
def test_fp8_setup_refuses_what_the_trainers_cannot_send(specs, names, says) -> None:
    with pytest.raises(FormatMismatchError, match=says) as e:
        fp8_specs(specs, Fp8Targets(BlockFp8Format(), frozenset(names)))
    assert any(n in str(e.value) for n in names | {s.name for s in specs})


@pytest.mark.parametrize("tensors, says", [
    ({"a.weight": torch.zeros(4, 4).to(torch.float8_e5m2)}, "held as float8_e5m2"),
    ({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
      "a.weight_scale_inv": torch.ones(2, 1)}, r"float32 \[2, 1\]; .* float32 \[1, 1\]"),
    ({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, "'a.weight_scale_inv' is missing"),
    ({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
      "a.weight_scale_inv": torch.ones(1, 1), "a.input_scale": torch.ones(())},
     "'a.input_scale' is held as float32"),
    ({"a.weight": torch.zeros(4, 4, dtype=torch.int8)}, "held as int8"),
])
def test_fp8_checkpoint_formats_refit_cannot_produce_are_refused(tmp_path, tensors, says) -> None:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": QUANT_CONFIG}))
    with pytest.raises(FormatMismatchError, match=says):
        Fp8Targets.from_checkpoint(tmp_path)


def test_fp8_checkpoint_without_quantization_has_no_targets(tmp_path) -> None:
    save_file({"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    assert Fp8Targets.from_checkpoint(tmp_path) is None
    save_file({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatMismatchError, match="no quantization_config"):
        Fp8Targets.from_checkpoint(tmp_path)


def test_fp8_targets_travel_as_json() -> None:
    t = Fp8Targets(BlockFp8Format((64, 32), ue8m0=True), frozenset({"x.weight", "y.weight"}))
    assert Fp8Targets.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_fp8_plan_fits_an_engine_serving_the_fp8_checkpoint(checkpoint, tmp_path) -> None:
    """An FP8 engine's plan check (`engine_dtypes`, as the backend runs it): the quantized
    weights and scales in their checkpoint dtypes, also under names vLLM fuses away; an
    unquantized engine's model dtype, or a bf16 plan against the FP8 checkpoint, is refused."""
    from common.checkpoint import checkpoint_tensors, engine_dtypes, plan_problems

    targets, refs = checkpoint
    path = tmp_path / "model.safetensors"
    save_file(refs[1], str(path))
    held = checkpoint_tensors(tmp_path)
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    params = {bias: torch.float32, "model.layers.0.self_attn.o_proj.weight": torch.float8_e4m3fn}
    bf16 = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in bf16_weights(1).items()]
    fp8 = fp8_specs(bf16, targets)
    assert plan_problems(fp8, held, engine_dtypes(params, held, torch.bfloat16, True)) == []
    unquantized = plan_problems(fp8, held, engine_dtypes(params, held, torch.bfloat16, False))
    assert any("q_proj.weight': plan dtype float8_e4m3fn, the receiver keeps it as bfloat16"
               in p for p in unquantized), unquantized
    as_bf16 = plan_problems([s for s in bf16 if s.name in held], held,
                            engine_dtypes(params, held, torch.bfloat16, True))
    assert any("q_proj.weight': plan dtype bfloat16, the receiver keeps it as float8_e4m3fn"
               in p for p in as_bf16), as_bf16
    router = "model.layers.0.mlp.gate.weight"  # vLLM quantized a router the config did not list
    unlisted = plan_problems(fp8, held, engine_dtypes({**params, router: torch.float8_e4m3fn},
                                                      held, torch.bfloat16, True))
    assert len(unlisted) == 1 and router in unlisted[0], unlisted
    assert "stores it as bfloat16" in unlisted[0] and "modules_to_not_convert" in unlisted[0]
