"""The GPU path: CuPy kernels for the codecs and the sketch, byte-identical to the host's.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

The only module of inshrink-store that imports CuPy, and only inside functions, so
``import inshrink_store`` never does (zarr itself imports CuPy when it is installed, for its
GPU buffers). Install ``pip install 'inshrink-store[gpu]'``; :func:`available` says whether
CuPy and a CUDA device are usable. The callers are the array-library generic routines of
:mod:`~inshrink_store.codecs.nuq`, :mod:`~inshrink_store.codecs._payload`,
:mod:`~inshrink_store.codecs.vdelta` and :mod:`~inshrink_store.policy.sketch`: handed CuPy
arrays, they run the same code as on the host and call in here only where a fused kernel
clearly wins over a chain of CuPy calls (each CuPy call is one pass over memory):

=====================  =======================================================================
step                   on the device
=====================  =======================================================================
sketch keys, histogram :func:`sketch_histogram`: one fused kernel (widen, ``|x|``, ``log2``,
                       scale, ``ceil``, class), two fused min/max reductions, CuPy ``bincount``
level assignment       :func:`assign_levels`: one fused kernel (widen, nearest centre,
                       acceptance) in place of ~2 passes per centre on the host
payload assembly       ``nuq.Quantizer._finish`` + ``_payload.assemble`` on CuPy arrays:
                       ``flatnonzero`` (CuPy's scan) finds the rejected elements in element
                       order, only those are copied to the host (rescue and protection are
                       rare-path numpy code shared with the host path), their ids are
                       scattered back, header and ids are written into one device buffer
dequantization         ``nuq.Quantizer.decode`` on CuPy arrays: ``take`` (a gather) from the
                       level table, a masked store of the protected values
vdelta rearrangement   ``vdelta.delta_stream`` / ``apply_stream`` on CuPy arrays: modular
                       uint8/uint16 arithmetic, ``argsort`` (a stable radix sort) and its
                       inverse scatter
=====================  =======================================================================

Why the bytes are the same as numpy's (each kernel is compiled with ``--fmad=false``, so no
multiply and add are ever contracted into an FMA, and ``--ftz=false``, so denormals are
compared as numpy compares them rather than flushed to zero):

- *Widening* to float32 is exact in both libraries: float16 -> float32 is a conversion that
  never rounds, bfloat16 bits shifted into the top half of a float32 are that float32.
- *Nearest centre*: the id is the number of midpoints strictly below the value, a count
  of float32 comparisons; numpy counts with ``x > m`` per midpoint (or ``searchsorted``),
  the kernel with a binary search, and since the midpoints are strictly ascending both
  give the same integer. NaN compares false everywhere, and is rejected whatever its id.
- *Acceptance* is ``isfinite``, ``v == centre`` or ``|v - centre| <= tolerance`` in
  float32: one correctly rounded subtraction and a comparison, the same IEEE operations
  numpy performs (an infinite or NaN difference fails the comparison in both).
- *Rejected elements, rescue, protected words* are computed by the same numpy code on the
  host, from the same elements in the same (element) order.
- *Payload assembly, dequantization, vdelta*: integer copies, gathers, scatters, modular
  integer arithmetic and a stable sort, all exact.
- *Sketch keys* are ``ceil(log2(|x|) * scale)`` in float64, the operations numpy performs.
  ``log2`` is not correctly rounded in either library (numpy's own SIMD and scalar loops may
  differ in the last place), so identity rests on a margin instead: for every float32
  value (hence every float16 and bfloat16 value) other than 1.0, ``log2(|x|) * scale`` is at
  least ~200 times a four-ulp ``log2`` error away from the nearest integer at the default
  ``alpha``, and ``log2(1) = 0`` exactly in both; ``tests/test_codecs/test_xp_path.py``
  checks every bucket boundary. float64 inputs carry no such guarantee: a value within a
  few ulps of a bucket boundary may land one bucket over (about one value in 10^11).
  The histogram itself is integer counting (atomic adds), exact in any order.

Status: written and covered by ``tests/test_gpu`` (parity with the host on random and
trained-looking weights, every element dtype, odd sizes, NaN and infinities), which skips
without CuPy or a device; not yet run on a GPU (docs/guides/gpu.md).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.errors import FormatError, require

#: elements per sketch block on the device (int64 keys + int8 classes: ~150 MB of temporaries)
BLOCK = 1 << 24
#: NVRTC options of every kernel: no FMA contraction, denormals kept (see the module docstring)
OPTIONS = ("--fmad=false", "--ftz=false")


@functools.cache
def why_unavailable() -> str | None:
    """None when CuPy imports and sees a CUDA device, else the reason (for skip messages)."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); pip install 'inshrink-store[gpu]'"
    except Exception as exc:  # a CUDA library that fails to load
        return f"CuPy does not import ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device
        return f"CuPy found no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CuPy found no CUDA device"


