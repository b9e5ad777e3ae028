"""Token-merge diffs (methods/token_merge.py)."""

import jax
import numpy as np
import pytest

from moddiffy_jax.methods import token_merge
from moddiffy_jax.methods.word_rows import WORD_TABLE
from moddiffy_jax.models import bert
from moddiffy_jax.subnets import diff_files, selection
from moddiffy_jax.subnets import sparse_diff as sparse_lib
from tests.helpers import bag_of_rows as _bag_of_rows
from tests.helpers import planted_split as _planted_split

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    config = bert.BertConfig.tiny(vocab_size=VOCAB)
    return config, bert.init_params(config, jax.random.key(0, impl="rbg"))


def _hidden(config, params, ids):
    ids = np.asarray([ids], np.int32)
    out = bert.encode(config, params, (ids, np.ones_like(ids)))
    return np.asarray(out.last_hidden_state[0])


def test_merged_tokens_cannot_be_told_apart_anywhere(model):
    config, params = model
    target = token_merge.merge_target(params, [5, 6, 7])
    diff = token_merge.merge_diff(params, [5, 6], target, name="gender")
    merged = sparse_lib.apply_diffs(params, [diff])
    hidden = config.hidden_size
    assert diff.nnz_per_leaf() == {WORD_TABLE: 2 * hidden}
    assert diff.base_fingerprint == sparse_lib.fingerprint(params)
    assert diff.info["tokens"] == [5, 6]
    table = np.asarray(selection.flatten(merged)[WORD_TABLE])
    base = np.asarray(selection.flatten(params)[WORD_TABLE])
    np.testing.assert_allclose(table[[5, 6]], np.stack([target, target]), atol=1e-7)
    np.testing.assert_array_equal(table[7:], base[7:])  # 7 is a candidate only
    np.testing.assert_array_equal(table[:5], base[:5])
    # Two sentences that differ only in a merged token encode alike; a merged
    # and an unmerged token still differ.
    a = _hidden(config, merged, [2, 5, 9, 3])
    b = _hidden(config, merged, [2, 6, 9, 3])
    c = _hidden(config, merged, [2, 8, 9, 3])
    assert np.abs(a - b).max() < 1e-5
    assert np.abs(a - c).max() > 1e-2
    # Before the merge they differed.
    assert (
        np.abs(
            _hidden(config, params, [2, 5, 9, 3])
            - _hidden(config, params, [2, 6, 9, 3])
        ).max()
        > 1e-2
    )


def test_a_merge_diff_is_an_ordinary_diff_file(model, tmp_path):
    _, params = model
    target = token_merge.merge_target(params, [3, 4])
    diff = token_merge.merge_diff(params, [3, 4], target, name="age", info={"k": 2})
    path = diff_files.save_sparse_diff(tmp_path / "age.safetensors", diff)
    back = diff_files.load_sparse_diff(path, base=params)
    assert back.name == "age" and back.info["method"] == "token_merge"
    assert back.info["k"] == 2
    np.testing.assert_array_equal(
        np.asarray(back.values[WORD_TABLE]), np.asarray(diff.values[WORD_TABLE])
    )


def test_merge_target_is_the_candidates_mean(model):
    _, params = model
    base = np.asarray(selection.flatten(params)[WORD_TABLE])
    np.testing.assert_allclose(
        token_merge.merge_target(params, [1, 2, 9]), base[[1, 2, 9]].mean(0), atol=1e-7
    )


@pytest.mark.parametrize(
    "ids, message",
    [([], "No candidate"), ([3, 3], "distinct"), ([VOCAB], r"\[0, 40\)")],
)
def test_bad_tokens_are_refused(model, ids, message):
    _, params = model
    with pytest.raises(ValueError, match=message):
        token_merge.merge_target(params, ids)


def test_params_without_a_word_table_are_refused():
    with pytest.raises(ValueError, match="word-embedding table"):
        token_merge.merge_target({"dense": {"kernel": np.zeros((2, 2))}}, [0])


def test_monotone_fit_pools_violators():
    np.testing.assert_allclose(
        token_merge.monotone_fit([0.0, 1.2, 1.6, 2.0, 2.0, 1.7]),
        [0.0, 1.2, 1.6, 1.9, 1.9, 1.9],
    )
    np.testing.assert_allclose(token_merge.monotone_fit([3.0, 1.0]), [2.0, 2.0])
    np.testing.assert_allclose(token_merge.monotone_fit([1.0, 2.0]), [1.0, 2.0])


