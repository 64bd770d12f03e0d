"""Hugging Face ``Trainer`` integration: every save of a Trainer is a version of a store.
Layer: Hugging Face, below Lightning and the CLI, above ``torch`` (it drives the Checkpointer).

:class:`InshrinkCallback` is a ``transformers.TrainerCallback``. At each of the Trainer's
save events (``on_save``: ``save_strategy`` and ``save_steps`` decide when) it commits one
version through a :class:`~inshrink_store.torch.Checkpointer` made for the Trainer's own
model and optimizer:

- ``model/`` and ``optimizer/``: the state dicts (compressed or lossless, as the
  Checkpointer's options say);
- ``extra/scheduler`` and ``extra/rng``: the LR scheduler's state and the RNG states
  (:class:`~inshrink_store.torch.RNGState`), as tensors and JSON scalars;
- ``extra/trainer_state``: the ``TrainerState`` (global step, epoch, log history, best
  metric, stateful callbacks) as the JSON text HF writes to ``trainer_state.json``;
- ``extra/hf_config``: the model's ``config.json`` text, as ``save_pretrained`` writes it
  (:func:`~inshrink_store.torch.config_json`), so that ``inshrink export --format hf`` makes
  a folder ``from_pretrained`` loads without being told the architecture;
- the version's step is the global step, its metrics the numbers logged at that step.

Nothing is pickled, and reading a version never unpickles anything.

**Resuming** is ``trainer.train(resume_from_checkpoint=callback.resume_path())``. Why this
shape: the Trainer decides where a resumed run starts (the epoch, the batches to skip, the
global step) from a checkpoint *folder*, before any callback runs, in local variables of its
loop; a callback restoring state in ``on_train_begin`` alone would train the skipped
batches again. Exporting a whole HF checkpoint folder from the store would write
``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth``: pickles, and a second copy of the
largest part of the state. So :meth:`InshrinkCallback.resume_path` writes a minimal folder,
``trainer_state.json`` (from the version) and ``model.safetensors`` (the Trainer requires a
weights file), and arms the callback. The Trainer fast-forwards its loop from that folder
and, finding no optimizer, scheduler or RNG file there, leaves them to the callback, which
restores them from the store: model, optimizer and scheduler in ``on_train_begin`` (through
``Checkpointer.restore``, so the next versions are children of the resumed one), and the
RNG states at the very point where the Trainer would have loaded its ``rng_state.pth`` (the
first ``on_epoch_begin`` for a version saved at the end of an epoch, else the first
``on_step_begin``, once the batches to skip are drawn). The folder is deleted as soon as
the Trainer has read it. ``resume_path()`` returns None while the branch has no version,
so one script serves the first start and every restart. ``train(resume_from_checkpoint=True)``
works too: the callback, made with the Trainer (``on_init_end``), writes the same folder for
the branch's newest version as ``output_dir/checkpoint-N``, where the Trainer looks for its
newest checkpoint (and, like the Trainer, a run with no version to resume from raises); the
folder goes when ``train()`` starts, read or not.

**What a resume gives back.** With ``lossless=True``, and with the default compressed
mode resuming from the branch's newest version (its restore residual, ``exact_resume=1``),
the model, optimizer, scheduler and RNG states come back bit-exact: the resumed run is the
uninterrupted run, loss for loss and weight for weight, wherever the Trainer's own resume
is (a data collator drawing random numbers as batches are fetched, MLM masking for one,
draws them before the RNG states are restored, in HF's resume as in this one). Resuming a
compressed store from an older version loads its stored values (quantized weights within
the policy's tolerance, moments checked by the update they drive): training goes on from
there, close to but not bit-identical with the uninterrupted run.

**The Trainer's own folders.** The callback takes the Trainer's saves: when the Trainer's
``DefaultFlowCallback`` sets ``control.should_save`` (``on_step_end``, ``on_epoch_end``),
the callback clears it, so the Trainer writes no ``checkpoint-N`` folder, and saves the
version where the Trainer's ``_save_checkpoint`` would have: after that step's log
(``on_log``) and evaluation (``on_evaluate``), with the ``TrainerControl`` state put into
the stateful callbacks as the Trainer does, so the version's ``trainer_state.json`` is the
one the Trainer writes. Other callbacks' ``on_save`` is not called for those saves. Where
the Trainer needs its folders, the callback leaves the saves to it (each is still a version,
in ``on_save``) and ``on_init_end`` (or ``on_train_begin``) warns why: best-model tracking
(``load_best_model_at_end``, ``save_strategy="best"``, ``metric_for_best_model``, whose best
metric the Trainer updates after ``on_evaluate``), ``push_to_hub`` (it uploads the folders),
and stateful callbacks other than the ``TrainerControl`` (their state is stored by the
Trainer, out of a callback's reach). ``total_flos`` in a version is as of the step's log.

Single process only: a distributed Trainer (``world_size > 1``) is refused; use
:class:`~inshrink_store.torch.DistributedCheckpointer` there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Mapping
from numbers import Real
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from inshrink_store.errors import InvalidInputError, NotFoundError, require
from inshrink_store.repository import open as open_repository
from inshrink_store.torch import Checkpointer, RNGState, config_json, load_state, save_safetensors
from inshrink_store.torch.checkpointer_options import CheckpointerOptions

transformers = require("transformers", "hf")
require("accelerate", "hf")  # the Trainer's own dependency: refused without it, name our extra
if TYPE_CHECKING:
    from transformers import TrainerCallback as _TrainerCallback
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from inshrink_store.repository import Repository
else:
    _TrainerCallback = transformers.TrainerCallback

log = logging.getLogger(__name__)

__all__ = ["TRAINER_STATE", "InshrinkCallback"]

#: where a version keeps the Trainer's state (the JSON text of ``trainer_state.json``)
TRAINER_STATE = "extra/trainer_state"
_RESERVED = ("scheduler", "rng", "trainer_state", "hf_config")
_CONTROL = "TrainerControl"   # its state is one of the Trainer's stateful callbacks
_CHECKPOINT_PREFIX = "checkpoint-"   # the Trainer's folders: output_dir/checkpoint-<global step>
_POLICY_KEYWORDS = ("tolerance", "higher_is_better", "space", "optimizer_policy")


class InshrinkCallback(_TrainerCallback):
    """Saves each of the Trainer's checkpoints as a version of the store at ``url``.

    ``url``: a path, ``memory://``, ``s3://`` or ``gs://`` URL (created if nothing is there),
    or an open :class:`~inshrink_store.Repository`. ``options`` are the
    :class:`~inshrink_store.torch.Checkpointer`'s keywords (``lossless=True``, ``eval_fn=``,
    ``policy=``, ``max_to_keep=``, ``branch=``, ``exact_resume=``, ``background=``,
    ``on_busy=``, ...; with ``on_busy="skip"`` a save of the Trainer's that comes while the
    previous one still runs is skipped, but the last save of ``train()`` is always taken),
    checked here, at construction, rather than when training starts. ``every`` defaults to
    the Trainer's ``save_steps`` with ``save_strategy="steps"``, so the gradient EMA that
    guides a compressed save's search runs only over the batches before each save (with
    another strategy there is no EMA, and pruning goes by magnitude, unless ``every=`` is given).
    ``extra_state`` adds objects of your own to every version; ``scheduler``, ``rng``,
    ``trainer_state`` and ``hf_config`` are the callback's names.

    See the module docstring for how a resume works and what it gives back."""

    def __init__(self, url: str | os.PathLike[str] | Repository, **options: Any) -> None:
        _check_options(options)
        self.repo: Repository = (url if _is_repository(url) else
                                 open_repository(os.fspath(cast("str | os.PathLike[str]", url)), create=True))
        self.options = options
        self.branch: str = options.get("branch", "main")
        #: the Checkpointer of the current ``train()`` call (None before the first one)
        self.checkpointer: Checkpointer | None = None
        self._resume: _Resume | None = None
        self._rng: Mapping[str, Any] | None = None  # RNG states still to restore
        self._rng_at_epoch = False
        #: why the Trainer keeps its own saves and folders (None: the callback takes them)
        self._trainer_saves: str | None = None
        self._due: str | None = None   # a save taken from the Trainer, made at this event ("log", "evaluate")

    # -- resuming ------------------------------------------------------------------------
    def resume_path(self, ref: str | None = None, *, tmp_dir: str | None = None) -> str | None:
        """A folder to pass as ``trainer.train(resume_from_checkpoint=...)``: the version's
        ``trainer_state.json`` and ``model.safetensors``, in a new temporary folder (under
        ``tmp_dir`` if given) that the callback deletes once the Trainer has read it; the
        rest of the state comes from the store (module docstring). ``ref``: a branch, tag,
        snapshot id or ``"main~2"``; None is the head of the callback's branch, and then a
        branch without versions returns None (a fresh start). A save of this callback still
        in flight is committed first, so the head is the newest version. For the head,
        ``train(resume_from_checkpoint=True)`` does the same (:meth:`on_init_end`)."""
        self.close()
        snapshot_id = self._resolve(ref)
        if snapshot_id is None:
            return None
        return self._arm(snapshot_id, lambda step: tempfile.mkdtemp(prefix="inshrink-resume-", dir=tmp_dir),
                         auto=False)

    def _arm(self, snapshot_id: str, make_folder: Callable[[int | None], str], *, auto: bool) -> str:
        """Write the resume folder of ``snapshot_id`` (``make_folder(step)`` makes it) and
        arm the callback with it; an earlier armed folder goes."""
        trainer_state = _trainer_state_json(self.repo, snapshot_id)
        step = json.loads(trainer_state).get("global_step")
        folder = make_folder(step)
        try:
            with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
                f.write(trainer_state)
            weights = load_state(self.repo, snapshot_id, prefix="model")
            save_safetensors(_untied(weights), os.path.join(folder, "model.safetensors"))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._drop_folder()
        # a folder the Trainer never reads goes when the callback does (or at exit)
        self._resume = _Resume(snapshot_id, folder, step, auto,
                               weakref.finalize(self, shutil.rmtree, folder, True))
        log.info("resume from %s (step %s) through %s", snapshot_id[:12], step, folder)
        return folder

    def _resolve(self, ref: str | None) -> str | None:
        if ref is not None:
            return str(self.repo.resolve(ref))
        head = self.repo.branches().get(self.branch)
        return None if head is None else str(head)

    # -- the Trainer's events --------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Made with the Trainer (``callbacks=[callback]``): check whether the callback can take
        the Trainer's saves (a warning says why not: :meth:`on_step_end`), and put the newest version where
        ``train(resume_from_checkpoint=True)`` looks, a ``checkpoint-N`` folder in
        ``output_dir`` (N its global step), unless :meth:`resume_path` armed the callback
        already or a folder of that name is there (the Trainer's own: it resumes from that).
        The folder goes when ``train()`` starts, read or not (a ``train()`` without
        ``resume_from_checkpoint`` starts afresh, as the Trainer's does)."""
        self._trainer_saves = _why_the_trainer_saves(args)
        if self._trainer_saves is not None:
            _warn_trainer_saves(args, self._trainer_saves)
        if self._resume is not None:
            return
        head = self._resolve(None)
        if head is None:
            return

        def make_folder(step: int | None) -> str:
            # the Trainer sets output_dir in __post_init__ when it is not given
            folder = os.path.join(cast(str, args.output_dir), f"{_CHECKPOINT_PREFIX}{step}")
            if step is None or os.path.lexists(folder):
                raise FileExistsError(folder)
            os.makedirs(folder)
            return folder

        try:
            self._arm(head, make_folder, auto=True)
        except (NotFoundError, FileExistsError) as exc:   # not the callback's version, or a folder there
            log.info("no resume folder for resume_from_checkpoint=True: %s", exc)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Make this run's Checkpointer; when armed by :meth:`resume_path`, restore model,
        optimizer and scheduler now and keep the RNG states for the Trainer's RNG point."""
        _single_process(args)
        self.close()
        self._due = None
        if self._trainer_saves is None:   # also when added after the Trainer was made
            self._trainer_saves = _why_the_trainer_saves(args, state)
            if self._trainer_saves is not None:
                _warn_trainer_saves(args, self._trainer_saves)
        resume, self._resume = self._resume, None
        if resume is not None and resume.auto and state.global_step != resume.step:
            # on_init_end's folder, not read: train() started afresh (or from another folder)
            resume.cleanup()
            resume = None
        if resume is None:
            self.checkpointer = self._checkpointer(args, state, kwargs)
            return
        try:
            _check_resumed(state, resume)
            self.checkpointer = self._checkpointer(args, state, kwargs)
            self.checkpointer.restore(resume.snapshot_id)
        finally:
            resume.cleanup()
        self._rng = self.checkpointer.extra["rng"]
        # the Trainer loads its RNG file before drawing an epoch's order when it resumes at
        # an epoch boundary (or skips no data), and after drawing the batches to skip otherwise
        epoch = float(state.epoch or 0.0)
        self._rng_at_epoch = bool(args.ignore_data_skip) or epoch.is_integer()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._late_save(state, control)
        if self._rng_at_epoch:
            self._restore_rng()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._late_save(state, control)
        self._restore_rng()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Take the save the Trainer is about to make (``control.should_save``, set by its
        ``DefaultFlowCallback``, which runs first): the Trainer writes no ``checkpoint-N``
        folder, and the callback saves the version at the point the Trainer would have saved,
        after this step's log (:meth:`on_log`) and evaluation (:meth:`on_evaluate`), so the
        version carries their numbers. Not when best-model tracking or ``push_to_hub`` needs
        the Trainer's folders (:meth:`on_init_end` warned): then :meth:`on_save` saves."""
        self._take_save(state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._take_save(state, control)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._due == "log":
            self._save_taken(state, control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._due == "evaluate":
            self._save_taken(state, control)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Feed the gradient EMA of a compressed store's search (a no-op when lossless)."""
        if self.checkpointer is not None and self.checkpointer.every:
            self.checkpointer.observe_gradients()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """One version per save the Trainer made itself (committed in the background by default)."""
        self._save(state)

    def _take_save(self, state: Any, control: Any) -> None:
        self._late_save(state, control)
        if not control.should_save or self._trainer_saves is not None:
            return
        control.should_save = False   # the Trainer writes no folder; the callback saves
        if control.should_evaluate:
            self._due = "evaluate"
        elif control.should_log and not _logged(state):
            self._due = "log"
        else:
            self._save_taken(state, control)

    def _save_taken(self, state: Any, control: Any) -> None:
        """The save the Trainer's ``_save_checkpoint`` would have made: the state of its
        ``TrainerControl`` goes into the stateful callbacks first, as the Trainer does."""
        self._due = None
        control_state = control.state()
        control_state["args"]["should_save"] = True   # as when the Trainer saves
        stored = state.stateful_callbacks.get(_CONTROL)
        if isinstance(stored, list):
            stored.append(control_state)
        else:
            state.stateful_callbacks[_CONTROL] = control_state
        self._save(state)

    def _late_save(self, state: Any, control: Any) -> None:
        """A taken save whose log or evaluation never came (another callback changed the
        control after this one): saved now rather than lost."""
        if self._due is not None:
            log.warning("InshrinkCallback: the save of step %s expected a %s that did not come; saving now",
                        state.global_step, self._due)
            self._save_taken(state, control)

    def _save(self, state: Any) -> None:
        if self.checkpointer is None:
            raise InvalidInputError(
                "Expected on_train_begin before on_save. Got a save outside trainer.train() instead; "
                "add the callback to the Trainer (callbacks=[callback]) rather than calling it by hand.")
        trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        extra = {"trainer_state": trainer_state}
        if callable(getattr(getattr(self.checkpointer.model, "config", None), "to_json_string", None)):
            extra["hf_config"] = config_json(self.checkpointer.model)   # for export --format hf
        if state.max_steps and state.global_step >= state.max_steps:
            self.checkpointer.wait()  # the run's last save is taken even with on_busy="skip"
        self.checkpointer.save(state.global_step, metrics=_metrics(state), extra=extra)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Wait for the last save: ``train()`` returns with every version committed."""
        self._late_save(state, control)
        self.close()

    def close(self) -> None:
        """Wait for the save in flight and stop the Checkpointer's threads; call it after a
        ``train()`` that raised, when the process goes on. Idempotent."""
        self._rng = None
        if self.checkpointer is not None:
            self.checkpointer.close()

    # -- helpers ---------------------------------------------------------------------------
    def _checkpointer(self, args: Any, state: Any, objects: Mapping[str, Any]) -> Checkpointer:
        options = dict(self.options)
        extra_state = dict(options.pop("extra_state", None) or {})
        extra_state["rng"] = RNGState()
        if objects.get("lr_scheduler") is not None:
            extra_state["scheduler"] = objects["lr_scheduler"]
        if "every" not in options and not options.get("lossless") and args.save_strategy == "steps":
            options["every"] = _save_interval(state)
        return Checkpointer(self.repo, objects["model"], objects.get("optimizer"),
                            extra_state=extra_state, **options)

    def _restore_rng(self) -> None:
        rng, self._rng = self._rng, None
        if rng is not None:
            RNGState().load_state_dict(rng)

    def _drop_folder(self) -> None:
        """An earlier resume folder the Trainer never read goes now."""
        if self._resume is not None:
            self._resume.cleanup()
            self._resume = None


@dataclasses.dataclass(frozen=True)
class _Resume:
    """What :meth:`InshrinkCallback.resume_path` armed: the version and its folder."""

    snapshot_id: str
    folder: str
    step: int | None
    #: made by on_init_end for resume_from_checkpoint=True (else by resume_path())
    auto: bool
    #: deletes the folder (now, or when the callback is collected or the process exits)
    cleanup: weakref.finalize[..., Any]


def _why_the_trainer_saves(args: Any, state: Any = None) -> str | None:
    """Why the Trainer must keep its own saves and ``checkpoint-N`` folders, or None."""
    if getattr(args, "load_best_model_at_end", False):
        return "load_best_model_at_end=True loads the best of those folders when training ends"
    if getattr(args, "save_strategy", None) == "best":   # a str enum
        return 'save_strategy="best" decides each save after the Trainer\'s own best-metric check'
    if getattr(args, "metric_for_best_model", None) is not None:
        return "metric_for_best_model tracks the best checkpoint as one of those folders"
    if getattr(args, "push_to_hub", False):
        return "push_to_hub=True uploads those folders"
    others = sorted(set(getattr(state, "stateful_callbacks", None) or {}) - {_CONTROL})
    if others:
        return (f"the Trainer stores the state of {others} with each of its saves, which a callback cannot "
                "read")
    return None


def _warn_trainer_saves(args: Any, reason: str) -> None:
    warnings.warn(
        f"InshrinkCallback cannot take the Trainer's saves: {reason}. The Trainer keeps writing its own "
        f"checkpoint-N folders in {args.output_dir} (each save is still a version of the store); "
        "save_only_model=True leaves their optimizer out and save_total_limit=1 keeps one.", stacklevel=3)


def _logged(state: Any) -> bool:
    """The Trainer logged the training loss of this step already (it logs a step once)."""
    return any(entry.get("step") == state.global_step and "loss" in entry for entry in state.log_history)


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse what the Checkpointer would refuse, now rather than at train time: an unknown
    keyword, one of the callback's own names, and every bad value or combination, through
    the Checkpointer's own checks (:class:`~inshrink_store.torch.checkpointer_options.CheckpointerOptions`)."""
    known = {f.name for f in dataclasses.fields(CheckpointerOptions) if f.init} - {"legacy"}
    unknown = sorted(set(options) - known - set(_POLICY_KEYWORDS))
    if unknown:
        raise InvalidInputError(
            f"Expected Checkpointer keywords ({', '.join(sorted(known))}). Got {unknown} instead; the Trainer's "
            "model, optimizer and scheduler are taken from the Trainer, so leave them out.")
    clash = sorted(set(options.get("extra_state") or {}) & set(_RESERVED))
    if clash:
        raise InvalidInputError(
            f"Expected extra_state names other than {list(_RESERVED)}. Got {clash} instead; the callback "
            "stores the scheduler, the RNG states, the Trainer's state and the model's config under those "
            "names: rename yours.")
    legacy = {name: value for name, value in options.items() if name in _POLICY_KEYWORDS}
    given = {name: value for name, value in options.items() if name not in _POLICY_KEYWORDS}
    CheckpointerOptions(legacy=legacy, **given)   # raises what Checkpointer(...) would raise


def _is_repository(url: object) -> TypeGuard[Repository]:
    return callable(getattr(url, "save", None)) and callable(getattr(url, "checkout", None))


def _single_process(args: Any) -> None:
    if getattr(args, "world_size", 1) > 1:
        raise InvalidInputError(
            f"Expected a single-process Trainer. Got world_size {args.world_size} instead: each rank holds "
            "part of the state; use inshrink_store.torch.DistributedCheckpointer for distributed runs.")


def _check_resumed(state: Any, resume: _Resume) -> None:
    """resume_path() armed the callback: the Trainer must have read that folder."""
    if resume.step is not None and state.global_step != resume.step:
        raise InvalidInputError(
            f"Expected the Trainer to resume at step {resume.step} from {resume.folder}. Got global step "
            f"{state.global_step} instead: pass the folder resume_path() returned to "
            "trainer.train(resume_from_checkpoint=...).")


def _trainer_state_json(repo: Any, snapshot_id: str) -> str:
    try:
        text = load_state(repo, snapshot_id, prefix=TRAINER_STATE)
    except NotFoundError:
        text = None
    if not isinstance(text, str):
        raise NotFoundError(
            f"Expected version {snapshot_id[:12]} to hold the Trainer's state ({TRAINER_STATE}). Got a version "
            "without it instead: InshrinkCallback did not save it; resume from a version the callback saved "
            "(`inshrink log` lists them), or restore this one with inshrink_store.torch.Checkpointer.")
    return text


def _untied(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Every name with its own tensor: safetensors refuses tensors that share memory, and
    the Trainer loads the file by name (a tied weight is loaded twice, into one tensor)."""
    seen: set[int] = set()
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def _save_interval(state: Any) -> int | None:
    """The Trainer's absolute save interval, when it saves every N steps."""
    steps = getattr(state, "save_steps", None)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def _metrics(state: Any) -> dict[str, float]:
    """The numbers logged at this step (loss, learning rate, eval metrics) for ``inshrink log``."""
    out: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != state.global_step:
            continue
        for key, value in entry.items():
            if key not in ("step", "epoch") and isinstance(value, Real) and not isinstance(value, bool):
                with contextlib.suppress(TypeError, ValueError):
                    out[key] = float(value)
    return out