def available() -> bool:
    """Whether CuPy and a CUDA device are usable (cached for the process)."""
    return why_unavailable() is None


def require_cupy() -> Any:
    """The CuPy module, or MissingDependencyError naming the ``gpu`` extra."""
    return require("cupy", "gpu")


# -- level assignment ---------------------------------------------------------------------

_CARRIER = {name: dtypes.by_codec_name(name).carrier for name in dtypes.CODEC_NAMES}
#: kernel expression widening one carrier element ``x`` to float32 (exact for every dtype)
_WIDEN = {
    "float32": "x",
    "float16": "(float)x",
    "bfloat16": "__uint_as_float(((unsigned int)x) << 16)",
}
#: kernel expression of ``nuq.Quantizer._accept`` for each kind of tolerance
_ACCEPT = {
    "finite": "isfinite(v)",  # tolerance inf
    "equal": "v == centres[lo]",  # tolerance 0
    "within": "fabsf(v - centres[lo]) <= tol",
}
_ASSIGN = """
const float v = {widen};
int lo = 0, hi = n_mids;
while (lo < hi) {{  // lower_bound: the number of midpoints strictly below v
    const int mid = (lo + hi) >> 1;
    if (mids[mid] < v) lo = mid + 1; else hi = mid;
}}
level = lo;
ok = {accept};
"""


@functools.cache
def _assign_kernel(element: str, mode: str) -> Any:
    cp = require_cupy()
    return cp.ElementwiseKernel(
        f"{_CARRIER[element].name} x, raw float32 mids, raw float32 centres, int32 n_mids, "
        "float32 tol",
        "I level, bool ok",
        _ASSIGN.format(widen=_WIDEN[element], accept=_ACCEPT[mode]),
        name=f"inshrink_nuq_assign_{element}_{mode}",
        options=OPTIONS,
    )


def _mode(tol32: np.float32 | None) -> str:
    return "finite" if tol32 is None else "equal" if tol32 == 0 else "within"


def assign_levels(carrier: Any, element: str, mids: np.ndarray, centres: np.ndarray | None,
                  tol32: np.float32 | None, id_dtype: np.dtype) -> tuple[Any, Any]:
    """Nearest-centre ids and acceptance flags of a CuPy carrier array, in one pass.

    The device twin of ``nuq.Quantizer._assign`` (see the module docstring for why the
    results are equal); ``tol32`` None means an infinite tolerance (finite values accepted).
    """
    cp = require_cupy()
    if element not in _CARRIER or carrier.dtype != _CARRIER[element]:
        raise FormatError(
            f"Expected a {_CARRIER.get(element, np.dtype('float32')).name} carrier array for "
            f"{element} elements. Got {carrier.dtype} instead; cast or view it first."
        )
    flat = carrier.reshape(-1)
    level = cp.empty(flat.size, id_dtype)
    ok = cp.empty(flat.size, bool)
    if flat.size:
        table = cp.asarray(centres if centres is not None else mids, dtype=np.float32)
        _assign_kernel(element, _mode(tol32))(
            flat, cp.asarray(mids, dtype=np.float32), table, np.int32(mids.size),
            np.float32(0 if tol32 is None else tol32), level, ok,
        )
    return level, ok


