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

Why the bytes are the same as numpy's. CuPy appends ``-ftz=true`` to the options of every
kernel it compiles (``cupy/cuda/compiler.py``), after ours, so float32 operations on the
device flush denormals to zero: a denormal compares equal to 0, converts to 0.0 when widened
and drops out of a subtraction. numpy keeps them. The first run on an H100 showed it: 13
parity failures, the sketch counting every float32 denormal as a zero (4788 against 42 on
the bucket-edge values) and denormals accepted as the centre 0 at tolerance 0. So the
kernels do **no float32 arithmetic and no float32 comparison at all**: every element is
read as its bits (a uint32 or uint16 view of the carrier) and widened to float64 with
integer operations, and every comparison and subtraction is done in float64, which
flush-to-zero never touches. ``--fmad=false`` (which CuPy leaves alone) keeps a multiply
and an add from being contracted into an FMA.

- *Widening* float32, float16 and bfloat16 bits to float64 is exact: a normal value's
  exponent and mantissa are moved into float64's fields, a denormal's mantissa is an
  integer converted exactly and multiplied by a power of two (``2^-149``, ``2^-24``).
  Widening preserves order, ``-0.0 == 0.0``, infinities and NaN, so every comparison in
  float64 gives the float32 comparison's answer.
- *Nearest centre*: the id is the number of midpoints strictly below the value, a count
  of comparisons; numpy counts with ``x > m`` per midpoint (or ``searchsorted``), the
  kernel with a binary search over the widened midpoints, and since they are strictly
  ascending both give the same integer. NaN compares false everywhere, and is rejected
  whatever its id.
- *Acceptance* is ``isfinite``, ``v == centre``, or, at a finite tolerance ``t``,
  numpy's float32 ``|v - centre| <= t``. The kernel subtracts in float64; by the
  double-rounding theorem (53 >= 2 * 24 + 2 bits) rounding that difference to float32 gives
  the correctly rounded float32 difference, and a float32 rounding of ``d`` is ``<= t``
  exactly when ``d`` is below the midpoint between ``t`` and the next float32, or on it
  with ``t``'s last mantissa bit even (ties to even). :func:`within_bound` computes that
  midpoint and the tie rule on the host; the kernel compares with it.
- *Rejected elements, rescue, protected words* are computed by the same numpy code on the
  host, from the same elements in the same (element) order.
- *Payload assembly, dequantization, vdelta*: integer copies, gathers, scatters, modular
  integer arithmetic and a stable sort, all exact.
