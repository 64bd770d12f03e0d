"""torch layer: the Checkpointer's keywords, checked once, and what they resolve to.

:class:`CheckpointerOptions` holds every keyword of ``Checkpointer(...)`` but the repository,
the model and the optimizer. Making one checks them all, in the order the Checkpointer always
checked them (so a call with two mistakes still gets the same first error), with the
messages users and tests match; it then resolves what they describe: the
:class:`~inshrink_store.policy.SearchPolicy` (``policy=`` or the 0.1 keywords), the
:class:`~inshrink_store.torch.Retention` (``retention=`` or ``max_to_keep=`` /
``keep_every_n_steps=``) and the ``extra_state`` entries.

Why a module of its own: the checks took some 60 lines of ``Checkpointer.__init__`` and are
none of the Checkpointer's job (copying state off the training loop, saving it in the
background, restoring it); here they read as one list, next to the warning a lossy default
earns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from inshrink_store.errors import FormatError, InvalidInputError
from inshrink_store.policy import MomentPolicy, SearchPolicy
from inshrink_store.repository import MAX_KEEP_NEWEST
from inshrink_store.torch.extra_state import check_stateful
from inshrink_store.torch.retention import Retention
from inshrink_store.torch.tensors import torch

if TYPE_CHECKING:
    import torch as _torch

__all__ = ["ON_BUSY", "CheckpointerOptions", "OnBusy"]

#: what ``save`` does while the previous background save is still running
OnBusy = Literal["wait", "skip"]
ON_BUSY: tuple[OnBusy, ...] = ("wait", "skip")


#: ``probe=``: a batch the model takes, a tensor, a tuple or list (``model(*probe)``) or a
#: dict (``model(**probe)``); what is inside the tuple or dict is the model's business
Probe: TypeAlias = "_torch.Tensor | tuple[Any, ...] | list[Any] | Mapping[str, Any]"

@dataclass(frozen=True, eq=False)
class CheckpointerOptions:
    """The keywords of ``Checkpointer(repo, model, optimizer, ...)`` as given (see
    :class:`~inshrink_store.torch.Checkpointer` for each), checked when made.

    A bad keyword raises what the Checkpointer raises: a FormatError for ``every`` and for
    ``policy=`` beside the 0.1 keywords (``legacy``: ``tolerance``, ``higher_is_better``,
    ``space``, ``optimizer_policy``, and any misspelling of them, which the policy refuses
    with a TypeError), an InvalidInputError for the rest. The ``resolved_*`` fields are what
    the keywords describe, filled in once they pass.
    """

    eval_fn: Callable[[Any], float] | None = None
    every: int | None = None
    policy: SearchPolicy | None = None
    legacy: Mapping[str, Any] = field(default_factory=dict)
    ema_batches: int = 50
    branch: str = "main"
    background: bool = True
    gc_wait: float = 600.0
    lossless: bool = False
    retention: Retention | None = None
    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    extra_state: Mapping[str, Any] | None = None
    exact_resume: int = 1
    closed_loop: bool = True
    probe: Probe | None = None
    on_busy: OnBusy = "wait"
    #: ``retention=``, or the Retention ``max_to_keep=`` / ``keep_every_n_steps=`` make (None: no retention)
    resolved_retention: Retention | None = field(init=False)
    #: ``extra_state`` as a dict, every entry checked to give and take its state
    resolved_extra_state: dict[str, Any] = field(init=False)
    #: ``policy=``, or the policy the 0.1 keywords build
    resolved_policy: SearchPolicy = field(init=False)

    def __post_init__(self) -> None:
        self._check_search()
        self._check_versions()
        self._check_on_busy()
        # frozen: the resolved fields are set once, here
        object.__setattr__(self, "resolved_retention",
                           _retention(self.retention, self.max_to_keep, self.keep_every_n_steps))
        extra_state = dict(self.extra_state or {})
        for name, obj in extra_state.items():
            check_stateful(name, obj)
        object.__setattr__(self, "resolved_extra_state", extra_state)
        object.__setattr__(self, "resolved_policy",
                           self.policy if self.policy is not None else SearchPolicy.from_args(**self.legacy))

    def _check_search(self) -> None:
        """``every``, and how the search is asked for: ``policy=`` or the 0.1 keywords, or
        ``lossless=True`` alone."""
        every, policy, legacy, lossless = self.every, self.policy, self.legacy, self.lossless
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise FormatError(
                f"Expected every to be an int (steps between saves) or None. Got {every!r} instead; "
                f"tolerance is keyword-only: pass tolerance={every!r} or policy=SearchPolicy(...)."
            )
        if policy is not None and legacy:
            raise FormatError(
                f"Expected either policy= or the keywords {sorted(legacy)}. Got both instead; "
                "set those fields on the SearchPolicy."
            )
        if not isinstance(lossless, bool):
            raise InvalidInputError(f"Expected lossless to be True or False. Got {lossless!r} instead.")
        if lossless and (policy is not None or legacy or self.eval_fn is not None):
            given = [name for name, on in (("eval_fn", self.eval_fn is not None), ("policy", policy is not None))
                     if on] + sorted(legacy)
            raise InvalidInputError(
                f"Expected lossless=True alone: it stores every tensor bit-exact, with no search. Got "
                f"{', '.join(given)} as well instead; drop lossless=True to quantize, or drop {given[0]}."
            )

    def _check_versions(self) -> None:
        """What each version carries beyond the state: restore residuals, closed-loop
        coding, the probe check."""
        exact_resume, closed_loop, probe = self.exact_resume, self.closed_loop, self.probe
        if type(exact_resume) is not int or not 0 <= exact_resume <= MAX_KEEP_NEWEST:
            raise InvalidInputError(
                f"Expected exact_resume to be an int in 0..{MAX_KEEP_NEWEST} (the newest versions that resume "
                f"bit-exact; 0 turns it off). Got {exact_resume!r} instead.")
        if not isinstance(closed_loop, bool):
            raise InvalidInputError(f"Expected closed_loop to be True or False. Got {closed_loop!r} instead.")
        if probe is not None and not (torch.is_tensor(probe) or isinstance(probe, (tuple, list, Mapping))):
            raise InvalidInputError(
                f"Expected probe to be a batch the model takes: a tensor, a tuple of them (model(*probe)) or a "
                f"dict (model(**probe)). Got {type(probe).__name__} instead.")

    def _check_on_busy(self) -> None:
        """``on_busy``: one of :data:`ON_BUSY`; ``"skip"`` only where there is a background save
        to be busy with."""
        if not isinstance(self.on_busy, str) or self.on_busy not in ON_BUSY:
            raise InvalidInputError(
                f"Expected on_busy to be 'wait' (save queues behind the previous background save, or waits for it "
                f"to commit) or "
                f"'skip' (save skips this checkpoint while one is running). Got {self.on_busy!r} instead.")
        if self.on_busy == "skip" and not self.background:
            raise InvalidInputError(
                "Expected background=True with on_busy='skip'. Got background=False instead: a save that "
                "commits in the loop's thread is never running when the next one starts, so there is nothing "
                "to skip; drop on_busy, or leave background at its default (True).")

    def lossy_warning(self) -> str | None:
        """The warning a Checkpointer without ``eval_fn`` gives (its weights are stored lossy,
        unchecked), or None: with ``eval_fn`` or ``lossless=True`` there is nothing to warn of."""
        if self.eval_fn is not None or self.lossless:
            return None
        return _lossy_warning(self.resolved_policy)


def _retention(retention: Retention | None, max_to_keep: int | None,
               keep_every_n_steps: int | None) -> Retention | None:
    if retention is not None:
        if max_to_keep is not None or keep_every_n_steps is not None:
            raise InvalidInputError(
                "Expected either retention=Retention(...) or max_to_keep=/keep_every_n_steps=. Got both "
                "instead; set those fields on the Retention.")
        if not isinstance(retention, Retention):
            raise InvalidInputError(
                f"Expected retention to be a Retention. Got {type(retention).__name__} instead; e.g. "
                "retention=Retention(max_to_keep=3, keep_every_n_steps=1000).")
        return retention
    if max_to_keep is None:
        if keep_every_n_steps is not None:
            raise InvalidInputError(
                f"Expected max_to_keep with keep_every_n_steps={keep_every_n_steps!r}. Got none instead; "
                "without it nothing is ever collected: pass max_to_keep=N as well.")
        return None
    return Retention(max_to_keep, keep_every_n_steps)


def _lossy_warning(policy: SearchPolicy) -> str:
    base = policy.base
    pruning = "no pruning" if base.prune == 0 else f"{base.prune:.0%} pruned by {base.prune_metric}"
    optimizer = ("optimizer state lossless" if policy.optimizer is None else
                 "Adam moments compressed, each tensor checked by the update it drives" if
                 isinstance(policy.optimizer, MomentPolicy) else
                 "optimizer state quantized by the policy's optimizer planner")
    return ("Checkpointer has no eval_fn: model weights are stored lossy, quantized with the policy's "
            f"base configuration ({base.bins} levels, {pruning}, {base.protect:.1%} protected; unchecked "
            f"for your model); {optimizer}; step counters and scalars exact. Pass eval_fn= to let the "
            "search pick the most aggressive configuration within tolerance, or lossless=True to store "
            "every tensor bit-exact.")
