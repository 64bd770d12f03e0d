"""Whole-store operations over the typed parts of a store: diff, verify, gc and du.
Layer: admin, below the facade (which delegates to it) and above the write session.

``Repository`` delegates to these; each module owns one operation and its report.
"""

from inshrink_store.admin.diff import DiffReport, TensorChange, diff
from inshrink_store.admin.du import (
    DuSummary,
    UsageRow,
    du,
    du_summary,
    stored_bytes,
    usage_document,
)
from inshrink_store.admin.gc import GarbageCollector, GcOptions, GcReport, gc
from inshrink_store.admin.reachability import Reachable, reachable
from inshrink_store.admin.verify import Problem, VerifyReport, verify

__all__ = [
    "DiffReport", "DuSummary", "GarbageCollector", "GcOptions", "GcReport", "Problem", "Reachable", "TensorChange", "UsageRow",
    "VerifyReport", "diff", "du", "du_summary", "gc", "reachable", "stored_bytes", "usage_document", "verify",
]
