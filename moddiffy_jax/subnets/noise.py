"""Uniform noise that XLA can fuse: ``jax.random.uniform``'s bits, unrolled.

The hard-concrete gates draw one uniform number per diff entry per step (22M
per attribute on MiniLM). On CPU, JAX lowers its Threefry-2x32 hash as a
rolled loop of five iterations, each writing two full uint32 arrays, so the
noise of one 30522 x 384 embedding matrix alone moves hundreds of megabytes
through memory before the gate formula reads it. :func:`uniform` computes the
same hash as plain unrolled uint32 arithmetic on the element's counter: XLA
then fuses it into the consumer (the gate, the gated add) and nothing is
materialised. The result is bit for bit ``jax.random.uniform(key, shape,
jnp.float32)`` (``tests/test_hard_concrete.py`` checks it); where that cannot
be guaranteed (a typed key of another PRNG implementation, the
non-partitionable Threefry mode, 2**32 entries or more, another dtype) it
calls ``jax.random.uniform`` itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
_ONE_BITS = np.uint32(0x3F800000)  # float32 1.0


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(
    k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of counter words ``(x1, x2)`` under key
    ``(k1, k2)``, all uint32, as straight-line arithmetic."""
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x1 = x1 + ks[0]
    x2 = x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ _rotl(x2, r)
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The two uint32 words of a Threefry key, or None for other keys."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)):
            return None
        key = jax.random.key_data(key)
    elif jax.config.jax_default_prng_impl != "threefry2x32":
        return None
    if key.dtype != jnp.uint32 or key.shape != (2,):
        return None
    return key[0], key[1]


