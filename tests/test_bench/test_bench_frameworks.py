"""The frameworks benchmark's quick form (``python -m benchmarks frameworks --quick`` --in-process):
every configuration, under the HF Trainer and Lightning, trains a tiny BERT, writes checkpoints
that load back bit for bit, and the compressed ones stay within the search policy's eval_fn
budget. About 30 s on 2 cores: the configurations run in this process (the benchmark's own
runs give each a fresh one, for its peak RSS)."""

from __future__ import annotations

import importlib
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")


pytestmark = [
    # Lightning's notices about a CPU run: no workers in the data loader, no logger
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:The number of training batches.*"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _bench():
    """The benchmark as ``python -m benchmarks frameworks`` imports it: a module of the package."""
    return importlib.import_module("benchmarks.bench_frameworks")


def test_every_configuration_checkpoints_and_loads_back(tmp_path):
    bench = _bench()
    lines: list[str] = []
    out = tmp_path / "results.json"
    results = bench.main(["--quick", "--in-process", "--json", str(out), "--markdown", str(tmp_path / "fw.md")],
                         emit=lines.append)
    by_name = {r.config: r for r in results}
    assert list(by_name) == [c.name for c in bench.CONFIGS]
    size = bench.QUICK
    saves = size.steps // size.every
    for r in results:
        assert r.saves == saves, r.config
        assert len(r.blocked_ms) == saves and all(b >= 0 for b in r.blocked_ms), r.config
        assert r.fit_s > 0 and r.peak_rss_mb > 0 and r.state_mb > 0, r.config
        assert r.disk_bytes > 0, r.config
        # the newest checkpoint loads back as the trained weights (compressed: its restore residual)
        assert r.exact, r.config
        assert 0.0 <= r.stored_accuracy <= 1.0 and r.stored_loss > 0, r.config
    for framework in ("hf", "lightning"):
        # the same seed, data and schedule: checkpointing does not change the training
        live = {r.live_loss for r in results if r.framework == framework}
        assert len(live) == 1, (framework, live)
    # compressed weights take fewer bytes than lossless ones
    assert by_name["hf-compressed"].disk_bytes < by_name["hf-lossless"].disk_bytes
    assert by_name["lightning-compressed"].disk_bytes < by_name["lightning-lossless"].disk_bytes
    # the default search policy's budget: at most 8 eval_fn calls on the first save, 3 on later
    # ones, 8 on a later save whose search fell back to a keyframe (SearchPolicy.widen_for_keyframes)
    compressed = by_name["hf-compressed"]
    assert len(compressed.evaluations) == len(compressed.searches) == saves
    limits = {"first": 8, "later": 3, "keyframe": 8}
    for i, (calls, search) in enumerate(zip(compressed.evaluations, compressed.searches, strict=True)):
        budget = search["budget"]
        assert budget["kind"] == "first" if i == 0 else budget["kind"] in ("later", "keyframe"), search
        assert budget["max_evals"] == limits[budget["kind"]], search
        assert 1 <= calls == budget["calls"] <= budget["max_evals"], search
    assert sum(compressed.evaluations) == compressed.eval_fn_calls   # the Checkpointer counts every call
    # background saves ran off the loop and were timed; the frameworks' own saves run in the loop
    assert len(by_name["hf-lossless"].background_s) == saves
    assert len(by_name["lightning-lossless-bg"].background_s) == saves
    assert by_name["hf-default"].background_s == [] and by_name["lightning-lossless"].background_s == []
    assert json.loads(out.read_text())[0]["config"] == "hf-default"
    text = "\n".join(lines)
    assert "## What users feel: Hugging Face Trainer and Lightning" in text
    assert "| InshrinkCallback(lossless=True): fit wall <= 1.05x the default's |" in text
