"""A training method as a value: the functions the loop calls, and nothing else.

A :class:`Method` is to ``moddiffy_jax.train`` what an optax
``GradientTransformation`` is to an optimiser loop: a frozen dataclass of
pure functions. The loop asks a method for its phases, its initial state,
the sub-steps of each phase, what to do after a step and between phases,
and what to export; it never asks which method it runs. A new method is one
module of ``moddiffy_jax.methods`` that builds ``Method`` values (from the
hooks of a family, or its own) and lists them in ``METHODS``; the registry
finds it.

Hooks (``ctx`` is a :class:`moddiffy_jax.context.Context`; ``trainable`` and
``frozen`` are the dicts of named parts described in
:mod:`moddiffy_jax.methods.common`):

* ``phases(config) -> tuple[str, ...]`` and ``phase_steps(config, phase)``.
* ``init(ctx, rng) -> (trainable, frozen)``: the state of the first phase.
* ``substeps(ctx, phase, trainable) -> [SubStep]``: one jitted step runs them
  in order (:func:`moddiffy_jax.methods.common.make_train_step`).
* ``after_step(ctx, state, phase, phase_step, n_steps) -> (state, record)``:
  host-side work after a step (gradual pruning, mask resets); ``record`` is
  a dict of metrics to log, or None.
* ``transition(ctx, trainable, frozen, next_phase) -> (trainable, frozen)``:
  between phases (the cut to an exact budget, an IMP round).
* ``finish(ctx, trainable, frozen, phase) -> (trainable, frozen, record)``:
  once, after the last step (and the best-step selection), before the
  export: a host-side refit of the final state (the diffs' closed-form
  erasers); ``record`` (a dict, or None) goes in ``results.json``.
* ``checkpoint_extra(frozen)`` and ``restore(ctx, trainable, frozen, phase,
  extra) -> (trainable, frozen)``: host-side state saved beside the Orbax
  state (sparse indices), and the templates a restore needs.
* ``model(ctx, trainable, frozen) -> (encoder params, head)``: the core the
  run exports; ``exports(ctx, trainable, frozen, phase) -> {name:
  SparseDiff}``: the diffs it exports beside the core (the loop saves them
  and builds the composition table from them); ``report(ctx, trainable,
  frozen, export_dir, chief) -> dict``: method-specific results (and files).
* ``encoder_and_head(method, trainable, frozen, phase, settings, attribute,
  rng, *, train) -> (encoder params, head)``: the effective parameters the
  losses differentiate (with ``attribute``'s module, if any); the default
  knows the encoder labels of :data:`moddiffy_jax.methods.common.ENCODER_MODES`.
* ``config_sections() -> {name: ConfigDict}``: the method's own config
  sections with their defaults, added to its configs by
  :func:`moddiffy_jax.config_lib.base_config`.
* ``check_config(config)``: clear errors for settings that cannot work,
  raised when the run's context is built.
* ``driver``: ``"module:function"`` of a method that runs its own loop
  (FFW's surgery); the loop hands such a run over whole.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_collections

from moddiffy_jax.methods.common import MethodDef, standard_encoder_and_head

PyTree = Any


def one_phase(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    return ("train",)


def two_phases(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    return ("l0", "fixmask")


def phase_steps(config: ml_collections.ConfigDict, phase: str) -> int:
    """Steps of the standard phases: ``train`` (num_steps), ``l0``, ``fixmask``."""
    steps = {
        "train": config.train.num_steps,
        "l0": config.train.l0_steps,
        "fixmask": config.train.fixmask_steps,
    }
    if phase not in steps:
        raise ValueError(f"No step count for phase {phase!r}; valid: {list(steps)}.")
    return steps[phase]


def no_after_step(ctx, state, phase: str, phase_step: int, n_steps: int):
    return state, None


def no_transition(ctx, trainable: dict, frozen: dict, next_phase: str):
    return trainable, frozen


def no_finish(ctx, trainable: dict, frozen: dict, phase: str):
    return trainable, frozen, None


def never_settled(
    config: ml_collections.ConfigDict, phase: str, phase_step: int, n_steps: int
) -> bool:
    return False


def no_checkpoint_extra(frozen: Mapping[str, Any]) -> dict:
    return {}


def no_restore(ctx, trainable: dict, frozen: dict, phase: str, extra: Any):
    return trainable, frozen


def no_exports(ctx, trainable, frozen, phase: str) -> dict:
    return {}


def no_report(ctx, trainable, frozen, export_dir: Path, chief: bool) -> dict:
    return {}


def no_check(config: ml_collections.ConfigDict) -> None:
    return None


def no_sections() -> dict[str, ml_collections.ConfigDict]:
    return {}


def _no_loop(*args, **kwargs):
    raise NotImplementedError("This method runs its own driver (Method.driver).")


@dataclasses.dataclass(frozen=True)
class Method(MethodDef):
    """A named method: its :class:`MethodDef` fields plus the loop's hooks."""

    init: Callable[..., tuple[dict, dict]] = _no_loop
    substeps: Callable[..., list] = _no_loop
    model: Callable[..., tuple[PyTree, PyTree]] = _no_loop
    phases_of: Callable[[ml_collections.ConfigDict], tuple[str, ...]] = one_phase
    phase_steps: Callable[[ml_collections.ConfigDict, str], int] = phase_steps
    after_step: Callable[..., tuple[Any, dict | None]] = no_after_step
    transition: Callable[..., tuple[dict, dict]] = no_transition
    finish: Callable[..., tuple[dict, dict, dict | None]] = no_finish
    # True from the phase step on at which the next phase's state shapes are
    # fixed (what ``transition`` would give then has the shapes it gives at
    # the phase's end): the loop may compile the next phase's step ahead.
    next_shapes_settled: Callable[..., bool] = never_settled
    checkpoint_extra: Callable[[Mapping[str, Any]], Any] = no_checkpoint_extra
    restore: Callable[..., tuple[dict, dict]] = no_restore
    exports: Callable[..., dict] = no_exports
    report: Callable[..., dict] = no_report
    check_config: Callable[[ml_collections.ConfigDict], None] = no_check
    encoder_and_head: Callable[..., tuple[PyTree, PyTree]] = standard_encoder_and_head
    config_sections: Callable[[], dict[str, ml_collections.ConfigDict]] = no_sections
    driver: str | None = None

    def run_driver(
        self, config: ml_collections.ConfigDict, workdir: Any, **kwargs: Any
    ) -> dict:
        """Runs a method that owns its loop (``driver`` = ``"module:function"``).

        ``kwargs`` (``allow_changed_inputs``) go to the driver.

        The driver is named, not imported here: the driver imports the
        method's module, so a direct import would make a circle.
        """
        module, _, function = self.driver.partition(":")
        driver = getattr(importlib.import_module(module), function)
        return driver(config, workdir, **kwargs)
