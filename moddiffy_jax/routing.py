"""Per-example diff routing: one forward where each example carries its own
diff weights.

Example ``b`` of a batch runs on ``core + sum_k w[b, k] * D_k``: one row
with the gender diff, the next with the age diff, the next with the core
alone, in one jitted call that never recompiles when the mix changes (the
weights are an argument). The composed weights are never materialised per
example. Every layer computes its core output once and adds the diffs'
contributions:

* Dense kernels: the sparse diff's entries ``(i, o, v)`` of all K diffs act
  as ``y[b, ..., o] += w[b, k] * v * x[b, ..., i]`` (a gather of the
  inputs, a scatter-add of the products): ``O(B * L * nnz)`` work, about the
  diff's density (1%) of the core's matmul per diff.
* Biases, LayerNorm scales and biases: ``[B, n]`` per-example vectors
  (``w @ D``), added (a LayerNorm's scale term is ``x_hat * dscale``).
* Embedding tables: each diff's table entries gathered at the example's ids
  (position and token-type rows broadcast over the batch).

Usage::

    routed = routing.RoutedDiffs.build(core, [gender, age])
    out = routing.encode(bert_config, core, routed, weights, batch)
    # weights[b] = [1, 0] (gender), [0, 1] (age), [0, 0] (core), [1, 1] (both)

The model's modules are left untouched: the contributions are added by a
``flax.linen.intercept_methods`` interceptor around the encoder's Dense,
Embed and LayerNorm calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets.selection import flatten

PyTree = Any


@flax.struct.dataclass
class RoutedDiffs:
    """K diffs in the layout the routed forward reads (arrays are pytree
    leaves, so a new set of diffs with the same sizes does not recompile).

    Attributes:
      kernels: ``{module_path: (rows, cols, values, diff_ids)}`` over the
        entries of all K diffs in that Dense kernel ([in, out] layout).
      vectors: ``{param_path: [K, n]}`` dense per-diff biases and LayerNorm
        parameters.
      tables: ``{module_path: [K, V, H]}`` dense per-diff embedding tables.
      dense_kernels: ``{module_path: [K, in, out]}``: the kernels' diffs as
        dense arrays (``kernels="dense"``), applied as K extra matmuls.
      num_diffs: K.
    """

    kernels: dict[str, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]
    vectors: dict[str, jax.Array]
    tables: dict[str, jax.Array]
    dense_kernels: dict[str, jax.Array] = flax.struct.field(default_factory=dict)
    num_diffs: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def build(
        cls, base: PyTree, diffs: Sequence[Any], *, kernels: str = "sparse"
    ) -> RoutedDiffs:
        """From :class:`SparseDiff` objects made on ``base`` (host side, once
        per set of diffs). ``kernels``: "sparse" (gather/scatter of the
        entries: work proportional to the diffs' size) or "dense" (K dense
        [in, out] arrays and K extra matmuls: faster where scatters are slow,
        e.g. XLA on CPU; BENCHMARKS.md).

        Raises:
          ValueError: a diff leaf the routed forward cannot apply (e.g.
            adapters), naming it.
        """
        flat = flatten(base)
        k_all = len(diffs)
        kernel_parts: dict[str, list] = {}
        vectors: dict[str, np.ndarray] = {}
        tables: dict[str, np.ndarray] = {}
        for k, diff in enumerate(diffs):
            for path, shape in diff.shapes:
                if path not in flat:
                    raise ValueError(f"diff {k} names {path}, which the base lacks.")
                idx = np.asarray(diff.indices[path], np.int64)
                val = np.asarray(diff.values[path], np.float32)
                module, leaf = path.rsplit("/", 1)
                if leaf == "kernel" and len(shape) == 2:
                    rows, cols = np.divmod(idx, shape[1])
                    kernel_parts.setdefault(module, []).append(
                        (rows, cols, val, np.full(idx.shape, k, np.int32))
                    )
                elif leaf == "embedding" and len(shape) == 2:
                    table = tables.setdefault(
                        module, np.zeros((k_all, *shape), np.float32)
                    )
                    table[k].reshape(-1)[idx] += val
                elif leaf in ("bias", "scale") and len(shape) == 1:
                    vec = vectors.setdefault(
                        path, np.zeros((k_all, *shape), np.float32)
                    )
                    vec[k][idx] += val
                else:
                    raise ValueError(
                        f"{path} {tuple(shape)}: the routed forward applies diffs "
                        "of Dense kernels and biases, LayerNorm parameters and "
                        "embedding tables only."
                    )
        if kernels not in ("sparse", "dense"):
            raise ValueError(f"kernels={kernels!r}; use 'sparse' or 'dense'.")
        dense: dict[str, jax.Array] = {}
        if kernels == "dense":
            for module, parts in kernel_parts.items():
                shape = np.shape(flat[f"{module}/kernel"])
                table = np.zeros((k_all, *shape), np.float32)
                for rows, cols, vals, ids in parts:
                    np.add.at(table, (ids, rows, cols), vals)
                dense[module] = jnp.asarray(table)
            kernel_parts = {}
        out_kernels = {}
        for module, parts in kernel_parts.items():
            rows, cols, vals, ids = (
                np.concatenate(x) for x in zip(*parts, strict=True)
            )
            out_kernels[module] = (
                jnp.asarray(rows, jnp.int32),
                jnp.asarray(cols, jnp.int32),
                jnp.asarray(vals),
                jnp.asarray(ids),
            )
        return cls(
            kernels=out_kernels,
            vectors={p: jnp.asarray(v) for p, v in vectors.items()},
            tables={p: jnp.asarray(t) for p, t in tables.items()},
            dense_kernels=dense,
            num_diffs=k_all,
        )


def _per_example(contrib: jax.Array, ndim: int) -> jax.Array:
    """``[B, n]`` -> ``[B, 1, ..., n]`` for an output of ``ndim`` dims."""
    return contrib.reshape(contrib.shape[0], *([1] * (ndim - 2)), contrib.shape[-1])


def _interceptor(routed: RoutedDiffs, weights: jax.Array):
    """Adds each example's diff contributions to the outputs of the encoder's
    Dense, Embed and LayerNorm calls."""

    def vector(path: str) -> jax.Array | None:
        v = routed.vectors.get(path)
        return None if v is None else weights @ v  # [B, n]

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not module.path:
            return next_fun(*args, **kwargs)
        name = "/".join(module.path)
        y = next_fun(*args, **kwargs)
        if isinstance(module, nn.Dense):
            x = args[0]
            if name in routed.kernels:
                rows, cols, vals, ids = routed.kernels[name]
                scale = vals[None, :] * weights[:, ids]  # [B, nnz]
                prod = x[..., rows] * _per_example(scale, x.ndim)  # [B, ..., nnz]
                zeros = jnp.zeros((*x.shape[:-1], y.shape[-1]), prod.dtype)
                y = y + zeros.at[..., cols].add(prod).astype(y.dtype)
            elif name in routed.dense_kernels:
                per_diff = jnp.einsum(
                    "b...i,kio->b...ko", x, routed.dense_kernels[name]
                )
                w = weights.reshape(weights.shape[0], *([1] * (x.ndim - 2)), -1, 1)
                y = y + (per_diff * w).sum(-2).astype(y.dtype)
            bias = vector(f"{name}/bias")
            if bias is not None:
                y = y + _per_example(bias, y.ndim).astype(y.dtype)
        elif isinstance(module, nn.LayerNorm):
            scale, bias = vector(f"{name}/scale"), vector(f"{name}/bias")
            if scale is not None:
                x = args[0].astype(jnp.float32)
                mean = x.mean(-1, keepdims=True)
                var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
                x_hat = (x - mean) * jax.lax.rsqrt(var + module.epsilon)
                y = y + (x_hat * _per_example(scale, x.ndim)).astype(y.dtype)
            if bias is not None:
                y = y + _per_example(bias, y.ndim).astype(y.dtype)
        elif name in routed.tables:  # nn.Embed and the word-row embedding
            ids = args[0]
            rows = routed.tables[name][:, ids]  # [K, b, L, H], b = B or 1
            rows = jnp.broadcast_to(
                rows, (rows.shape[0], weights.shape[0], *rows.shape[2:])
            )
            y = y + jnp.einsum("bk,kb...->b...", weights, rows).astype(y.dtype)
        return y

    return intercept


def encode(
    bert_config: Any,
    core: PyTree,
    routed: RoutedDiffs,
    weights: jax.Array,
    batch: Mapping[str, Any],
    *,
    dtype: Any = jnp.float32,
) -> Any:
    """The encoder's output where example ``b`` uses
    ``core + sum_k weights[b, k] * D_k`` (eval mode).

    Args:
      bert_config: the encoder's :class:`BertConfig`.
      core: the encoder params the diffs were made on.
      routed: :meth:`RoutedDiffs.build` of the K diffs.
      weights: ``[B, K]`` per-example diff weights.
      batch: ``input_ids``, ``attention_mask`` and optionally
        ``token_type_ids``, each ``[B, L]``.

    Returns:
      ``EncoderOutput`` (``last_hidden_state`` [B, L, H], ``pooler_output``).
    """
    from moddiffy_jax.models.bert_model import BertEncoder

    weights = jnp.asarray(weights, jnp.float32)
    if weights.ndim != 2 or weights.shape[1] != routed.num_diffs:
        raise ValueError(
            f"weights must be [B, {routed.num_diffs}] (one per example and "
            f"diff), got {weights.shape}."
        )
    if weights.shape[0] != np.shape(batch["input_ids"])[0]:
        raise ValueError(
            f"weights has {weights.shape[0]} rows for a batch of "
            f"{np.shape(batch['input_ids'])[0]} examples."
        )
    encoder = BertEncoder(bert_config, dtype=dtype)
    with nn.intercept_methods(_interceptor(routed, weights)):
        return encoder.apply(
            {"params": core},
            jnp.asarray(batch["input_ids"]),
            jnp.asarray(batch["attention_mask"]),
            None
            if batch.get("token_type_ids") is None
            else jnp.asarray(batch["token_type_ids"]),
            deterministic=True,
        )
