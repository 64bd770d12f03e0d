"""Object coder 4's body (codecs/closed_loop): a quantized residual, added to the base's floats."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import closed_loop
from inshrink_store.codecs.nuq import quantizer
from inshrink_store.errors import FormatError


def _coded(values: np.ndarray, centres: np.ndarray, protected_dtype: str = "float32") -> tuple[bytes, np.ndarray]:
    """(body, the residual it holds) for ``values`` snapped as the planner snaps them."""
    q = quantizer(tuple(float(c) for c in centres), 0.5, protected_dtype, "float32")
    snapped = np.asarray(q.decode(q.encode(values)), np.float32)  # nearest centre or protected
    exact = quantizer(tuple(float(c) for c in centres), 0.0, protected_dtype, "float32")
    return closed_loop.encode(exact.encode(snapped), np.asarray(exact.centres, np.float32)), snapped


@st.composite
def residuals(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    levels = draw(st.integers(1, 40))
    rng = np.random.default_rng(seed)
    skew = draw(st.sampled_from(["normal", "mostly-zero", "heavy"]))
    values = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.uniform(-6, 1))
    if skew == "mostly-zero":
        values[rng.random(n) < 0.97] = 0
    elif skew == "heavy":
        values *= rng.pareto(1.5, n).astype(np.float32)
    centres = np.unique(np.quantile(values, np.linspace(0, 1, levels)).astype(np.float32))
    base = (rng.standard_normal(n) * 0.05).astype(np.float32)
    return values, centres, base


@settings(max_examples=60, deadline=None)
@given(residuals())
def test_a_body_decodes_to_its_residual_alone_or_added_to_the_base(case: tuple[np.ndarray, ...]) -> None:
    values, centres, base = case
    body, snapped = _coded(values, centres)
    keyframe = closed_loop.decode(body, 4 * values.size, None)
    assert keyframe == snapped.tobytes()
    delta = closed_loop.decode(body, 4 * values.size, base.tobytes())
    assert delta == (base + snapped).tobytes()  # one float32 addition per element
    assert closed_loop.encode(*_payload_and_centres(values, centres)) == body  # same input, same bytes


def _payload_and_centres(values: np.ndarray, centres: np.ndarray) -> tuple[bytes, np.ndarray]:
    q = quantizer(tuple(float(c) for c in centres), 0.5, "float32", "float32")
    snapped = np.asarray(q.decode(q.encode(values)), np.float32)
    exact = quantizer(tuple(float(c) for c in centres), 0.0, "float32", "float32")
    return exact.encode(snapped), np.asarray(exact.centres, np.float32)


def test_few_levels_are_packed_two_ids_per_byte_when_smaller() -> None:
    rng = np.random.default_rng(3)
    values = rng.choice(np.array([-1, 0, 1], np.float32), 50_000)
    body, _ = _coded(values, np.array([-1, 0, 1], np.float32))
    inner, centres, _stream = closed_loop.parse(body)
    assert inner == closed_loop.INNER_PACKED and list(centres) == [-1, 0, 1]


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda b: b[:5], "at least 12"),
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "inner coder"),
    (lambda b: b[:5] + bytes([1]) + b[6:], "element"),
    (lambda b: b[:8] + (70000).to_bytes(4, "little") + b[12:], "centres"),
    (lambda b: b[:12] + np.array([1.0, 0.0], "<f4").tobytes() + b[20:], "ascending"),
    (lambda b: b[:-3], "zstd|frame|truncated|Expected"),
])
def test_a_malformed_body_is_a_format_error_naming_what_is_wrong(mutate, match) -> None:  # type: ignore[no-untyped-def]
    values = np.linspace(-1, 1, 1000, dtype=np.float32)
    body, _ = _coded(values, np.array([-1, -0.5, 0, 0.5, 1], np.float32))
    with pytest.raises(FormatError, match=match):
        closed_loop.decode(mutate(body), 4 * values.size, None)


def test_a_body_for_another_size_or_base_is_refused() -> None:
    values = np.linspace(-1, 1, 100, dtype=np.float32)
    body, _ = _coded(values, np.array([-1, 0, 1], np.float32))
    with pytest.raises(FormatError, match="100 elements|elements"):
        closed_loop.decode(body, 4 * 99, None)
    with pytest.raises(FormatError, match="base payload"):
        closed_loop.decode(body, 4 * 100, np.zeros(99, np.float32).tobytes())
    with pytest.raises(FormatError, match="multiple of 4"):
        closed_loop.decode(body, 401, None)


def test_encode_refuses_a_payload_of_other_centres() -> None:
    values = np.linspace(-1, 1, 100, dtype=np.float32)
    payload, centres = _payload_and_centres(values, np.array([-1, 0, 1], np.float32))
    with pytest.raises(FormatError, match="levels"):
        closed_loop.encode(payload, centres[:2])
