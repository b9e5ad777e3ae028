"""The train step of every method that runs the shared loop: its state,
its sub-steps, and how they run (one program, or one per distinct sub-step
with the attributes' debias sub-steps shared). Re-exported by
:mod:`moddiffy_jax.methods.common`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from moddiffy_jax.methods.terms import INFO_KEY, STATE_KEY, STEP_KEY

Key = tuple[str, ...]


@flax.struct.dataclass
class TrainState:
    """Everything a step changes. ``opt_states`` has one entry per sub-step."""

    step: jax.Array
    trainable: dict[str, Any]
    opt_states: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SubStep:
    """One optimisation step inside a train step.

    Attributes:
      name: e.g. "task" or "debias/gender"; prefixes its metric names.
      updates: the keys (paths into ``trainable``) this sub-step trains.
      loss: ``loss(trainable, frozen, batch, rng) -> (total, {name: term})``.
      optimizer: its own optax transformation (own moments, own clipping).
    """

    name: str
    updates: tuple[Key, ...]
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    optimizer: optax.GradientTransformation
    # A sub-step of one attribute, written for every attribute: ``loss`` and
    # ``updates`` name the attribute :data:`SHARED_ATTRIBUTE`, and the step
    # runs it on :func:`attribute_view` of the state for ``attribute``
    # (``attributes``: all of the run's). Sub-steps with the same ``loss``,
    # ``optimizer`` and ``updates`` then trace and compile once for all the
    # attributes whose parameters have the same shapes.
    attribute: str | None = None
    attributes: tuple[str, ...] = ()


#: The attribute name a shared sub-step is written for (see SubStep).
SHARED_ATTRIBUTE = "@attribute"


def attribute_view(tree: Any, attributes: Sequence[str], attribute: str) -> Any:
    """``tree`` as a shared sub-step sees ``attribute``: every dict keyed by
    exactly the run's ``attributes`` becomes ``{SHARED_ATTRIBUTE: its entry
    for attribute}``; other attributes' entries are left out."""
    if not isinstance(tree, Mapping):
        return tree
    if set(tree) == set(attributes):
        return {SHARED_ATTRIBUTE: tree[attribute]}
    return {k: attribute_view(v, attributes, attribute) for k, v in tree.items()}


def batch_attribute_view(batch: Mapping[str, Any], attribute: str) -> dict[str, Any]:
    """``batch`` as a shared sub-step sees ``attribute``: its labels are the
    only attribute labels, under ``SHARED_ATTRIBUTE``."""
    return {**batch, "attrs": {SHARED_ATTRIBUTE: batch["attrs"][attribute]}}


def attribute_unview(full: Any, view: Any, attribute: str) -> Any:
    """The inverse of :func:`attribute_view`: ``full`` with what ``view`` holds
    (``SHARED_ATTRIBUTE`` entries written back under ``attribute``; entries
    new in ``view`` are added, other attributes' are kept)."""
    if not isinstance(view, Mapping):
        return view
    out = dict(full) if isinstance(full, Mapping) else {}
    for k, v in view.items():
        if k == SHARED_ATTRIBUTE:
            out[attribute] = v
        else:
            out[k] = attribute_unview(out.get(k), v, attribute)
    return out


def get_part(tree: Mapping[str, Any], key: Key) -> Any:
    node = tree
    for k in key:
        node = node[k]
    return node