def test_choose_count_reads_the_fitted_costs_not_a_lucky_one():
    ranked = [10, 11, 12, 13, 14, 15]
    costs = {1: 0.0, 2: 0.6, 3: 0.8, 4: 1.4, 5: 0.2, 6: 3.0}  # noisy, not monotone
    seen = []

    def drop(ids):
        seen.append(list(ids))
        return costs[len(ids)]

    k, read = token_merge.choose_count(ranked, drop, max_drop=1.0)
    # Sizes 4 and 5 pool to 0.8: both within budget; 6 is not.
    assert k == 5
    assert [r["cost"] for r in read] == [costs[n] for n in range(1, 7)]
    np.testing.assert_allclose(
        [r["fitted"] for r in read], [0, 0.6, 0.8, 0.8, 0.8, 3.0]
    )
    assert seen[1] == [10, 11]  # prefixes of the ranking
    # A lucky low read after an expensive one does not pass by itself.
    costs = {1: 0.0, 2: 2.0, 3: 2.0, 4: 0.5, 5: 3.0, 6: 3.0}
    k, _ = token_merge.choose_count(ranked, lambda ids: costs[len(ids)], 1.0)
    assert k == 1
    # Costs summed in floating point land just above a budget they meet.
    k, _ = token_merge.choose_count(
        ranked, lambda ids: 0.1 * 3 if len(ids) < 3 else 9.0, 0.3
    )
    assert k == 2
    k, _ = token_merge.choose_count(ranked, lambda ids: 5.0, 1.0, counts=[2, 4])
    assert k == 0
    with pytest.raises(ValueError, match="ascending"):
        token_merge.choose_count(ranked, drop, 1.0, counts=[2, 2])
    with pytest.raises(ValueError, match="lie in"):
        token_merge.choose_count(ranked, drop, 1.0, counts=[1, 7])


def test_choose_count_stops_once_the_floor_is_reached():
    ranked = [10, 11, 12, 13, 14, 15]
    costs = {1: 0.0, 2: 0.2, 3: 0.4, 4: 0.6, 5: 0.8, 6: 0.9}
    leaks = {1: 0.97, 2: 0.93, 3: 0.90, 4: 0.89, 5: 0.80, 6: 0.70}
    probed = []

    def leak(ids):
        probed.append(len(ids))
        return leaks[len(ids)]

    def drop(ids):
        return costs[len(ids)]

    k, read = token_merge.choose_count(ranked, drop, 1.0, leakage=leak, floor=0.895)
    assert k == 4  # the first size at the floor
    assert probed == [1, 2, 3, 4]
    assert read[3] == {"size": 4, "cost": 0.6, "fitted": 0.6, "leakage": 0.89}
    assert "leakage" not in read[4]
    # Never at the floor within budget: the longest prefix within budget.
    k, _ = token_merge.choose_count(ranked, drop, 0.7, leakage=leak, floor=0.5)
    assert k == 4
    with pytest.raises(ValueError, match="together"):
        token_merge.choose_count(ranked, drop, 1.0, leakage=leak)
    # Asked for half of the gap from 0.99 to the floor (0.895): it stops at
    # the first leakage at or below 0.9425, not at the floor.
    probed.clear()
    k, _ = token_merge.choose_count(
        ranked, drop, 1.0, leakage=leak, floor=0.895, start=0.99, target=0.5
    )
    assert k == 2 and probed == [1, 2]
    assert token_merge.stop_level(0.895, 0.0, 0.99, 0.5) == pytest.approx(0.9425)
    assert token_merge.stop_level(0.895, 0.01, 0.99, 1.0) == pytest.approx(0.905)
    with pytest.raises(ValueError, match="target"):
        token_merge.choose_count(
            ranked, drop, 1.0, leakage=leak, floor=0.895, start=0.99, target=0.0
        )


def test_the_floor_stop_allows_the_probes_noise():
    ranked = [10, 11, 12]
    leaks = {1: 0.95, 2: 0.755, 3: 0.72}
    k, _ = token_merge.choose_count(
        ranked, lambda ids: 0.0, 1.0, leakage=lambda ids: leaks[len(ids)], floor=0.74
    )
    assert k == 3
    se = token_merge.balanced_accuracy_se(0.74, [0] * 250 + [1] * 250)
    assert se == pytest.approx(np.sqrt(2 * 0.74 * 0.26 / 250) / 2)
    k, _ = token_merge.choose_count(
        ranked,
        lambda ids: 0.0,
        1.0,
        leakage=lambda ids: leaks[len(ids)],
        floor=0.74,
        tolerance=se,
    )
    assert k == 2  # 0.755 is within one standard error (0.0196) of 0.74


