"""Mesh and sharding helpers: data parallelism with ``jax.jit`` over a Mesh.

Parameters and optimizer states are replicated; batches are split along the
"data" mesh axis. The same code runs on one device, on many devices of one
host and across hosts (each host feeds its local slice of the global batch;
call ``jax.distributed.initialize()`` first on multi-host systems, as the
launch scripts do).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over all (or the first ``num_devices``) devices.

    The axis type is Auto: this JAX defaults ``jax.make_mesh`` to Explicit
    axes, which ``flax.linen.Embed`` does not support.
    """
    n = jax.device_count() if num_devices is None else num_devices
    if n < 1 or n > jax.device_count():
        raise ValueError(
            f"config.num_devices={n}, but {jax.device_count()} device(s) are "
            "visible: set config.num_devices to at most that (0 uses all), or "
            "make more visible (on CPU: XLA_FLAGS="
            "--xla_force_host_platform_device_count=N)."
        )
    return jax.make_mesh((n,), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Puts every leaf of ``tree`` on all devices of ``mesh``.

    In a multi-process run each process holds the same values (same seed, or
    restored from one checkpoint) and supplies them for its own devices;
    arrays already on the mesh's replicated sharding are kept.
    """
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(x):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        x = np.asarray(jax.device_get(x))
        return jax.make_array_from_process_local_data(sharding, x, x.shape)

    return jax.tree.map(put, tree)


def check_batch_size(global_batch_size: int, mesh: Mesh) -> int:
    """The per-process batch size; errors if the batch does not divide evenly."""
    n = mesh.devices.size
    if global_batch_size % n:
        raise ValueError(
            f"The global batch size {global_batch_size} is not divisible by the "
            f"{n} devices of the mesh; choose a multiple of {n}."
        )
    return global_batch_size // jax.process_count()


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Turns this process's numpy batch into global arrays split on "data".

    Args:
      batch: a pytree of numpy arrays whose leading axis is this process's
        share of the global batch (the whole batch on a single host).
      mesh: the mesh from :func:`make_mesh`.
    """
    sharding = data_sharding(mesh)

    def put(x):
        x = np.asarray(x)
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, batch)
