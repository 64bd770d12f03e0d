"""QuantizationRecord: what a version's ``metadata["quantization"]`` says, as a typed value.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The Checkpointer writes one per version; ``restore`` continues the search from its
configuration, and ``inshrink log`` and the demo report it. Reading goes through
:meth:`QuantizationRecord.from_dict`, which checks every field (metadata is user-visible
JSON that anything may have written) and names the field that is wrong. The layout is
versioned: ``version`` 1 is the layout the Checkpointer has always written (2 adds
``allocation``, and is written only by a version stored with one), so a record
without the field (written before it existed) reads as version 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any, TypeVar

from inshrink_store.errors import FormatError
from inshrink_store.policy.allocation import Allocation, AllocationTrial
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.search import SearchResult

VERSION = 2  # 2 added ``allocation``; a record without one is still written as version 1
_FIELDS = ("version", "config", "baseline_quality", "tolerance", "higher_is_better", "search",
           "model_ratio_estimate", "allocation", "allocation_search")
_REQUIRED = ("config", "tolerance", "higher_is_better")  # the rest were None when absent
T = TypeVar("T")


@dataclass(frozen=True)
class QuantizationRecord:
    """How one version was quantized and why.

    ``config``: the configuration of the model tensors (None: stored lossless, e.g. because
    nothing was within tolerance). ``baseline_quality``: ``eval_fn`` on the unquantized model
    (None without one). ``tolerance`` / ``higher_is_better``: the acceptance rule.
    ``search``: every trial and the mode (None when nothing was searched).
    ``model_ratio_estimate``: the chosen configuration's model ratio as a keyframe (None:
    lossless): estimated from a sample of each tensor (:mod:`inshrink_store.policy.estimate`; versions
    written before the estimate existed hold one measured by encoding); what was really
    stored, deltas included, is in ``du``.
    ``allocation``: the per-tensor allocation the model tensors were stored with (then
    ``config`` is None; each tensor's levels are in its array's codec).
    ``allocation_search``: the target ratios a search over allocations tried, in order
    (None when no such search ran).
    """

    config: QuantConfig | None
    tolerance: float
    higher_is_better: bool
    baseline_quality: float | None = None
    search: SearchResult | None = None
    model_ratio_estimate: float | None = None
    allocation: Allocation | None = None
    allocation_search: tuple[AllocationTrial, ...] | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        if self.allocation_search is not None:
            object.__setattr__(self, "allocation_search", tuple(self.allocation_search))
        if self.version is None:  # the oldest layout that holds every field set
            newer = self.allocation is not None or self.allocation_search is not None
            object.__setattr__(self, "version", 2 if newer else 1)

    @property
    def lossy(self) -> bool:
        """Whether the model tensors were stored quantized (a configuration or an allocation)."""
        return self.config is not None or self.allocation is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-native; version 1's layout, plus ``allocation`` / ``allocation_search`` when
        there are (version 2)."""
        data: dict[str, Any] = {
            "version": self.version,
            "config": None if self.config is None else self.config.to_dict(),
            "baseline_quality": self.baseline_quality, "tolerance": self.tolerance,
            "higher_is_better": self.higher_is_better,
            "search": None if self.search is None else self.search.to_dict(),
            "model_ratio_estimate": self.model_ratio_estimate,
        }
        if self.allocation is not None:
            data["allocation"] = self.allocation.to_dict()
        if self.allocation_search is not None:
            data["allocation_search"] = [t.to_dict() for t in self.allocation_search]
        return data

    @classmethod
    def from_dict(cls, data: object) -> QuantizationRecord:
        """Read a record (any version up to :data:`VERSION`, or none given: 1).

        A FormatError names the first field that is missing, unknown or of the wrong kind."""
        if not isinstance(data, Mapping):
            raise FormatError(
                f"Expected metadata['quantization'] to be a dict. Got {type(data).__name__} instead; "
                "it was not written by a Checkpointer."
            )
        unknown = sorted(str(k) for k in data if k not in _FIELDS)
        if unknown:
            raise FormatError(
                f"Expected only the quantization record fields {list(_FIELDS)}. Got unknown {unknown} "
                "instead; remove them."
            )
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise FormatError(f"Expected the quantization record field {missing[0]!r}. Got none instead.")
        version = data.get("version", 1)
        if not _is_int(version) or not 1 <= version <= VERSION:
            raise FormatError(
                f"Expected quantization record field 'version' to be an int in 1..{VERSION}. Got "
                f"{version!r} instead; a newer version is written by a newer inshrink-store: upgrade."
            )
        return cls(
            config=_read("config", data.get("config"), QuantConfig.from_dict),
            tolerance=_number("tolerance", data["tolerance"]),
            higher_is_better=_flag("higher_is_better", data["higher_is_better"]),
            baseline_quality=_optional_number("baseline_quality", data.get("baseline_quality")),
            search=_read("search", data.get("search"), SearchResult.from_dict),
            model_ratio_estimate=_optional_number("model_ratio_estimate", data.get("model_ratio_estimate")),
            allocation=_read("allocation", data.get("allocation"), Allocation.from_dict),
            allocation_search=_trials(data.get("allocation_search")),
            version=int(version),
        )


def _trials(data: Any) -> tuple[AllocationTrial, ...] | None:
    """The ``allocation_search`` field: None, or a list of trials (errors name the field)."""
    if data is None:
        return None
    if not isinstance(data, list):
        raise _bad("allocation_search", "a list of trials or null", data)
    try:
        return tuple(AllocationTrial.from_dict(t) for t in data)
    except FormatError as exc:
        raise FormatError(f"Expected quantization record field 'allocation_search' to hold trials. {exc}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(name: str, what: str, got: Any) -> FormatError:
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:80] + "..."
    return FormatError(f"Expected quantization record field {name!r} to be {what}. Got {shown} instead.")


def _number(name: str, value: Any) -> float:
    # NaN is a number a quality may be (metadata keeps it faithfully); bool is not a number
    if not isinstance(value, Real) or isinstance(value, bool):
        raise _bad(name, "a number", value)
    return float(value)


def _optional_number(name: str, value: Any) -> float | None:
    return None if value is None else _number(name, value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _read(name: str, value: Any, parse: Callable[[Mapping[str, Any]], T]) -> T | None:
    """None, or ``parse(value)`` of a dict; anything the parser rejects names ``name``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad(name, "a dict or null", value)
    try:
        return parse(value)
    except (FormatError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(
            f"Expected quantization record field {name!r} to be a {name} dict as to_dict() writes it. "
            f"Got one that does not read ({type(exc).__name__}: {str(exc)[:120]}) instead."
        ) from None