def test_build_merges_refuses_a_negative_floor_z():
    with pytest.raises(ValueError, match="floor_z"):
        token_merge.build_merges(
            None, None, None, {}, lambda p, s: None, None, floor_z=-1.0
        )


@pytest.mark.parametrize("task_reads_attr_rows", [False, True])
def test_build_merges_merges_the_attributes_tokens_within_the_budget(
    model, task_reads_attr_rows
):
    _, params = model
    table = np.asarray(selection.flatten(params)[WORD_TABLE])
    train, dev = _planted_split(400, 0), _planted_split(200, 1)
    # The head reads the task tokens' rows, or (second case) the attribute
    # tokens' rows, so that merging them costs the task.
    a, b = (20, 21) if task_reads_attr_rows else (10, 11)
    direction = table[b] - table[a]
    midpoint = (table[a] + table[b]) / 2 / 5 + table[30:40].mean(0) * 3 / 5

    def predict(h):
        return ((h - midpoint) @ direction > 0).astype(np.int32)

    if task_reads_attr_rows:  # the task follows the attribute 80% of the time
        for i, split in enumerate((train, dev)):
            flip = np.random.default_rng(10 + i).random(len(split)) < 0.2
            split.task[:] = np.where(flip, 1 - split.attrs["a"], split.attrs["a"])
    core_rep = _bag_of_rows(params, dev)
    assert np.mean(predict(core_rep) == dev.task) > 0.7  # the head works
    choices = token_merge.build_merges(
        params, train, dev, {"a": 2}, _bag_of_rows, predict, max_drop=1.5
    )
    choice = choices["a"]
    assert choice.tolerance == pytest.approx(  # the stop's margin: one SE
        token_merge.balanced_accuracy_se(choice.floor, dev.attrs["a"])
    )
    if task_reads_attr_rows:
        # Merging 20 or 21 costs the task more than the budget: nothing is
        # merged.
        assert choice.merged == 0 and choice.diff is None
        assert set(choice.ranked[:2]) == {20, 21}
        assert min(r["fitted"] for r in choice.read) > 1.5
        return
    assert set(choice.ranked[: choice.merged]) == {20, 21}
    assert choice.diff.info["tokens"] == sorted(choice.ranked[:2])
    merged = sparse_lib.apply_diffs(params, [choice.diff])
    rows = np.asarray(selection.flatten(merged)[WORD_TABLE])
    np.testing.assert_allclose(rows[20], rows[21], atol=1e-6)
    # It stopped at the floor (0.5 here): the last read leaks no more.
    assert choice.read[-1]["leakage"] <= choice.floor + choice.tolerance
    assert choice.summary()["tokens"] == list(choice.ranked[:2])


def test_represent_merged_encodes_only_the_examples_holding_merged_tokens(model):
    _, params = model
    split = _planted_split(50, 2)
    target = token_merge.merge_target(params, [20, 21])
    merged = sparse_lib.apply_diffs(
        params, [token_merge.merge_diff(params, [20], target, name="a")]
    )
    seen = []

    def represent(p, s):
        seen.append(len(s))
        return _bag_of_rows(p, s)

    base = _bag_of_rows(params, split)
    out = token_merge.represent_merged(represent, merged, split, base, [20])
    np.testing.assert_allclose(out, _bag_of_rows(merged, split), atol=1e-7)
    holding = token_merge.changed_rows(split, [20])
    assert seen == [len(holding)] and 0 < len(holding) < len(split)
    assert np.all(split.input_ids[holding, 1] == 20)
    kept = np.setdiff1d(np.arange(len(split)), holding)
    np.testing.assert_array_equal(out[kept], base[kept])


def test_paired_drop_and_its_standard_error():
    before = np.array([1, 1, 1, 0], bool)
    after = np.array([0, 1, 1, 1], bool)  # one lost, one gained
    cost, se = token_merge.paired_drop(before, after)
    assert cost == 0.0
    assert se == pytest.approx(100 * np.sqrt(0.5 / 4))
    cost, se = token_merge.paired_drop(before, before)
    assert (cost, se) == (0.0, 0.0)
    with pytest.raises(ValueError, match="No examples"):
        token_merge.paired_drop(np.zeros(0), np.zeros(0))