def uniform(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
    """``jax.random.uniform(key, shape, dtype)`` on [0, 1), fusible by XLA."""
    shape = tuple(int(d) for d in shape)
    words = _key_words(key)
    if not _hashable(words, shape, dtype):
        return jax.random.uniform(key, shape, dtype)
    return _uniform_of_words(words[0], words[1], shape)


def _hashable(words, shape: tuple[int, ...], dtype=jnp.float32) -> bool:
    """Whether the straight-line hash gives ``jax.random.uniform``'s numbers
    for this key (its words), shape and dtype."""
    return (
        words is not None
        and jnp.dtype(dtype) == jnp.float32
        and jax.config.jax_threefry_partitionable
        and 0 < math.prod(shape) < 2**32
        and bool(shape)
    )


# Traced once per shape and inlined (``inline=True``): a step draws noise for
# about a hundred leaves of a handful of shapes, several times (gates, the
# swapped twin, dropout), and tracing the straight-line hash again for each
# was a large share of a first step's Python time. The jaxpr and the program
# are the same as tracing it every time (stop 64, docs/speed.md).
@functools.partial(jax.jit, static_argnums=(2,), inline=True)
def _uniform_of_words(k1: jax.Array, k2: jax.Array, shape: tuple[int, ...]):
    return _to_unit_float((k1, k2), _counter(shape))


def _counter(shape: tuple[int, ...]) -> jax.Array:
    """The row-major index of each element: its counter (high word 0 below
    2**32 entries, low word the index; jax's iota_2x32_shape)."""
    counter = jnp.zeros(shape, jnp.uint32)
    for axis, stride in enumerate(np.cumprod((1,) + shape[:0:-1])[::-1]):
        counter = counter + jax.lax.broadcasted_iota(
            jnp.uint32, shape, axis
        ) * np.uint32(stride)
    return counter


#: Leaves with fewer entries than this that share a shape are drawn as one
#: hash over ``[n, *shape]`` by :func:`uniform_many`. A step draws noise for
#: every leaf of a diff: on MiniLM about sixty of its 101 leaves are vectors
#: of 384 or 1536 entries, on the tests' tiny BERT nearly all; each draw is
#: some 170 operations of straight-line hash, so drawing them leaf by leaf
#: made the hash a third of the tiny step's program. Larger leaves keep their
#: own draw, fused into the gate that reads it (nothing materialised).
GROUP_BELOW = 1 << 16


def uniform_many(
    keys: Sequence[jax.Array], shapes: Sequence[Sequence[int]]
) -> list[jax.Array]:
    """``[uniform(k, s) for k, s in zip(keys, shapes)]``, the same numbers bit
    for bit, with the small draws of one shape computed as one hash (the
    keys stacked along a leading axis; :data:`GROUP_BELOW`)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    keys = list(keys)
    if len(keys) != len(shapes):
        raise ValueError(f"{len(keys)} keys for {len(shapes)} shapes")
    words = [_key_words(k) for k in keys]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (w, shape) in enumerate(zip(words, shapes, strict=True)):
        if _hashable(w, shape) and math.prod(shape) < GROUP_BELOW:
            groups.setdefault(shape, []).append(i)
    out: list[jax.Array | None] = [None] * len(keys)
    for shape, members in groups.items():
        if len(members) < 2:
            continue
        k1 = jnp.stack([words[i][0] for i in members])
        k2 = jnp.stack([words[i][1] for i in members])
        drawn = _stacked_of_words(k1, k2, shape)
        for j, i in enumerate(members):
            out[i] = drawn[j]
    return [
        u if u is not None else uniform(k, s)
        for u, k, s in zip(out, keys, shapes, strict=True)
    ]


@functools.partial(jax.jit, static_argnums=(2,), inline=True)
def _stacked_of_words(k1: jax.Array, k2: jax.Array, shape: tuple[int, ...]):
    """``[n, *shape]``: row ``i`` is ``_uniform_of_words(k1[i], k2[i], shape)``."""
    lead = (k1.shape[0],) + (1,) * len(shape)
    return _to_unit_float((k1.reshape(lead), k2.reshape(lead)), _counter(shape)[None])


def uniform_rows(
    key: jax.Array, shape: Sequence[int], rows: jax.Array, dtype=jnp.float32
) -> jax.Array:
    """Rows ``rows`` (int [R]) of ``uniform(key, shape)``: [R, *shape[1:]].

    Each element's counter is its row-major index in the full array, so the
    numbers are those the full draw puts there, computed for the rows alone.
    """
    shape = tuple(int(d) for d in shape)
    words = _key_words(key)
    if not _hashable(words, shape, dtype):
        return jnp.take(jax.random.uniform(key, shape, dtype), rows, axis=0)
    return _rows_of_words(words[0], words[1], jnp.asarray(rows), shape)


@functools.partial(jax.jit, static_argnums=(3,), inline=True)
def _rows_of_words(k1, k2, rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """:func:`uniform_rows` from the key's words (traced once per shape)."""
    rows = rows.astype(jnp.uint32)
    out_shape = (rows.shape[0],) + shape[1:]
    strides = np.cumprod((1,) + shape[:0:-1])[::-1]
    counter = jax.lax.broadcast_in_dim(rows, out_shape, (0,)) * np.uint32(strides[0])
    for axis in range(1, len(shape)):
        counter = counter + jax.lax.broadcasted_iota(
            jnp.uint32, out_shape, axis
        ) * np.uint32(strides[axis])
    return _to_unit_float((k1, k2), counter)


def _to_unit_float(words, counter: jax.Array) -> jax.Array:
    """``jax.random.uniform``'s float32 in [0, 1) from the hash of counters."""
    shape = jnp.broadcast_shapes(counter.shape, jnp.shape(words[0]))
    zeros = jnp.zeros(shape, jnp.uint32)
    b1, b2 = threefry2x32(words[0], words[1], zeros, jnp.broadcast_to(counter, shape))
    bits = (b1 ^ b2) >> np.uint32(9) | _ONE_BITS
    floats = jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(1.0)
    return jnp.maximum(np.float32(0.0), floats)
