"""QuantizationRecord: the typed, versioned metadata["quantization"] of a version."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy import (
    Allocation,
    QuantConfig,
    QuantizationRecord,
    SearchPoint,
    SearchResult,
    SearchSpace,
)
from inshrink_store.policy.record import VERSION
from inshrink_store.policy.search import Trial

POINTS = SearchSpace().points()
finite = st.floats(-1e6, 1e6, allow_nan=False)
configs = st.builds(QuantConfig, bins=st.sampled_from([4, 6, 8, 12, 16, 32]), prune=st.sampled_from([0.0, 0.1, 0.5]),
                    prune_metric=st.sampled_from(["magnitude", "sensitivity"]), protect=st.sampled_from([0.0005, 0.01]),
                    protected_dtype=st.sampled_from(["bfloat16", "float32"]), min_numel=st.integers(1, 10_000))
trials = st.builds(Trial, st.sampled_from(POINTS), st.floats(0.1, 100),
                   st.one_of(st.none(), finite), st.one_of(st.none(), st.booleans()))
results = st.builds(SearchResult, st.one_of(st.none(), st.sampled_from(POINTS)), st.lists(trials, max_size=5),
                    st.sampled_from(["full", "neighbourhood", "fallback"]))
allocations = st.one_of(
    st.builds(Allocation, target_ratio=st.floats(1, 100), protect=st.sampled_from([0.0, 0.005])),
    st.builds(Allocation, max_error=st.floats(1e-4, 1), levels=st.lists(st.integers(2, 254), min_size=1, max_size=5)))
records = st.builds(QuantizationRecord, config=st.one_of(st.none(), configs), tolerance=st.floats(0, 1),
                    higher_is_better=st.booleans(), baseline_quality=st.one_of(st.none(), finite),
                    search=st.one_of(st.none(), results), model_ratio_estimate=st.one_of(st.none(), st.floats(0.1, 1e3)),
                    allocation=st.one_of(st.none(), allocations))


@settings(max_examples=200, deadline=None)
@given(record=records)
def test_to_dict_from_dict_is_the_identity_through_json(record: QuantizationRecord) -> None:
    data = json.loads(json.dumps(record.to_dict()))
    # the oldest layout that holds the record: readers from before allocations still read the rest
    assert data["version"] == (1 if record.allocation is None else VERSION)
    assert ("allocation" in data) == (record.allocation is not None)
    assert QuantizationRecord.from_dict(data) == record


def _old(**changes: Any) -> dict[str, Any]:
    """A metadata dict as the Checkpointer wrote it before records had a version."""
    search = SearchResult(SearchPoint(8, 0.2, "magnitude", 0.005),
                          [Trial(SearchPoint(8, 0.2, "magnitude", 0.005), 7.5, 0.91, True)], "full")
    data = {"config": QuantConfig(bins=8, prune=0.2).to_dict(), "baseline_quality": 0.93, "tolerance": 0.05,
            "higher_is_better": True, "search": search.to_dict(), "model_ratio_estimate": 7.5}
    return {**data, **changes}


def test_old_format_dicts_read_as_version_1() -> None:
    record = QuantizationRecord.from_dict(_old())
    assert record.version == 1 and record.config == QuantConfig(bins=8, prune=0.2)
    assert record.search is not None and record.search.evaluations == 1 and record.search.mode == "full"
    lossless = QuantizationRecord.from_dict(_old(config=None, model_ratio_estimate=None))
    assert lossless.config is None
    no_eval = QuantizationRecord.from_dict(_old(search=None, baseline_quality=None))
    assert no_eval.search is None and no_eval.baseline_quality is None
    # the same layout plus the version: what the Checkpointer writes now
    assert {k: v for k, v in record.to_dict().items() if k != "version"} == _old()


@pytest.mark.parametrize(("data", "field"), [
    (_old(config={"bins": 1}), "config"),
    (_old(config="16 bins"), "config"),
    (_old(tolerance="5%"), "tolerance"),
    (_old(tolerance=True), "tolerance"),
    (_old(higher_is_better=1), "higher_is_better"),
    (_old(baseline_quality=[0.9]), "baseline_quality"),
    (_old(search={"best": None}), "search"),
    (_old(search={"best": None, "mode": "full", "trials": [1]}), "search"),
    (_old(model_ratio_estimate="7x"), "model_ratio_estimate"),
    (_old(version=VERSION + 1), "version"),
    (_old(version=0), "version"),
    (_old(allocation={"target_ratio": 0.5}), "target_ratio"),
    (_old(allocation={"target_ratio": 8, "max_error": 0.1}), "exactly one"),
    (_old(allocation=[8]), "allocation"),
    (_old(version="1"), "version"),
    (_old(extra=1), "extra"),
    ({k: v for k, v in _old().items() if k != "tolerance"}, "tolerance"),
])
def test_garbage_is_a_format_error_naming_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(FormatError, match=field):
        QuantizationRecord.from_dict(data)


@pytest.mark.parametrize("data", [None, [], "quantized", 3])
def test_a_non_dict_is_a_format_error(data: Any) -> None:
    with pytest.raises(FormatError, match="to be a dict"):
        QuantizationRecord.from_dict(data)