def test_choose_count_counts_the_reads_noise_against_the_budget():
    ranked = [10, 11, 12]
    reads = {1: (0.5, 0.1), 2: (1.0, 0.2), 3: (1.2, 0.5)}

    def drop(ids):
        return reads[len(ids)]

    k, read = token_merge.choose_count(ranked, drop, 1.5)
    assert k == 3 and read[-1]["bound"] == pytest.approx(1.2)
    k, read = token_merge.choose_count(ranked, drop, 1.5, cost_z=1.0)
    assert k == 2  # 1.2 + 0.5 > 1.5
    assert [r["bound"] for r in read] == pytest.approx([0.6, 1.2, 1.7])
    assert [r["se"] for r in read] == [0.1, 0.2, 0.5]
    with pytest.raises(ValueError, match="cost_z"):
        token_merge.choose_count(ranked, drop, 1.5, cost_z=-1.0)


def _two_word_sets(n, seed):
    """Attribute 0 spelled by tokens 20 / 22 (a quarter of the examples
    each), attribute 1 by 21 / 23 / 25 / 27 (an eighth each): the ranking by
    information puts the two frequent tokens of class 0 first."""
    return _planted_split(n, seed, attr_words=((20, 22), (21, 23, 25, 27)))


def test_merge_order_mixes_the_classes_so_that_short_prefixes_remove(model):
    from moddiffy_jax.eval import removal
    from moddiffy_jax.methods import word_rows

    _, params = model
    train, dev = _two_word_sets(400, 0), _two_word_sets(400, 1)
    ranked = word_rows.attribute_tokens(train, ["a"], 8, 0.0, VOCAB)["a"]
    order = token_merge.merge_order(train, "a", ranked)
    assert sorted(order) == sorted(ranked)  # a reordering
    assert set(ranked[:2]) == {20, 22}  # two words of one class
    assert order[0] == ranked[0] and order[1] in (21, 23, 25, 27)
    # Within each class the ranking's order is kept.
    for words in ((20, 22), (21, 23, 25, 27)):
        assert [t for t in order if t in words] == [t for t in ranked if t in words]
    greedy = token_merge.merge_order(train, "a", ranked, "greedy")
    assert sorted(greedy) == sorted(ranked) and greedy[1] in (21, 23, 25, 27)
    with pytest.raises(ValueError, match="how"):
        token_merge.merge_order(train, "a", ranked, "random")
    table = np.asarray(selection.flatten(params)[WORD_TABLE])
    target = token_merge.merge_target(params, ranked)

    def leakage(ids):
        t = table.copy()
        t[ids] = target
        merged = selection.unflatten({**selection.flatten(params), WORD_TABLE: t})
        return removal.fresh_linear_leakage(
            {"train": _bag_of_rows(merged, train), "dev": _bag_of_rows(merged, dev)},
            {"train": train.attrs["a"], "dev": dev.attrs["a"]},
            num_classes=2,
        )

    # Merging the two class-0 words leaves "the merged row" a class-0
    # marker (nothing removed); one word of each class removes.
    assert leakage(ranked[:2]) > 0.97
    assert leakage(order[:2]) < leakage(ranked[:2]) - 0.1


def _role_split(n, seed):
    """The attribute's words play two parts: 20 (class 0) / 21 (class 1) in
    the first slot, 22 / 23 in the second (like "she" / "he" and "her" /
    "his"); the other slot holds a filler."""
    from moddiffy_jax.data.dataset import TokenizedSplit

    rng = np.random.default_rng(seed)
    task, attr = rng.integers(0, 2, n), rng.integers(0, 2, n)
    second = rng.integers(0, 2, n).astype(bool)
    word = np.where(second, 22, 20) + attr
    slots = np.where(second[:, None], [[30, 0]], [[0, 30]])
    slots[np.arange(n), second.astype(int)] = word
    ids = np.concatenate(
        [(10 + task)[:, None], slots, rng.integers(31, 40, (n, 2))], axis=1
    ).astype(np.int32)
    return TokenizedSplit(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        token_type_ids=np.zeros_like(ids),
        task=task.astype(np.int32),
        attrs={"a": attr.astype(np.int32)},
    )