def set_part(tree: Mapping[str, Any], key: Key, value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``key`` (copies only the spine)."""
    head, *rest = key
    out = dict(tree)
    out[head] = value if not rest else set_part(tree.get(head, {}), tuple(rest), value)
    return out


def _nested_set(out: dict[str, Any], key: Key, value: Any) -> None:
    node = out
    for k in key[:-1]:
        node = node.setdefault(k, {})
    node[key[-1]] = value


def gather_parts(trainable: Mapping[str, Any], keys: Sequence[Key]) -> dict[str, Any]:
    """The nested dict holding only the parts of ``trainable`` at ``keys``."""
    out: dict[str, Any] = {}
    for key in keys:
        _nested_set(out, key, get_part(trainable, key))
    return out


def drop_parts(tree: Mapping[str, Any], keys: Sequence[Key]) -> dict[str, Any]:
    """A copy of ``tree`` without the parts at ``keys`` (copies only the spine)."""
    out = dict(tree)
    for key in keys:
        head, *rest = key
        if head not in out:
            continue
        if rest:
            out[head] = drop_parts(out[head], (tuple(rest),))
        else:
            del out[head]
    return out


def scatter_parts(
    trainable: Mapping[str, Any], parts: Mapping[str, Any], keys: Sequence[Key]
) -> dict[str, Any]:
    """``trainable`` with the parts at ``keys`` taken from ``parts``."""
    out = dict(trainable)
    for key in keys:
        out = set_part(out, key, get_part(parts, key))
    return out


# --------------------------------------------------------------------------
# The step factory.


def make_train_step(substeps: Sequence[SubStep]) -> Callable:
    """``step(state, frozen, batch, rng) -> (state, metrics)``, not yet jitted.

    Sub-steps run in order; each sees the parameters the previous ones
    produced. The step's randomness is ``fold_in(rng, state.step)`` and then
    ``fold_in(., i)`` for sub-step ``i``, so a resumed run draws the same
    noise as an uninterrupted one. Jitted whole, it is one program; see
    :func:`compile_train_step` for one program per distinct sub-step.
    """
    updates = [_substep_update(sub) for sub in substeps]

    opt_trees: dict[int, Any] = {}

    def step(state: TrainState, frozen, batch, rng):
        return _run_substeps(substeps, updates, opt_trees, state, frozen, batch, rng)

    return step


def compile_train_step(substeps: Sequence[SubStep], *, donate: bool = True) -> Callable:
    """The step of :func:`make_train_step`, the same arithmetic, with each
    sub-step jitted on its own (its parameters and optimizer state donated)
    and shared sub-steps (:class:`SubStep` ``attribute``) jitted once: the
    attributes' debias sub-steps of a run then trace and compile once, not
    once per attribute (docs/speed.md)."""
    jitted: dict[tuple[int, int, tuple[Key, ...]], Callable] = {}
    updates = []
    for sub in substeps:
        key = (id(sub.loss), id(sub.optimizer), sub.updates)
        if sub.attribute is None or key not in jitted:
            fn = jax.jit(_substep_update(sub), donate_argnums=(0, 1) if donate else ())
            if sub.attribute is not None:
                jitted[key] = fn
        else:
            fn = jitted[key]
        updates.append(fn)

    opt_trees: dict[int, Any] = {}

    def step(state: TrainState, frozen, batch, rng):
        return _run_substeps(substeps, updates, opt_trees, state, frozen, batch, rng)

    return step


def _substep_update(sub: SubStep) -> Callable:
    """One sub-step's update of its parts ``own`` (the rest of the trainable
    tree in ``rest``): ``(own, opt_state, state_updates, metrics)``."""

    def update(own, opt_state, rest, frozen, batch, rng, step, index):
        sub_rng = jax.random.fold_in(jax.random.fold_in(rng, step), index)

        def objective(own_):
            full = scatter_parts(rest, own_, sub.updates)
            return sub.loss(full, frozen, {**batch, STEP_KEY: step}, sub_rng)

        (total_, terms), grads = jax.value_and_grad(objective, has_aux=True)(own)
        changes, opt_state = sub.optimizer.update(grads, opt_state, own)
        own = optax.apply_updates(own, changes)
        state_updates = terms.pop(STATE_KEY, {})
        terms.update(terms.pop(INFO_KEY, {}))
        metrics = {"loss": total_, "grad_norm": optax.global_norm(grads), **terms}
        return own, opt_state, state_updates, metrics

    return update


def _run_substeps(substeps, updates, opt_trees, state: TrainState, frozen, batch, rng):
    trainable = state.trainable
    opt_states = dict(state.opt_states)
    metrics = {}
    for i, (sub, update) in enumerate(zip(substeps, updates, strict=True)):
        attr = sub.attribute
        view, frozen_view, batch_view = trainable, frozen, batch
        opt_state = opt_states[sub.name]
        if attr is not None:
            view = attribute_view(trainable, sub.attributes, attr)
            frozen_view = attribute_view(frozen, sub.attributes, attr)
            batch_view = batch_attribute_view(batch, attr)
            if i not in opt_trees:  # traced once, not every step
                opt_trees[i] = _shared_opt_tree(sub, view)
            opt_state = _retree(opt_state, opt_trees[i])
        own = gather_parts(view, sub.updates)
        rest = drop_parts(view, sub.updates)
        own, opt_state, state_updates, terms = update(
            own,
            opt_state,
            rest,
            frozen_view,
            batch_view,
            rng,
            state.step,
            np.int32(i),
        )
        view = scatter_parts(rest, own, sub.updates)
        for key, value in state_updates.items():
            view = set_part(view, key, value)
        if attr is None:
            trainable = view
        else:
            trainable = attribute_unview(trainable, view, attr)
            opt_state = _retree(opt_state, jax.tree.structure(opt_states[sub.name]))
            terms = {k.replace(SHARED_ATTRIBUTE, attr): v for k, v in terms.items()}
        opt_states[sub.name] = opt_state
        for name, value in terms.items():
            metrics[f"{sub.name}/{name}"] = value
    new_state = state.replace(
        step=state.step + 1, trainable=trainable, opt_states=opt_states
    )
    return new_state, metrics


def _shared_opt_tree(sub: SubStep, view) -> Any:
    """The tree structure of a shared sub-step's optimizer state (its
    attribute's dict keys renamed, leaves in the same order: each
    attribute-keyed dict of the trained parts holds one attribute)."""
    own = gather_parts(view, sub.updates)
    return jax.tree.structure(jax.eval_shape(sub.optimizer.init, own))


def _retree(tree, treedef):
    """The leaves of ``tree`` in the structure ``treedef``."""
    leaves = jax.tree.leaves(tree)
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            f"optimizer state with {len(leaves)} leaves cannot take the shared "
            f"sub-step's structure of {treedef.num_leaves}"
        )
    return jax.tree.unflatten(treedef, leaves)


def init_opt_states(
    substeps: Sequence[SubStep], trainable: Mapping[str, Any]
) -> dict[str, Any]:
    """Each sub-step's optimizer state, over its parts as the state stores
    them (a shared sub-step's under its own attribute's name)."""
    return {
        sub.name: sub.optimizer.init(gather_parts(trainable, stored_updates(sub)))
        for sub in substeps
    }


def stored_loss(sub: SubStep) -> Callable:
    """``sub.loss`` over the trees as the state stores them (for a shared
    sub-step: on its attribute's view, term names under the attribute's)."""
    if sub.attribute is None:
        return sub.loss

    def loss(trainable, frozen, batch, rng):
        view = functools.partial(
            attribute_view, attributes=sub.attributes, attribute=sub.attribute
        )
        batch_view = batch_attribute_view(batch, sub.attribute)
        value, terms = sub.loss(view(trainable), view(frozen), batch_view, rng)
        return value, _rename_terms(terms, sub.attribute)

    return loss


def _rename_terms(terms: Mapping[str, Any], attribute: str) -> dict[str, Any]:
    out = {}
    for k, v in terms.items():
        if isinstance(k, str):
            k = k.replace(SHARED_ATTRIBUTE, attribute)
        out[k] = _rename_terms(v, attribute) if isinstance(v, Mapping) else v
    return out


def stored_updates(sub: SubStep) -> tuple[Key, ...]:
    """``sub.updates`` as paths into the stored trainable tree."""
    if sub.attribute is None:
        return sub.updates
    return tuple(
        tuple(sub.attribute if k == SHARED_ATTRIBUTE else k for k in key)
        for key in sub.updates
    )


def jnp_zero_step() -> jax.Array:
    return jnp.zeros((), jnp.int32)