- *Sketch keys* are ``ceil(log2(|x|) * scale)`` in float64 of the exactly widened value,
  the operations numpy performs. ``log2`` is not correctly rounded in either library
  (numpy's own SIMD and scalar loops may differ in the last place), so identity rests on a
  margin instead: for every float32 value (hence every float16 and bfloat16 value) other
  than 1.0, ``log2(|x|) * scale`` is at least ~200 times a four-ulp ``log2`` error away from
  the nearest integer at the default ``alpha``, and ``log2(1) = 0`` exactly in both;
  ``tests/test_codecs/test_xp_path.py`` checks every bucket boundary. float64 inputs carry
  no such guarantee: a value within a few ulps of a bucket boundary may land one bucket over
  (about one value in 10^11). The histogram itself is integer counting, exact in any order.

Covered by ``tests/test_gpu`` (parity with the host on random and trained-looking weights,
every element dtype, odd sizes, NaN, infinities and denormals), which skips without CuPy or
a device, and by the numpy emulations of these kernels in ``tests/test_codecs/test_xp_path.py``.
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
#: NVRTC options of every kernel: no FMA contraction. (``--ftz=false`` would be overridden:
#: CuPy appends ``-ftz=true``; the kernels avoid float32 operations instead, see above.)
OPTIONS = ("--fmad=false",)

#: device functions widening element bits to float64 with integer operations only, so that
#: flush-to-zero (on for every CuPy kernel) cannot touch a denormal; float64 has none to flush
WIDEN_PREAMBLE = """
__device__ __forceinline__ double inshrink_f32_bits_to_f64(unsigned int b) {
    const unsigned int e = (b >> 23) & 0xffu, m = b & 0x7fffffu;
    double mag;
    if (e == 0xffu) {
        mag = __longlong_as_double(m ? 0x7ff8000000000000LL : 0x7ff0000000000000LL);
    } else if (e == 0u) {  /* zero or denormal: m * 2^-149, exact in float64 */
        mag = (double)m * __longlong_as_double(0x36a0000000000000LL);
    } else {
        mag = __longlong_as_double(((long long)(e + 896u) << 52) | ((long long)m << 29));
    }
    return (b >> 31) ? -mag : mag;
}
__device__ __forceinline__ double inshrink_f16_bits_to_f64(unsigned short h) {
    const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    double mag;
    if (e == 0x1fu) {
        mag = __longlong_as_double(m ? 0x7ff8000000000000LL : 0x7ff0000000000000LL);
    } else if (e == 0u) {  /* zero or denormal: m * 2^-24 */
        mag = (double)m * __longlong_as_double(0x3e70000000000000LL);
    } else {
        mag = __longlong_as_double(((long long)(e + 1008u) << 52) | ((long long)m << 42));
    }
    return (h >> 15) ? -mag : mag;
}
"""

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

#: the bits each element dtype is read as on the device, and the expression widening them
_BITS: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.uint32), "float16": np.dtype(np.uint16), "bfloat16": np.dtype(np.uint16)}
_WIDEN = {
    "float32": "inshrink_f32_bits_to_f64(x)",
    "float16": "inshrink_f16_bits_to_f64(x)",
    "bfloat16": "inshrink_f32_bits_to_f64(((unsigned int)x) << 16)",
}
_CARRIER = {name: dtypes.by_codec_name(name).carrier for name in dtypes.CODEC_NAMES}
#: kernel expression of ``nuq.Quantizer._accept`` for each kind of tolerance (float64 values)
_ACCEPT = {
    "finite": "isfinite(v)",  # tolerance inf
    "equal": "v == centres[lo]",  # tolerance 0
    "within": "(fabs(v - centres[lo]) < bound) || (tie_ok && fabs(v - centres[lo]) == bound)",
}
_ASSIGN = """
const double v = {widen};
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
        f"{_BITS[element].name} x, raw float64 mids, raw float64 centres, int32 n_mids, "
        "float64 bound, bool tie_ok",
        "I level, bool ok",
        _ASSIGN.format(widen=_WIDEN[element], accept=_ACCEPT[mode]),
        name=f"inshrink_nuq_assign_{element}_{mode}",
        preamble=WIDEN_PREAMBLE,
        options=OPTIONS,
    )


def _mode(tol32: np.float32 | None) -> str:
    return "finite" if tol32 is None else "equal" if tol32 == 0 else "within"


def within_bound(tol32: np.float32) -> tuple[float, bool]:
    """``(bound, tie_ok)`` with: float32(d) <= tol32 exactly when d < bound, or d == bound
    and tie_ok, for every float64 ``d`` >= 0 (round to nearest, ties to even).

    ``bound`` is the midpoint between ``tol32`` and the next float32 up (past the largest
    float32, the point where rounding overflows to infinity); a tie rounds to whichever of
    the two has an even last mantissa bit, so it is accepted when ``tol32``'s is even."""
    t = np.float32(tol32)
    if not (np.isfinite(t) and t >= 0):
        raise FormatError(f"Expected a finite tolerance >= 0. Got {float(t)!r} instead.")
    with np.errstate(over="ignore"):
        following = np.nextafter(t, np.float32(np.inf))
    upper = float(following) if np.isfinite(following) else 2.0**128
    bound = (float(t) + upper) / 2  # exact: both are float32, one mantissa bit apart at most
    return bound, int(t.view(np.uint32)) & 1 == 0


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
        mode = _mode(tol32)
        bound, tie_ok = within_bound(tol32) if mode == "within" and tol32 is not None else (0.0, False)
        table = np.asarray(centres if centres is not None else mids, dtype=np.float32)
        _assign_kernel(element, mode)(
            flat.view(_BITS[element]), cp.asarray(np.asarray(mids, np.float32).astype(np.float64)),
            cp.asarray(table.astype(np.float64)), np.int32(mids.size), np.float64(bound),
            np.bool_(tie_ok), level, ok,
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
#: how the sketch reads each input dtype: float32 and float16 as bits, widened by integer
#: operations (a float32 conversion would flush denormals); float64 and integers as they are
_SKETCH_AS = {"float32": ("uint32", "inshrink_f32_bits_to_f64(x)"),
              "float16": ("uint16", "inshrink_f16_bits_to_f64(x)")}


@functools.cache
def _sketch_kernel(dtype: str) -> Any:
    cp = require_cupy()
    read_as, widen = _SKETCH_AS.get(dtype, (dtype, "(double)x"))
    return cp.ElementwiseKernel(
        f"{read_as} x, float64 scale", "int64 key, int8 cls", _SKETCH.format(widen=widen),
        name=f"inshrink_sketch_keys_{dtype}", preamble=WIDEN_PREAMBLE, options=OPTIONS,
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
        read_as = _SKETCH_AS.get(flat.dtype.name, (flat.dtype.name,))[0]
        _sketch_kernel(flat.dtype.name)(flat.view(read_as), float(scale), key, cls)
    zeros, pos, neg, bad = (int(c) for c in cp.bincount(cls.view(cp.uint8), minlength=4).get())
    if pos + neg == 0:
        return np.zeros(0, np.int64), 0, zeros, bad
    lo, hi = int(_key_bound("min")(key, cls)), int(_key_bound("max")(key, cls))
    span = hi - lo + 1
    bins = _bin_kernel()(key, cls, lo, span)
    counts = cp.bincount(bins, minlength=2 * span + 1)[: 2 * span].get().astype(np.int64)
    return counts, lo, zeros, bad