def test_counterparts_merge_where_one_shared_row_stays_telling(model):
    from moddiffy_jax.eval import removal
    from moddiffy_jax.methods import word_rows

    _, params = model
    flat = selection.flatten(params)
    table = np.array(flat[WORD_TABLE])
    rng = np.random.default_rng(0)
    # Counterparts have near rows (as "she" and "he" do in MiniLM).
    table[21] = table[20] + 0.05 * rng.normal(size=table.shape[1])
    table[23] = table[22] + 0.05 * rng.normal(size=table.shape[1])
    params = selection.unflatten({**flat, WORD_TABLE: table})
    train, dev = _role_split(600, 0), _role_split(600, 1)
    ranked = word_rows.attribute_tokens(train, ["a"], 8, 0.2, VOCAB)["a"]
    assert sorted(ranked) == [20, 21, 22, 23]
    groups = token_merge.counterpart_groups(train, "a", ranked, table)
    assert sorted(sorted(g.tolist()) for g in groups) == [[20, 21], [22, 23]]
    assert groups[0][0] == ranked[0]  # groups in the order of their first token

    def leakage(token_ids, rows):
        t = table.copy()
        t[token_ids] = rows

        def represent(split):  # a stand-in encoder that sees the slots
            return t[split.input_ids[:, 1:3]].reshape(len(split.task), -1)

        return removal.fresh_linear_leakage(
            {"train": represent(train), "dev": represent(dev)},
            {"train": train.attrs["a"], "dev": dev.attrs["a"]},
            num_classes=2,
        )

    assert leakage([], table[[]]) > 0.97
    # One word of each class in one shared row: the slot still tells them apart.
    shared = token_merge.merge_target(params, [20, 23])
    assert leakage([20, 23], shared) > 0.97
    # Both counterpart groups merged: nothing left to read.
    order = np.concatenate(groups)
    assert leakage(order, token_merge.merge_target(params, order)) < 0.6
    # A token with no counterpart of the other class left is not merged.
    assert token_merge.counterpart_groups(train, "a", [20, 21, 22], table)[-1].size == 2
    assert len(token_merge.counterpart_groups(train, "a", [20, 21, 22], table)) == 1


@pytest.mark.parametrize("order", ["balanced", "counterparts"])
def test_build_merges_reads_every_prefix_encoding_each_example_once(model, order):
    _, params = model
    train, dev = _two_word_sets(300, 2), _two_word_sets(200, 3)
    table = np.asarray(selection.flatten(params)[WORD_TABLE])
    direction = table[11] - table[10]
    threshold = np.median(_bag_of_rows(params, train) @ direction)

    def predict(h):
        return (h @ direction > threshold).astype(np.int32)

    encoded = []

    def represent(p, split):
        encoded.append(len(split))
        return _bag_of_rows(p, split)

    choice = token_merge.build_merges(
        params,
        train,
        dev,
        {"a": 2},
        represent,
        predict,
        max_drop=100.0,
        floor_stop=False,
        select_train=300,
        order=order,
    )["a"]
    ranked = np.asarray(choice.ranked)
    if order == "counterparts":  # whole groups: one word of each class
        assert choice.groups == (2, 2)
        sizes = [2, 4]
        summary = choice.summary()
        assert summary["groups"] == [list(ranked[:2]), list(ranked[2:])]
    else:
        sizes = list(range(1, len(ranked) + 1))
    target = token_merge.merge_target(params, ranked)
    assert [r["size"] for r in choice.read] == sizes
    # The core once per split, then each example holding a candidate once.
    holding = sum(len(token_merge.changed_rows(s, choice.ranked)) for s in (train, dev))
    assert sum(encoded) == len(train) + len(dev) + holding
    # Each incremental read equals merging that prefix from scratch.
    pooled = np.concatenate([train.task, dev.task])
    right = (
        np.concatenate([predict(_bag_of_rows(params, s)) for s in (train, dev)])
        == pooled
    )
    for rec in choice.read:
        t = table.copy()
        t[list(ranked[: rec["size"]])] = target
        merged = selection.unflatten({**selection.flatten(params), WORD_TABLE: t})
        now = np.concatenate([predict(_bag_of_rows(merged, s)) for s in (train, dev)])
        cost, se = token_merge.paired_drop(right, now == pooled)
        assert rec["cost"] == pytest.approx(cost) and rec["se"] == pytest.approx(se)
