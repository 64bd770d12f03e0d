"""The skip every GPU test module starts with: CuPy installed and a CUDA device usable."""

from __future__ import annotations

from types import ModuleType

import pytest

from inshrink_store.codecs import _gpu


def cupy_or_skip() -> ModuleType:
    """CuPy's module, or a module-level skip that says what is missing."""
    cp = pytest.importorskip(
        "cupy", reason="CuPy is not installed (pip install 'inshrink-store[gpu]')"
    )
    reason = _gpu.why_unavailable()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
    return cp
