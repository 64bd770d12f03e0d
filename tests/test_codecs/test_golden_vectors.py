"""Every committed vector under codecs/<id>/vectors/ decodes, and re-encodes to the same bytes.

A format change makes this fail loudly: old stores must stay readable. Codecs are
found the way any reader finds them, through numcodecs' registry and the
``numcodecs.codecs`` entry points, never by importing our modules here; a codec id
whose module does not import yet is skipped by name, one with no codec fails.
Vector format: ``codecs/inshrink.nuq/make_vectors.py``.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numcodecs
import numpy as np
import pytest
from numcodecs.compat import ensure_bytes

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "codecs"
CODEC_IDS = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
VECTORS = sorted(ROOT.glob("*/vectors/*/"))


def codec_class(codec_id: str) -> type:
    """The registered numcodecs class for an id; skip when its module does not import yet."""
    cls = numcodecs.registry.codec_registry.get(codec_id)
    if cls is not None:
        return cls
    entry = numcodecs.registry.entries.get(codec_id)
    assert entry is not None, (
        f"codecs/{codec_id}/ exists but no numcodecs codec is registered under {codec_id!r}: "
        "add it to the numcodecs.codecs entry points in pyproject.toml"
    )
    try:
        return entry.load()
    except Exception as exc:  # a module being written may fail in any way
        pytest.skip(f"{codec_id}: its module does not import yet ({type(exc).__name__}: {exc})")


def _int_view(a: np.ndarray) -> np.ndarray:
    """Integer view of the same bytes: NaN payloads and -0.0 compare bit for bit."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(f"<u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a.view(np.uint8)


@pytest.mark.parametrize("codec_id", CODEC_IDS)
def test_every_codec_folder_has_a_spec_a_schema_vectors_and_a_registered_codec(codec_id):
    folder = ROOT / codec_id
    assert (folder / "README.md").is_file(), f"codecs/{codec_id}/README.md (the spec) is missing"
    schema = json.loads((folder / "schema.json").read_text())
    assert schema.get("type") == "object", f"codecs/{codec_id}/schema.json is not an object schema"
    assert list((folder / "vectors").glob("*/encoded.bin")), f"codecs/{codec_id} has no vectors"
    assert codec_class(codec_id).codec_id == codec_id


def test_a_codec_id_without_a_registered_class_fails():
    with pytest.raises(AssertionError, match="no numcodecs codec is registered"):
        codec_class("inshrink.no-such-codec")


@pytest.mark.parametrize("folder", VECTORS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_vector_decodes_and_reencodes(folder):
    codec_id = folder.parent.parent.name
    config = json.loads((folder / "config.json").read_text())
    assert config.get("id") == codec_id, f"{folder}/config.json names {config.get('id')!r}"
    codec_class(codec_id)
    codec = numcodecs.get_codec(dict(config))
    given = np.load(folder / "input.npy", allow_pickle=False)
    encoded = (folder / "encoded.bin").read_bytes()
    if (folder / "base.bin").exists():  # delta codecs: input is the uint8 bytes of a payload
        base = (folder / "base.bin").read_bytes()
        assert ensure_bytes(codec.decode(encoded, base=base)) == given.tobytes()
        assert ensure_bytes(codec.encode(given.tobytes(), base=base)) == encoded
        return
    expected = given
    if (folder / "decoded.npy").exists():  # lossy: decode returns the projection of input
        expected = np.load(folder / "decoded.npy", allow_pickle=False)
        assert expected.dtype == given.dtype and expected.shape == given.shape
        assert ensure_bytes(codec.encode(expected)) == encoded, "lossy codec is not a projection"
    decoded = np.asarray(codec.decode(encoded))
    assert decoded.dtype == expected.dtype and decoded.size == expected.size
    assert np.array_equal(_int_view(decoded), _int_view(expected))
    assert ensure_bytes(codec.encode(given)) == encoded


def test_nuq_vectors_script_reproduces_the_committed_vectors(tmp_path):
    runpy.run_path(str(REPO / "codecs" / "inshrink.nuq" / "make_vectors.py"), run_name="not_main")["main"](tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = ROOT / "inshrink.nuq" / "vectors"
    assert {p.parts[2] for p in made} == {p.name for p in committed.iterdir() if p.is_dir()}
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} differs"
