"""Run by tests/test_parallel.py in a subprocess with 4 fake CPU devices.

Prints the max abs difference between one MoDDiffy-par train step on a
4-device mesh (batch split on "data") and on a single device.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from moddiffy_jax import parallel, train  # noqa: E402
from moddiffy_jax.config_lib import experiment_config  # noqa: E402
from moddiffy_jax.data import TrainIterator  # noqa: E402
from moddiffy_jax.methods import common  # noqa: E402


def one_step(num_devices):
    config = experiment_config(sys.argv[1], "model=tiny")
    with config.unlocked():
        config.num_devices = num_devices
    ctx = train.build_context(config)
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    substeps = ctx.method.substeps(ctx, "l0", trainable)
    state = common.TrainState(
        step=common.jnp_zero_step(),
        trainable=trainable,
        opt_states=common.init_opt_states(substeps, trainable),
    )
    batch = next(TrainIterator(ctx.data.splits["train"], batch_size=8, seed=0))
    state = parallel.replicate(state, ctx.mesh)
    frozen = parallel.replicate(frozen, ctx.mesh)
    batch = parallel.shard_batch(batch, ctx.mesh)
    assert len(batch["input_ids"].sharding.device_set) == num_devices
    step = jax.jit(common.make_train_step(substeps))
    new, metrics = step(state, frozen, batch, jax.random.PRNGKey(1))
    return jax.device_get(new.trainable), jax.device_get(metrics)


assert jax.device_count() == 4, jax.devices()
single, m1 = one_step(1)
sharded, m4 = one_step(4)
diff = max(
    float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), strict=True)
)
fresh = train.build_context(experiment_config(sys.argv[1], "model=tiny"))
changed = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(
        jax.tree.leaves(single),
        jax.tree.leaves(fresh.method.init(fresh, jax.random.PRNGKey(0))[0]),
        strict=True,
    )
)
print(
    f"MAXDIFF {diff:.3e} LOSSDIFF {abs(m1['task/loss'] - m4['task/loss']):.3e} "
    f"UPDATE {changed:.3e}"
)