def nearest_index(x: Any, mids: np.ndarray, id_dtype: np.dtype) -> Any:
    """``nuq.nearest_index`` of float32 CuPy values: the number of midpoints below each."""
    return assign_levels(x, "float32", mids, None, None, id_dtype)[0]


# -- sketch -------------------------------------------------------------------------------

# classes: 0 zero, 1 positive, 2 negative, 3 NaN or infinite (never bucketed)
_SKETCH = """
const double a = {widen};
if (!isfinite(a)) {{ cls = 3; key = 0; }}
else if (a == 0.0) {{ cls = 0; key = 0; }}
else {{ key = (long long)ceil(log2(fabs(a)) * scale); cls = a < 0.0 ? 2 : 1; }}
"""
_BUCKETED = "(cls == 1 || cls == 2)"
_INT64_MAX, _INT64_MIN = "0x7fffffffffffffffLL", "(-0x7fffffffffffffffLL - 1)"


@functools.cache
def _sketch_kernel(dtype: str) -> Any:
    cp = require_cupy()
    widen = "(double)(float)x" if dtype == "float16" else "(double)x"
    return cp.ElementwiseKernel(
        f"{dtype} x, float64 scale", "int64 key, int8 cls", _SKETCH.format(widen=widen),
        name=f"inshrink_sketch_keys_{dtype}", options=OPTIONS,
    )


@functools.cache
def _key_bound(kind: str) -> Any:
    """Fused min or max of the keys of bucketed values (one pass, no compaction)."""
    cp = require_cupy()
    identity = _INT64_MAX if kind == "min" else _INT64_MIN
    return cp.ReductionKernel(
        "int64 key, int8 cls", "int64 y", f"{_BUCKETED} ? key : {identity}",
        f"{kind}(a, b)", "y = a", identity, f"inshrink_sketch_key_{kind}", options=OPTIONS,
    )


@functools.cache
def _bin_kernel() -> Any:
    cp = require_cupy()
    return cp.ElementwiseKernel(
        "int64 key, int8 cls, int64 lo, int64 span", "int64 bin",
        "bin = cls == 1 ? key - lo : (cls == 2 ? key - lo + span : 2 * span)",
        name="inshrink_sketch_bins", options=OPTIONS,
    )


def sketch_histogram(x: Any, scale: float) -> tuple[np.ndarray, int, int, int]:
    """Histogram of one CuPy block for ``policy.sketch``: ``(counts, lo, zeros, nonfinite)``.

    ``counts`` (host int64) counts keys ``lo..lo+span-1`` of positive values, then the same
    keys of negative values (empty when nothing is bucketed), exactly the histogram the
    host's ``_block_stores`` builds; only it and four integers leave the device."""
    cp = require_cupy()
    flat = x.reshape(-1)
    key = cp.empty(flat.size, cp.int64)
    cls = cp.empty(flat.size, cp.int8)
    if flat.size:
        _sketch_kernel(flat.dtype.name)(flat, float(scale), key, cls)
    zeros, pos, neg, bad = (int(c) for c in cp.bincount(cls.view(cp.uint8), minlength=4).get())
    if pos + neg == 0:
        return np.zeros(0, np.int64), 0, zeros, bad
    lo, hi = int(_key_bound("min")(key, cls)), int(_key_bound("max")(key, cls))
    span = hi - lo + 1
    bins = _bin_kernel()(key, cls, lo, span)
    counts = cp.bincount(bins, minlength=2 * span + 1)[: 2 * span].get().astype(np.int64)
    return counts, lo, zeros, bad
