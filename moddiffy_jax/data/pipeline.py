"""Input pipeline: a checkpointable, infinite train iterator and padded eval passes.

Batches are dicts of numpy arrays (sharding is the caller's job)::

    {"input_ids", "attention_mask", "token_type_ids": int32 [B, L],
     "task": int32 [B], "attrs": {name: int32 [B]}}

Eval batches add ``"weight": float32 [B]`` (1 real, 0 padding).

The train order is grain's per-epoch shuffle of the example indices (the
order of ``range(N).shuffle(seed).repeat()``: grain reseeds the shuffle each
epoch; its index shuffle is called directly) read through a step index
(``range(steps_per_epoch).repeat().map_with_index(...)``). Step ``s`` of
epoch ``e`` takes positions ``[s*B, (s+1)*B)`` of epoch ``e``'s permutation,
so each epoch drops its ``N mod B`` remainder and no batch straddles two
epochs. The grain iterator state is just the next step index, so a restored
iterator yields exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import grain
import numpy as np

from moddiffy_jax.data.dataset import TokenizedSplit

_index_shuffle = grain.experimental.index_shuffle


def _shuffle_seed(seed: int) -> int:
    # grain seeds epoch e with (seed + e), so seeds 0 and 1 would share shifted
    # permutations; hashing the seed first keeps runs with seeds 0..4 distinct.
    return int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])


class TrainIterator:
    """Infinite, per-epoch shuffled, fixed-size train batches with restorable state.

    Example::

        it = TrainIterator(ds.splits["train"], batch_size=32, seed=0)
        batch = next(it)
        state = it.get_state()        # JSON-serialisable; save with the checkpoint
        it2 = TrainIterator(ds.splits["train"], batch_size=32, seed=0)
        it2.set_state(state)          # next(it2) == next(it)

    Attributes:
      steps_per_epoch: ``N // batch_size`` (the remainder is dropped per epoch).
      batch_size: the fixed global batch size ``B`` (each of ``shard_count``
        shards yields ``B / shard_count`` rows per step).
    """

    def __init__(
        self,
        split: TokenizedSplit,
        *,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        shard_count: int = 1,
        num_threads: int = 1,
        prefetch_buffer_size: int = 4,
    ):
        """Builds the iterator at step 0.

        Args:
          split: the tokenized train split (``N`` examples).
          batch_size: global batch size ``B``; must satisfy ``1 <= B <= N``.
          seed: shuffle seed (non-negative int).
          shard_index: this process's shard (multi-host: ``jax.process_index()``).
          shard_count: number of shards (``jax.process_count()``); must divide
            ``B``. Each shard yields its contiguous ``B / shard_count`` rows of
            the same global batch, so the shards together see each global batch
            exactly once. The state does not depend on the shard, so a run can
            resume on a different number of hosts.
          num_threads: grain reader threads (0 reads in the calling thread).
          prefetch_buffer_size: batches prefetched ahead.
        """
        n = len(split)
        if not 1 <= batch_size <= n:
            raise ValueError(
                f"batch_size must be in [1, {n}] (the split size), got {batch_size}: "
                "set config.train.batch_size."
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}.")
        if shard_count < 1 or batch_size % shard_count:
            raise ValueError(
                f"shard_count ({shard_count}) must be >= 1 and divide batch_size "
                f"({batch_size})."
            )
        if not 0 <= shard_index < shard_count:
            raise ValueError(
                f"shard_index must be in [0, {shard_count}), got {shard_index}."
            )
        local = batch_size // shard_count
        self.batch_size = batch_size
        self.steps_per_epoch = n // batch_size
        self._fingerprint = {"num_examples": n, "batch_size": batch_size, "seed": seed}
        base_seed = _shuffle_seed(seed)
        steps_per_epoch = self.steps_per_epoch

        def make_batch(step: int, _) -> dict:
            epoch, j = divmod(step, steps_per_epoch)
            start = j * batch_size + shard_index * local
            # grain's own per-epoch shuffle, called directly: the same order
            # as range(n).shuffle(base_seed).repeat() (tests/test_data.py),
            # without that graph's per-index Python layers, which took 30 ms
            # of the host's GIL per 256-example batch on a GPU host (stop 47).
            epoch_seed = (base_seed + epoch) % 2**32
            idx = np.fromiter(
                (
                    _index_shuffle(i, max_index=n - 1, seed=epoch_seed, rounds=4)
                    for i in range(start, start + local)
                ),
                dtype=np.int64,
                count=local,
            )
            return split.take(idx)

        ds = grain.MapDataset.range(steps_per_epoch).repeat().map_with_index(make_batch)
        self._iter = ds.to_iter_dataset(
            grain.ReadOptions(
                num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size
            )
        ).__iter__()

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict:
        return next(self._iter)

    @property
    def step(self) -> int:
        """Number of batches returned so far (the next batch's global index)."""
        return int(self._iter.get_state()["next_index"])

    def get_state(self) -> dict:
        """Returns a JSON-serialisable state to resume from.

        Returns:
          ``{"grain": <grain iterator state>, "step": int, "epoch": int,
          "num_examples": int, "batch_size": int, "seed": int}``.
        """
        grain_state = self._iter.get_state()
        step = int(grain_state["next_index"])
        return {
            "grain": grain_state,
            "step": step,
            "epoch": step // self.steps_per_epoch,
            **self._fingerprint,
        }

    def set_state(self, state: dict) -> None:
        """Restores a state from :meth:`get_state` of an equally built iterator.

        Raises:
          ValueError: the state was saved by an iterator over a different number
            of examples, batch size or seed.
        """
        saved = {k: state.get(k) for k in self._fingerprint}
        if saved != self._fingerprint:
            raise ValueError(
                f"Iterator state was saved for {saved}, this iterator is "
                f"{self._fingerprint}; restoring would not resume the same stream."
            )
        self._iter.set_state(state["grain"])

    def close(self) -> None:
        """Stops the prefetch threads."""
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def num_eval_batches(split: TokenizedSplit, batch_size: int) -> int:
    """Number of batches :func:`eval_batches` yields: ``ceil(N / batch_size)``."""
    return -(-len(split) // batch_size)


def eval_batches(split: TokenizedSplit, batch_size: int) -> Iterator[dict]:
    """Yields one deterministic in-order pass over ``split`` in equal-shape batches.

    The last batch is padded to ``batch_size`` by repeating the split's first
    example (a real input, so no all-padding attention row) with weight 0, so
    every batch has the same shape and jitted eval compiles once. Weighted
    sums over ``"weight"`` give exact split metrics.

    Args:
      split: the tokenized split (``N`` examples, ``N >= 1``).
      batch_size: batch size ``B``.

    Yields:
      Batch dicts as in the module docstring plus ``"weight": float32 [B]``.
    """
    n = len(split)
    if n == 0:
        raise ValueError("Cannot evaluate an empty split.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        idx = np.arange(start, start + batch_size)
        weight = (idx < stop).astype(np.float32)
        idx = np.where(idx < stop, idx, 0)
        batch = split.take(idx)
        batch["weight"] = weight
        yield batch


#: Batch keys that are labels, not model inputs.
LABEL_KEYS = ("task", "attrs", "weight", "extras")


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The model-input part of a batch (token ids and masks, or images)."""
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS}
