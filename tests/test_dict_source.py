"""A dict source's buckets taken straight from its dict (`MappingItems`, one native pass per
bucket): the same tensors and addresses as its items give, every mismatch still named at its
place, nothing kept from an earlier refit."""

from __future__ import annotations

import shutil
from collections import OrderedDict
from types import MappingProxyType

import pytest
import torch

from common.config import RefitConfig
from common.dtype_policy import DtypePolicy
from common.errors import RefitError, TensorMismatchError
from common.kernels import native
from common.plan import RefitPlan
from common.source import DictWeightSource, MappingItems
from common.transfer.bucket_check import BucketChecker

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not (shutil.which("c++") and shutil.which("ninja")) or native.load() is None:
        pytest.skip("no native scan here: the sender takes every source item by item")


def weights() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.randn(16, 4 + i % 3).bfloat16() for i in range(96)}


def plan_of(source: DictWeightSource) -> RefitPlan:
    plan = RefitPlan.build(source.plan_specs(), RefitConfig(bucket_bytes=4096, alignment=64))
    assert len(plan.buckets) > 3
    return plan


@pytest.mark.parametrize("kind", [dict, OrderedDict])
def test_mapping_items_are_the_dicts_items(kind) -> None:
    tensors = kind(weights())
    source = DictWeightSource(tensors)
    plan = plan_of(source)
    it = source.iter_tensors(plan)
    assert isinstance(it, MappingItems)
    assert [(n, t) for n, t in it] == [(n, tensors[n]) for n in plan.names]
    assert it.position == len(plan.names)
    for other in (DictWeightSource(MappingProxyType(tensors)),  # not a dict: its own `get`
                  DictWeightSource(tensors, DtypePolicy(torch.float32))):  # casts per item
        items = other.iter_tensors(plan_of(other))
        assert not isinstance(items, MappingItems) and len(list(items)) == len(tensors)


def test_mapping_take_gives_the_dicts_tensors_and_addresses() -> None:
    tensors = weights()
    source = DictWeightSource(tensors)
    plan = plan_of(source)
    sender, other = (BucketChecker(plan, rank, CPU, f"rank {rank}") for rank in (0, 1))
    mine, theirs = source.iter_tensors(plan), source.iter_tensors(plan)
    for bucket in plan.buckets:
        got, ptrs = sender.take(mine, bucket, 1)
        names = plan.names[bucket.start:bucket.stop]
        assert [id(t) for t in got] == [id(tensors[n]) for n in names]
        assert ptrs is not None and list(ptrs) == [tensors[n].data_ptr() for n in names]
        assert mine.position == bucket.stop
        assert other.take(theirs, bucket, 1) == ([], None)  # not its source: skipped
        assert theirs.position == bucket.stop


@pytest.mark.parametrize("drift", ["dtype", "shape", "missing"])
def test_a_drifted_tensor_is_named_at_its_place(drift: str) -> None:
    tensors = weights()
    source = DictWeightSource(tensors)
    plan = plan_of(source)
    bucket = plan.buckets[2]
    name = plan.names[bucket.start + 1]
    if drift == "dtype":
        tensors[name] = tensors[name].float()
    elif drift == "shape":
        tensors[name] = tensors[name].t().contiguous()
    else:
        del tensors[name]
    checker, it = BucketChecker(plan, 0, CPU, "rank 0"), source.iter_tensors(plan)
    for earlier in plan.buckets[:2]:
        checker.take(it, earlier, 3)
    with pytest.raises(TensorMismatchError) as e:
        checker.take(it, bucket, 3)
    assert f"bucket 2 tensor #{bucket.start + 1} {name!r}" in str(e.value)
    why = {"dtype": "dtype float32 but the plan says bfloat16", "shape": "shape [",
           "missing": "no tensor on its source rank 0"}[drift]
    assert why in str(e.value)


def test_a_source_that_ends_early_is_named_at_the_first_missing_tensor() -> None:
    tensors = weights()
    plan = plan_of(DictWeightSource(tensors))
    bucket = plan.buckets[1]
    short = iter([(n, tensors[n]) for n in plan.names[:bucket.start + 2]])  # items, no dict
    checker = BucketChecker(plan, 0, CPU, "rank 0")
    checker.take(short, plan.buckets[0], 1)
    with pytest.raises(RefitError, match=rf"weight source ended at "
                       rf"'{plan.names[bucket.start + 2]}' \(tensor #{bucket.start + 2}\)"):
        checker.take(short, bucket, 1)


def test_a_replaced_tensor_is_taken_afresh() -> None:
    tensors = weights()
    source = DictWeightSource(tensors)
    plan = plan_of(source)
    checker = BucketChecker(plan, 0, CPU, "rank 0")
    bucket, name = plan.buckets[1], plan.names[plan.buckets[1].start]

    def refit() -> tuple[list, list]:
        it = source.iter_tensors(plan)
        taken = [checker.take(it, b, 1) for b in plan.buckets]
        got, ptrs = taken[bucket.index]
        return got, list(ptrs)

    before = refit()
    tensors[name] = torch.zeros_like(tensors[name])
    got, ptrs = refit()
    assert got[0] is tensors[name] and ptrs[0] == tensors[name].data_ptr() != before[1][0]
