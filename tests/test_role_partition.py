"""role_partition: optax.partition's updates from a state of each role's own leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax.methods import common
from moddiffy_jax.methods.role_partition import (
    RolePartitionState,
    role_partition,
    under,
)


def _tree(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    return {
        "core": {"dense": {"kernel": jax.random.normal(k[0], (4, 3))}},
        "diffs": {
            "gender": {
                "delta": {"dense": {"kernel": jax.random.normal(k[1], (4, 3))}},
                "log_alpha": {"dense": {"kernel": jax.random.normal(k[2], (4, 3))}},
            }
        },
        "task_head": {"bias": jax.random.normal(k[3], (3,))},
        "adversaries": {"gender": {"w": jax.random.normal(k[4], (3, 2))}},
    }


def _labels(tree):
    def role(path, _):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if name.startswith("core"):
            return "encoder"
        if "log_alpha" in name:
            return "log_alpha"
        if name.startswith("diffs"):
            return "diff"
        return "heads"  # task head and adversary share a role here

    return jax.tree_util.tree_map_with_path(role, tree)


TRANSFORMS = {
    "encoder": optax.adamw(1e-3, weight_decay=0.01),
    "diff": optax.adamw(5e-2, weight_decay=0.0),
    "log_alpha": optax.adam(0.1),
    "heads": optax.sgd(0.5),
    "scores": optax.adam(1.0),  # a role no leaf has
}


def test_updates_equal_optax_partition_bit_for_bit():
    ours, theirs = (
        role_partition(TRANSFORMS, _labels),
        optax.partition(TRANSFORMS, _labels),
    )
    params = _tree(0)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    step_ours, step_theirs = jax.jit(ours.update), jax.jit(theirs.update)
    for i in range(4):
        grads = _tree(10 + i)
        u_ours, s_ours = step_ours(grads, s_ours, params)
        u_theirs, s_theirs = step_theirs(grads, s_theirs, params)
        assert jax.tree.structure(u_ours) == jax.tree.structure(grads)
        for a, b in zip(
            jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        params = optax.apply_updates(params, u_ours)
    # Only the roles present, each over its own leaves, keyed by path.
    assert set(s_ours.inner_states) == {"encoder", "diff", "log_alpha", "heads"}
    nu = s_ours.inner_states["diff"][0].nu
    assert set(nu) == {"diffs/gender/delta/dense/kernel"}
    leaves = jax.tree.leaves(s_ours, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert not any(isinstance(x, optax.MaskedNode) for x in leaves)
    n_ours = jax.tree.structure(s_ours).num_nodes
    n_theirs = jax.tree.structure(s_theirs).num_nodes
    assert n_ours < n_theirs / 2, (n_ours, n_theirs)


def test_under_rebuilds_one_parts_nested_tree():
    flat = {"diffs/gender/delta/a/b": 1, "diffs/gender/delta/c": 2, "diffs/age/x": 3}
    assert under(flat, "diffs/gender/delta") == {"a": {"b": 1}, "c": 2}
    assert under(flat, "diffs/race") == {}


def test_a_role_without_an_optimizer_is_named():
    opt = role_partition({"encoder": optax.sgd(1.0)}, _labels)
    with pytest.raises(ValueError, match=r"no optimizer for the role\(s\) \['diff'"):
        opt.init(_tree(0))


def test_the_library_optimizer_state_has_no_masked_placeholders():
    optim = {f"lr_{r}": 1e-3 for r in common.ROLES} | {
        f"wd_{r}": 0.0 for r in common.ROLES
    }
    optim |= {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "clip_norm": 1.0}
    parts = {
        "core": {"w": jnp.ones((2, 2))},
        "task_head": {"b": jnp.ones((2,))},
    }
    state = common.make_optimizer(optim).init(parts)
    partition = state[-1]
    assert isinstance(partition, RolePartitionState)
    assert set(partition.inner_states) == {"encoder", "heads"}


def test_a_checkpoint_of_the_old_layout_fails_to_resume_with_the_fix_named(tmp_path):
    from moddiffy_jax import checkpoints

    params = _tree(0)
    old = optax.partition(TRANSFORMS, _labels).init(params)
    ckpt = checkpoints.RunCheckpointer(tmp_path / "ckpt")
    ckpt.save(3, {"opt": old}, {"step": 3}, None)
    ckpt.wait()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    new = role_partition(TRANSFORMS, _labels).init(params)
    with pytest.raises(ValueError, match="another layout.*new workdir"):
        ckpt.restore_state(3, {"opt": new})
    ckpt.close()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
