"""RefitPlan: bucket cutting, digest stability and sensitivity, serialisation, differences."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import RefitConfig
from common.plan import RefitPlan, TensorSpec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.uint8]


def sample_specs() -> list[TensorSpec]:
    return [
        TensorSpec("embed.weight", (64, 32), torch.bfloat16),
        TensorSpec("layers.0.mlp.gate.e_score_correction_bias", (8,), torch.float32),
        TensorSpec("layers.0.scalar", (), torch.float32),
        TensorSpec("layers.0.empty", (0, 4), torch.int64),
        TensorSpec("lm_head.weight", (64, 32), torch.bfloat16, source_rank=1),
    ]


spec_lists = st.lists(
    st.tuples(
        st.lists(st.integers(0, 40), min_size=0, max_size=3),
        st.sampled_from(DTYPES),
        st.integers(0, 2),
    ),
    min_size=0,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(spec_lists, st.sampled_from([1024, 2048, 5000]), st.sampled_from([1, 8, 256]),
       st.sampled_from([1024, 3000, 1 << 20]))
def test_buckets_are_bounded_aligned_ordered_and_single_source(items, bucket_bytes, alignment,
                                                               direct_bytes):
    specs = [TensorSpec(f"t{i}", tuple(shape), dtype, src)
             for i, (shape, dtype, src) in enumerate(items)]
    config = RefitConfig(bucket_bytes=bucket_bytes, alignment=alignment, direct_bytes=direct_bytes)
    plan = RefitPlan.build(specs, config)
    threshold = min(direct_bytes, bucket_bytes + 1)
    covered = [i for b in plan.buckets for i in b.spec_indices]
    assert covered == list(range(len(specs)))
    for b in plan.buckets:
        bspecs = plan.bucket_specs(b)
        assert {s.source_rank for s in bspecs} == {b.source_rank}
        assert b.oversize == (b.direct and bspecs[0].nbytes > bucket_bytes)
        if b.direct:
            assert len(bspecs) == 1 and bspecs[0].nbytes >= threshold
            continue
        assert all(s.nbytes < threshold for s in bspecs)
        assert b.nbytes <= bucket_bytes
        end = 0
        for spec, offset in zip(bspecs, b.offsets, strict=True):
            assert offset % alignment == 0 and offset >= end
            end = offset + spec.nbytes
        assert end == b.nbytes
    assert plan.buffer_bytes <= bucket_bytes


@settings(max_examples=200, deadline=None)
@given(spec_lists, st.sampled_from([1024, 2048, 5000]), st.sampled_from([1, 256]))
def test_interleaved_plan_takes_each_sources_buckets_in_turn(items, bucket_bytes, alignment):
    specs = [TensorSpec(f"t{i}", tuple(shape), dtype, src)
             for i, (shape, dtype, src) in enumerate(items)]
    config = RefitConfig(bucket_bytes=bucket_bytes, alignment=alignment, direct_bytes=3000,
                         concurrent_sources=False)
    listed = RefitPlan.build(specs, config)
    turned = RefitPlan.build(specs, dataclasses.replace(config, interleave=True))
    assert RefitPlan.build(specs, dataclasses.replace(config, concurrent_sources=True)
                           ).specs == turned.specs

    def by_source(plan):  # each source's tensors in plan order
        out = {}
        for s in plan.specs:
            out.setdefault(s.source_rank, []).append(s.name)
        return out

    # each source's own order; its buckets as listed, or merged where they came to touch
    assert by_source(turned) == by_source(listed)
    assert len(turned.buckets) <= len(listed.buckets)
    # merged by bytes: a source's next bucket comes when it has sent no more than any other
    # source that still has one (within one bucket: the merged order is cut again, which
    # can join a source's adjacent buckets)
    sent = dict.fromkeys({b.source_rank for b in turned.buckets}, 0)
    largest = max((b.nbytes for b in listed.buckets), default=0)
    for i, bucket in enumerate(turned.buckets):
        waiting = {b.source_rank for b in turned.buckets[i:]}
        assert sent[bucket.source_rank] <= min(sent[r] for r in waiting) + largest, (i, sent)
        sent[bucket.source_rank] += bucket.nbytes


def test_digest_is_stable_across_processes() -> None:
    plan = RefitPlan.build(sample_specs(), RefitConfig(bucket_bytes=4096))
    code = ("from tests.test_plan import sample_specs; from common.plan import RefitPlan;"
            "from common.config import RefitConfig;"
            "print(RefitPlan.build(sample_specs(), RefitConfig(bucket_bytes=4096)).digest)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == plan.digest


def test_digest_changes_with_any_name_shape_dtype_order_source_or_bucket_size() -> None:
    base = sample_specs()
    config = RefitConfig(bucket_bytes=4096)
    digest = RefitPlan.build(base, config).digest
    s = base[1]
    variants = {
        "name": [*base[:1], TensorSpec(s.name + "_", s.shape, s.dtype), *base[2:]],
        "shape": [*base[:1], TensorSpec(s.name, (9,), s.dtype), *base[2:]],
        "dtype": [*base[:1], TensorSpec(s.name, s.shape, torch.bfloat16), *base[2:]],
        "source": [*base[:1], TensorSpec(s.name, s.shape, s.dtype, 1), *base[2:]],
        "order": [base[1], base[0], *base[2:]],
    }
    digests = {k: RefitPlan.build(v, config).digest for k, v in variants.items()}
    digests["bucket size"] = RefitPlan.build(base, RefitConfig(bucket_bytes=8192)).digest
    digests["buffers"] = RefitPlan.build(base, RefitConfig(bucket_bytes=4096, num_buffers=3)).digest
    digests["direct"] = RefitPlan.build(base, RefitConfig(bucket_bytes=4096,
                                                          direct_bytes=2048)).digest
    assert digest not in digests.values() and len(set(digests.values())) == len(digests)


def test_json_round_trip_and_difference_messages() -> None:
    # listed order (concurrent sources would take the two sources' buckets in turn)
    config = RefitConfig(bucket_bytes=4096, timeout_s=7.5, checksum=True,
                         concurrent_sources=False)
    plan = RefitPlan.build(sample_specs(), config)
    back = RefitPlan.from_json(plan.to_json())
    assert back.digest == plan.digest and back.specs == plan.specs and back.config == config
    assert plan.difference(back) is None
    other = sample_specs()
    other[1] = TensorSpec(other[1].name, other[1].shape, torch.bfloat16)
    diff = plan.difference(RefitPlan.build(other, config))
    assert "tensor #1" in diff and "e_score_correction_bias" in diff and "float32" in diff
    diff = plan.difference(RefitPlan.build(sample_specs()[:-1], config))
    assert "5 vs 4 tensors" in diff and "lm_head.weight" in diff
    assert "bucket_bytes differs" in plan.difference(
        RefitPlan.build(sample_specs(), RefitConfig(bucket_bytes=2048)))


def test_large_tensors_get_buckets_of_their_own() -> None:
    specs = [TensorSpec("a", (10,), torch.float32), TensorSpec("big", (3000,), torch.float32),
             TensorSpec("b", (10,), torch.float32), TensorSpec("mid", (600,), torch.float32),
             TensorSpec("c", (10,), torch.float32)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=4096, direct_bytes=2048))
    assert [b.oversize for b in plan.buckets] == [False, True, False, False, False]
    assert [b.direct for b in plan.buckets] == [False, True, False, True, False]
    assert plan.largest_oversize_bytes == 12000 and plan.buffer_bytes == 2400


def test_duplicate_names_are_refused() -> None:
    spec = TensorSpec("a", (1,), torch.float32)
    try:
        RefitPlan.build([spec, spec])
    except ValueError as e:
        assert "'a' twice" in str(e)
    else:
        raise AssertionError("duplicate accepted")


def test_specs_from_meta_tensors_materialise_nothing() -> None:
    t = torch.empty(1 << 40, dtype=torch.bfloat16, device="meta")  # 2 TB: must stay metadata
    spec = TensorSpec.of("huge", t)
    assert spec.nbytes == 2 << 40 and spec.dtype == torch.bfloat16


def test_dict_source_lists_declared_dtypes_and_yields_them_in_plan_order() -> None:
    from common.dtype_policy import DtypePolicy
    from common.source import DictWeightSource

    weights = {"w": torch.randn(3, 2).bfloat16(), "router.bias": torch.randn(4).bfloat16()}
    source = DictWeightSource(weights, DtypePolicy(None, keep_fp32=(r"^router\.bias$",)),
                              source_rank=1)
    specs = source.plan_specs()
    assert [(s.name, s.dtype, s.source_rank) for s in specs] == [
        ("w", torch.bfloat16, 1), ("router.bias", torch.float32, 1)]
    plan = RefitPlan.build(specs[::-1], RefitConfig())  # the plan's order, not the dict's
    got = list(source.iter_tensors(plan))
    assert [name for name, _ in got] == ["router.bias", "w"]
    bias = got[0][1]
    assert bias.dtype == torch.float32 and torch.equal(bias, weights["router.bias"].float())
    assert got[1][1] is weights["w"]  # undeclared: the tensor itself, no copy
    assert list(DictWeightSource({}).iter_tensors(plan)) == [("router.bias", None), ("w", None)]


def test_one_dtype_policy_for_every_source() -> None:
    from common.dtype_policy import DtypePolicy
    from dtensor_refit import DtypePolicy as DTensorPolicy
    from mcore_refit import DtypePolicy as MegatronPolicy

    assert DTensorPolicy is DtypePolicy and MegatronPolicy is DtypePolicy
    p = DtypePolicy(torch.bfloat16)
    bias = "model.layers.3.mlp.gate.e_score_correction_bias"
    assert p.dtype_for(bias, torch.bfloat16) == torch.float32  # declared fp32 whatever it is now
    assert p.dtype_for("model.norm.weight", torch.float32) == torch.bfloat16
    assert p.dtype_for("model.steps", torch.int64) == torch.int64
    assert p.dtype_for("not_e_score_correction_bias", torch.float32) == torch.bfloat16
    q = DtypePolicy.of(torch.float16, fp32=[r"\.mlp\.gate\.weight$"])
    assert q.dtype_for("model.layers.1.mlp.gate.weight", torch.float32) == torch.float32
    assert q.dtype_for(bias, torch.float16) == torch.float32
    assert DtypePolicy(torch.bfloat16, keep_fp32=()).dtype_for(bias, torch.float32) == \
        torch.bfloat16
    keep = DtypePolicy(None)  # own dtypes, router bias still fp32
    assert keep.dtype_for("model.norm.weight", torch.float16) == torch.float16
    assert keep.dtype_for(bias, torch.bfloat16) == torch.float32
    assert DtypePolicy.as_given().dtype_for(bias, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError):
        DtypePolicy(torch.int8)
