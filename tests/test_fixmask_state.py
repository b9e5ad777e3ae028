"""The fixmask phase's dense form (``diff.fixmask_state``): each cut diff
keeps its shapes with every gate fixed (kept open, the rest shut), so the
fixmask step is the L0 phase's program and the loop runs it without a second
compile. It must train exactly what the sparse form trains: the kept values
only, with the sparse diff's gradient (no straight-through term), and export
the same entries."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax import train
from moddiffy_jax.data import TrainIterator
from moddiffy_jax.methods import common, moddiffy
from moddiffy_jax.subnets import diffs as diffs_lib
from tests.helpers import set_fields, tiny


def _cut(form):
    """A tiny MoDDiffy-par state cut to fixmask in ``form``, from diffs moved
    off zero (a cut of the untrained diffs would keep ties)."""
    ctx = train.build_context(tiny("moddiffy_par", **{"diff.fixmask_state": form}))
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    for i, a in enumerate(ctx.attributes):
        st = trainable["diffs"][a]
        leaves, tree = jax.tree.flatten(st.delta)
        keys = jax.random.split(jax.random.PRNGKey(i + 1), len(leaves))
        moved = [
            x + 1e-3 * jax.random.normal(k, x.shape)
            for x, k in zip(leaves, keys, strict=True)
        ]
        trainable["diffs"][a] = st.replace(delta=jax.tree.unflatten(tree, moved))
    trainable, frozen = ctx.method.transition(
        ctx, jax.device_get(trainable), jax.device_get(frozen), "fixmask"
    )
    return ctx, trainable, frozen


def test_the_dense_form_trains_and_exports_what_the_sparse_form_does():
    runs = {}
    for form in ("sparse", "dense"):
        ctx, trainable, frozen = _cut(form)
        part = trainable["diffs"]["gender"]
        assert isinstance(part, diffs_lib.DiffState) == (form == "dense")
        assert ("indices" in frozen) == (form == "sparse")
        state, substeps = train._phase_state(
            ctx, ctx.method, "fixmask", trainable, 4, False
        )
        step = common.compile_train_step(substeps, donate=False)
        batches = TrainIterator(ctx.data.splits["train"], batch_size=8, seed=0)
        for _ in range(2):
            state, metrics = step(state, frozen, next(batches), jax.random.PRNGKey(3))
        trained = jax.device_get(state.trainable)
        runs[form] = (ctx, trained, frozen, metrics)
    (ctx, sparse, frozen_s, m_s), (_, dense, frozen_d, m_d) = (
        runs["sparse"],
        runs["dense"],
    )
    # The same kept entries with the same values, to float32 rounding.
    exported = {
        form: moddiffy.sparse_diffs_of(ctx, t, f, "fixmask")
        for form, t, f in (("sparse", sparse, frozen_s), ("dense", dense, frozen_d))
    }
    for name, sd in exported["sparse"].items():
        other = exported["dense"][name]
        assert sd.nnz() == other.nnz() == int(ctx.config.diff.keep * sd.num_selected())
        for p in sd.indices:
            np.testing.assert_array_equal(sd.indices[p], other.indices[p])
            np.testing.assert_allclose(sd.values[p], other.values[p], atol=1e-7)
    for x, y in zip(
        jax.tree.leaves(sparse["core"]), jax.tree.leaves(dense["core"]), strict=True
    ):
        np.testing.assert_allclose(x, y, atol=1e-7)
    # Only the kept entries moved: the dropped ones and every gate stayed.
    for a in ctx.attributes:
        st = dense["diffs"][a]
        kept = diffs_lib.fixed_kept(st)
        for d, k in zip(jax.tree.leaves(st.delta), jax.tree.leaves(kept), strict=True):
            assert not np.any(np.asarray(d)[~np.asarray(k)])
        for la in jax.tree.leaves(st.log_alpha):
            assert set(np.unique(np.asarray(la))) <= {
                diffs_lib.FIXED_LOG_ALPHA,
                -diffs_lib.FIXED_LOG_ALPHA,
            }
    # The same gradients (norms), the L0 term a constant beside them.
    for a in ctx.attributes:
        name = f"debias/{a}/grad_norm"
        np.testing.assert_allclose(m_s[name], m_d[name], rtol=1e-5)
        assert f"debias/{a}/l0/{a}" in m_d and f"debias/{a}/l0/{a}" not in m_s
    # finish (and so the export) reads the sparse form: exactly the same state.
    t, f = moddiffy.sparse_form(ctx, dense, frozen_d)
    again = moddiffy.sparse_diffs_of(ctx, t, f, "fixmask")
    for name, sd in exported["dense"].items():
        for p in sd.indices:
            np.testing.assert_array_equal(sd.indices[p], again[name].indices[p])
            np.testing.assert_array_equal(sd.values[p], again[name].values[p])


def test_fixed_gates_give_the_sparse_gradient_under_straight_through():
    """A kept entry's gradient is ``g`` (not the straight-through ``2 g``), a
    dropped entry's and every gate's 0; an L0 gate keeps its ``(1 + z) g``."""
    base = {"w": jnp.zeros((2, 3))}
    state = diffs_lib.init_diff(base, ".*")
    kept = {"w": jnp.asarray([[True, False, True], [False, False, True]])}
    values = {"w": jnp.arange(1.0, 7.0).reshape(2, 3)}
    fixed = diffs_lib.fix_gates(state, kept, values)
    weights = jnp.arange(6.0).reshape(2, 3) + 1.0

    def loss(st, train_mode):
        params = diffs_lib.apply_dense_diff(
            base, st, rng=jax.random.PRNGKey(0), train=train_mode
        )
        return jnp.sum(params["w"] * weights)

    for train_mode in (True, False):
        out = diffs_lib.apply_dense_diff(
            base, fixed, rng=jax.random.PRNGKey(0), train=train_mode
        )
        np.testing.assert_array_equal(out["w"], np.where(kept["w"], values["w"], 0.0))
        grads = jax.grad(loss)(fixed, train_mode)
        np.testing.assert_array_equal(
            grads.delta["w"], np.where(kept["w"], weights, 0.0)
        )
        np.testing.assert_array_equal(grads.log_alpha["w"], np.zeros((2, 3)))
        penalty = jax.grad(lambda st: diffs_lib.l0_penalty(st))(fixed)
        np.testing.assert_array_equal(penalty.log_alpha["w"], np.zeros((2, 3)))
    # The L0 phase's gates (and ones closed for good) keep straight-through.
    closed = diffs_lib.close_gates(state, {"w": kept["w"]})
    grads = jax.grad(loss)(closed, False)
    z = np.where(kept["w"], 1.0, 0.0)
    np.testing.assert_array_equal(grads.delta["w"], (1.0 + z) * weights)


def test_the_form_is_checked_and_auto_keeps_what_reads_kept_values_sparse():
    config = tiny("moddiffy_par")
    assert config.diff.fixmask_state == "auto"
    assert moddiffy.dense_fixmask(config)  # a CPU backend: nothing compiles ahead
    for field, value in (
        ("train.compile_ahead", "on"),
        ("train.select", "best_dev"),
        ("train.average_from", 0.5),
        ("diff.structured", True),
        ("diff.freeze_core_in_fixmask", True),
        ("optim.diff_words_lr_scale", 5.0),
    ):
        changed = set_fields(tiny("moddiffy_par"), {field: value})
        assert not moddiffy.dense_fixmask(changed), field
        if field != "train.compile_ahead":
            set_fields(changed, {"diff.fixmask_state": "dense"})
            with pytest.raises(ValueError, match="'sparse' or 'auto'"):
                moddiffy.dense_fixmask(changed)
    set_fields(config, {"diff.fixmask_state": "sparse"})
    assert not moddiffy.dense_fixmask(config)
    set_fields(config, {"diff.fixmask_state": "packed"})
    with pytest.raises(ValueError, match="use one of"):
        moddiffy.dense_fixmask(config)
    with pytest.raises(ValueError, match="fixmask_state='packed'"):
        train.build_context(config)  # before anything trains


def _toy_loss(trainable, frozen, batch, rng):
    return jnp.sum((trainable["w"] * batch["x"] - frozen["t"]) ** 2), {}


def _toy_step(loss, lr=0.1):
    sub = common.SubStep("task", (("w",),), loss, optax.adam(lr))
    return jax.jit(common.make_train_step([sub])), sub


def test_a_phase_reuses_the_previous_step_only_when_it_is_the_same_program():
    first, sub = _toy_step(_toy_loss)
    w = {"w": jnp.arange(4.0)}
    state = common.TrainState(
        step=common.jnp_zero_step(),
        trainable=w,
        opt_states=common.init_opt_states([sub], w),
    )
    args = (state, {"t": jnp.float32(1.0)}, {"x": jnp.ones(4)}, jax.random.PRNGKey(0))
    previous = (first, train._signature(args))
    same, _ = _toy_step(lambda *a: _toy_loss(*a))  # a new function, same program
    chosen, record = train._same_program(previous, same, args)
    assert chosen is first and record["program/reused"] == 1
    np.testing.assert_array_equal(
        chosen(*args)[0].trainable["w"], same(*args)[0].trainable["w"]
    )
    other, _ = _toy_step(_toy_loss, lr=0.2)  # another constant: another program
    chosen, record = train._same_program(previous, other, args)
    assert chosen is other and record["program/reused"] == 0
    # Other shapes are not lowered at all.
    wider = (
        common.TrainState(
            step=state.step,
            trainable={"w": jnp.arange(5.0)},
            opt_states=common.init_opt_states([sub], {"w": jnp.arange(5.0)}),
        ),
        *args[1:3],
        args[3],
    )
    boom = types.SimpleNamespace(lower=lambda *a: pytest.fail("lowered"))
    chosen, record = train._same_program((boom, previous[1]), other, wider)
    assert chosen is other and record["program/reused"] == 0
