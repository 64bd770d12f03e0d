"""Every committed vector under codecs/<id>/vectors/ decodes, and re-encodes to the same bytes.

A format change makes this fail loudly: old stores must stay readable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numcodecs
import numpy as np
import pytest

import inshrink_store.codecs.nuq  # noqa: F401  (registers the codecs)
import inshrink_store.codecs.vdelta  # noqa: F401

ROOT = Path(__file__).resolve().parents[2] / "codecs"
VECTORS = sorted(ROOT.glob("*/vectors/*/"))


def test_every_codec_folder_has_a_spec_a_schema_and_vectors():
    ids = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
    assert ids == ["inshrink.nuq", "inshrink.vdelta"]
    for codec_id in ids:
        folder = ROOT / codec_id
        assert (folder / "README.md").is_file() and (folder / "schema.json").is_file()
        json.loads((folder / "schema.json").read_text())
        assert list((folder / "vectors").glob("*/encoded.bin")), f"{codec_id} has no vectors"
        assert numcodecs.registry.codec_registry.get(codec_id) is not None, f"{codec_id} is not registered"


@pytest.mark.parametrize("folder", VECTORS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_vector_decodes_and_reencodes(folder):
    config = json.loads((folder / "config.json").read_text())
    codec = numcodecs.get_codec(dict(config))
    expected = np.load(folder / "input.npy", allow_pickle=False)
    encoded = (folder / "encoded.bin").read_bytes()
    base_file = folder / "base.bin"
    if base_file.exists():
        base = base_file.read_bytes()
        assert codec.decode(encoded, base=base) == expected.tobytes()
        assert codec.encode(expected.tobytes(), base=base) == encoded
    else:
        decoded = np.asarray(codec.decode(encoded)).view(expected.dtype)
        committed = np.load(folder / "decoded.npy", allow_pickle=False)
        assert decoded.tobytes() == committed.tobytes()  # bit-exact, NaN payloads included
        assert codec.encode(expected) == encoded
        assert codec.encode(committed) == encoded  # lossy codecs are projections
