"""Tests for moddiffy_jax.data: sources, errors, balancing, tokenization, pipeline."""

import csv
import dataclasses
import importlib.util
import json
import pathlib
import pickle
import sys

import numpy as np
import pytest

from moddiffy_jax import data
from moddiffy_jax.data import synthetic as synthetic_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
DWMW17 = REPO / "../shared/data/dwmw17_dialect/dwmw17_dialect.csv"


def _phi(a, b):
    return float(np.corrcoef(a, b)[0, 1])


def _write_csv(path, rows, header=None):
    header = header or list(rows[0])
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _rows(split, n=6, *, g=("f", "m"), y=("pos", "neg")):
    return [
        {
            "sentence": f"{split} example number {i}",
            "y": y[i % len(y)],
            "gen": g[(i // 2) % len(g)],
            "part": split,
        }
        for i in range(n)
    ]


def _tabular_config(**overrides):
    c = data.default_data_config()
    c.source = "tabular"
    c.name = "toy"
    c.columns.text = "sentence"
    c.columns.task = "y"
    c.attributes = ("gender",)
    c.columns.attributes = {"gender": "gen"}
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_and_marked():
    a = data.load_text_dataset(data.default_data_config())
    b = data.load_text_dataset(data.default_data_config())
    assert a.synthetic and a.name == "synthetic"
    assert {s: len(v) for s, v in a.splits.items()} == {
        "train": 2000,
        "dev": 500,
        "test": 500,
    }
    assert a.attributes == ("gender", "age")
    assert a.attr_classes == {"gender": ("female", "male"), "age": ("old", "young")}
    for s in a.splits:
        assert a.splits[s].text == b.splits[s].text
        np.testing.assert_array_equal(a.splits[s].task, b.splits[s].task)
        for k in a.attributes:
            np.testing.assert_array_equal(a.splits[s].attrs[k], b.splits[s].attrs[k])
    other = data.generate_synthetic(seed=1)
    assert other.splits["train"].text != a.splits["train"].text
    # Splits are fixed by seed: resizing dev does not change train.
    small_dev = data.generate_synthetic(seed=0, num_dev=7)
    assert (
        small_dev.splits["train"].text == data.generate_synthetic().splits["train"].text
    )
    assert data.summarize_dataset(a)["synthetic"] is True


def test_synthetic_correlation_knob():
    ds = data.generate_synthetic(
        num_train=4000, attr_task_correlation={"gender": 0.8, "age": 0.0}
    )
    train = ds.splits["train"]
    assert abs(_phi(train.task, train.attrs["gender"]) - 0.8) < 0.05
    assert abs(_phi(train.task, train.attrs["age"])) < 0.05
    unbiased_eval = data.generate_synthetic(
        num_test=4000, attr_task_correlation=0.9, eval_attr_task_correlation=0.0
    )
    test = unbiased_eval.splits["test"]
    assert abs(_phi(test.task, test.attrs["gender"])) < 0.05
    train = unbiased_eval.splits["train"]
    assert abs(_phi(train.task, train.attrs["gender"]) - 0.9) < 0.05


def test_synthetic_task_and_markers_learnable():
    ds = data.generate_synthetic(label_noise=0.0, attr_marker_prob=1.0)
    train = ds.splits["train"]
    for text, t, g in zip(train.text, train.task, train.attrs["gender"], strict=True):
        words = set(text.replace(",", " ").split())
        assert words & set(synthetic_lib.TASK_WORDS[ds.task_classes[t]])
        markers = synthetic_lib.ATTR_MARKERS["gender"][ds.attr_classes["gender"][g]]
        assert any(m in text for m in markers)
    three = data.generate_synthetic(num_task_classes=3, attributes=("age",))
    assert three.task_classes == ("negative", "neutral", "positive")
    assert three.attributes == ("age",)
    with pytest.raises(ValueError, match="subset"):
        data.generate_synthetic(attributes=("race",))


# ---------------------------------------------------------------- tabular


def test_csv_split_column_with_val_alias(tmp_path):
    rows = _rows("train", 8) + _rows("val", 4) + _rows("test", 4)
    path = _write_csv(tmp_path / "d.csv", rows)
    c = _tabular_config(path=path, split_column="part")
    c.split_names.dev = "val"
    ds = data.load_text_dataset(c)
    assert not ds.synthetic and ds.name == "toy"
    assert {s: len(v) for s, v in ds.splits.items()} == {
        "train": 8,
        "dev": 4,
        "test": 4,
    }
    assert ds.task_classes == ("neg", "pos")  # sorted from train
    assert ds.attr_classes == {"gender": ("f", "m")}
    assert ds.splits["dev"].text[0] == "val example number 0"
    np.testing.assert_array_equal(ds.splits["train"].task[:2], [1, 0])
    assert ds.splits["train"].task.dtype == np.int32


def test_jsonl_per_split_files_pair_and_explicit_classes(tmp_path):
    files = {}
    for s, n in (("train", 6), ("dev", 3), ("test", 3)):
        rows = _rows(s, n)
        for r in rows:
            r["hyp"] = "a second segment"
            r["y"] = {"pos": 1, "neg": 0}[r["y"]]  # ints, read as str(value)
        files[s] = _write_jsonl(tmp_path / f"{s}.jsonl", rows)
    c = _tabular_config()
    c.split_files = files
    c.columns.text_pair = "hyp"
    c.task_classes = ("1", "0")  # explicit order is kept
    ds = data.load_text_dataset(c)
    assert ds.task_classes == ("1", "0")
    assert ds.splits["test"].text_pair == ["a second segment"] * 3
    np.testing.assert_array_equal(ds.splits["train"].task[:2], [0, 1])


def test_reference_layout_with_label_files(tmp_path):
    files = {}
    for s in ("train", "dev", "test"):
        rows = [
            {"tweet": f"tweet {i}", "label": i % 3, "dialect": ["aae", "sae"][i % 2]}
            for i in range(6)
        ]
        files[s] = _write_jsonl(tmp_path / f"{s}.jsonl", rows)
    labels = tmp_path / "labels_protected_race.txt"
    labels.write_text("sae\naae\n")
    c = data.default_data_config()
    c.source = "fcdl18"
    c.split_files = files
    c.attr_label_files = {"dialect": str(labels)}
    ds = data.load_text_dataset(c)
    assert ds.name == "fcdl18"
    assert ds.attr_classes == {"dialect": ("sae", "aae")}  # index = line order
    assert ds.task_classes == ("0", "1", "2")
    np.testing.assert_array_equal(ds.splits["train"].attrs["dialect"][:2], [1, 0])


def test_parquet(tmp_path):
    if importlib.util.find_spec("pyarrow") is None:
        path = tmp_path / "d.parquet"
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            data.read_table(str(path))
        pytest.skip("pyarrow not installed; only the error message was checked")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows("train", 4) + _rows("dev", 2) + _rows("test", 2)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet")
    c = _tabular_config(path=str(tmp_path / "d.parquet"), split_column="part")
    assert len(data.load_text_dataset(c).splits["dev"]) == 2


# ---------------------------------------------------------------- errors


def test_missing_column_lists_available(tmp_path):
    path = _write_csv(tmp_path / "d.csv", _rows("train") + _rows("dev") + _rows("test"))
    c = _tabular_config(path=path, split_column="part")
    c.columns.text = "sentense"
    with pytest.raises(ValueError, match="'sentense'") as e:
        data.load_text_dataset(c)
    assert "Available columns: ['sentence', 'y', 'gen', 'part']" in str(e.value)
    c = _tabular_config(path=path, split_column="part")
    c.columns.attributes = {"gender": "sex"}
    with pytest.raises(ValueError, match="'sex'.*Available columns"):
        data.load_text_dataset(c)


def test_unknown_label_in_dev(tmp_path):
    dev = _rows("dev", 4, y=("pos", "neg", "neutral"))
    path = _write_csv(tmp_path / "d.csv", _rows("train") + dev + _rows("test"))
    with pytest.raises(ValueError) as e:
        data.load_text_dataset(_tabular_config(path=path, split_column="part"))
    msg = str(e.value)
    for part in ("'neutral'", "column 'y'", "split 'dev'", "data.task_classes"):
        assert part in msg
    # The documented fix works.
    c = _tabular_config(path=path, split_column="part")
    c.task_classes = ("neg", "neutral", "pos")
    assert data.load_text_dataset(c).task_classes == ("neg", "neutral", "pos")


def test_empty_split_and_unmapped_split_values(tmp_path):
    path = _write_csv(tmp_path / "d.csv", _rows("train") + _rows("test"))
    with pytest.raises(ValueError, match="Split 'dev'.*empty"):
        data.load_text_dataset(_tabular_config(path=path, split_column="part"))
    path = _write_csv(tmp_path / "e.csv", _rows("train") + _rows("val") + _rows("test"))
    with pytest.raises(ValueError, match="'val'.*split_names.dev"):
        data.load_text_dataset(_tabular_config(path=path, split_column="part"))


def test_one_file_with_no_split_column_split_at_random(tmp_path):
    # 200 rows in cells of very different sizes (a 4-row minority cell).
    rows = []
    for i in range(200):
        y = "pos" if i % 2 else "neg"
        g = "m" if (i < 4 or (i >= 100 and i % 3)) else "f"
        rows.append({"sentence": f"example {i}", "y": y, "gen": g})
    path = _write_csv(tmp_path / "all.csv", rows)
    # Without the option the error names the split column and the fix.
    with pytest.raises(ValueError, match="'split'.*data.split_shares") as e:
        data.load_text_dataset(_tabular_config(path=path))
    assert "Available columns: ['sentence', 'y', 'gen']" in str(e.value)
    c = _tabular_config(path=path, split_shares=(0.8, 0.1, 0.1))
    a = data.load_text_dataset(c)
    sizes = {s: len(a.splits[s]) for s in a.splits}
    assert sum(sizes.values()) == 200
    assert abs(sizes["train"] - 160) <= 2 and abs(sizes["dev"] - 20) <= 2
    seen = [t for s in a.splits for t in a.splits[s].text]
    assert sorted(seen) == sorted(r["sentence"] for r in rows)  # each row once
    # Stratified: every split holds both task labels within both genders.
    for s in a.splits:
        task, gender = a.splits[s].task.tolist(), a.splits[s].attrs["gender"].tolist()
        cells = set(zip(task, gender, strict=True))
        assert len(cells) == 4, (s, cells)
    # Within a split the file's order is kept.
    order = [int(t.split()[1]) for t in a.splits["train"].text]
    assert order == sorted(order)
    # The same seed gives the same split; another seed another.
    b = data.load_text_dataset(_tabular_config(path=path, split_shares=(0.8, 0.1, 0.1)))
    assert a.splits["test"].text == b.splits["test"].text
    other = _tabular_config(path=path, split_shares=(0.8, 0.1, 0.1), seed=1)
    assert data.load_text_dataset(other).splits["test"].text != a.splits["test"].text


def test_split_shares_bad_values(tmp_path):
    rows = [
        {"sentence": f"e {i}", "y": "ab"[i % 2], "gen": "fm"[i // 2 % 2]}
        for i in range(40)
    ]
    path = _write_csv(tmp_path / "all.csv", rows)
    for shares, match in (
        ((0.8, 0.2), "2 value.*3 splits"),
        ((0.8, 0.3, 0.1), "sums to 1.2"),
        ((0.9, 0.1, 0.0), "split 'test' the share 0.0"),
        ((0.8, "x", 0.1), "split 'dev' the share 'x'"),
    ):
        with pytest.raises(ValueError, match=match):
            data.load_text_dataset(_tabular_config(path=path, split_shares=shares))
    c = _tabular_config(split_shares=(0.8, 0.1, 0.1))
    c.split_files = {"train": path, "dev": path, "test": path}
    with pytest.raises(ValueError, match="split_shares splits one file"):
        data.load_text_dataset(c)


def test_split_rows_deals_leftovers_to_the_furthest_behind():
    from moddiffy_jax.data import random_split

    # 50 strata of 3 rows: per stratum 0.8/0.1/0.1 leaves leftovers; dealt
    # to whichever split is furthest below its share, the totals match.
    strata = [[i // 3 for i in range(150)]]
    parts = random_split.split_rows(strata, (0.8, 0.1, 0.1), seed=0)
    assert [len(p) for p in parts] == [120, 15, 15]
    assert sorted(np.concatenate(parts).tolist()) == list(range(150))
    assert random_split.split_rows([], (0.5, 0.5), seed=0)[0].size == 0


def test_single_class_attribute(tmp_path):
    rows = _rows("train", g=("f",)) + _rows("dev") + _rows("test")
    path = _write_csv(tmp_path / "d.csv", rows)
    with pytest.raises(ValueError, match="attribute 'gender'.*single class"):
        data.load_text_dataset(_tabular_config(path=path, split_column="part"))


def test_pickle_refused_and_conversion_script(tmp_path):
    rows = [
        {
            "bio": f"bio {i}",
            "title": ["nurse", "surgeon"][i % 2],
            "gender": "fm"[i // 2 % 2],
            "extra": np.float32(i),
        }
        for i in range(8)
    ]
    pkl = tmp_path / "train.pkl"
    pkl.write_bytes(pickle.dumps(rows))
    c = data.default_data_config()
    c.source = "bios"
    c.split_files = {"train": str(pkl), "dev": str(pkl), "test": str(pkl)}
    with pytest.raises(ValueError, match="convert_pickle_dataset.py"):
        data.load_text_dataset(c)

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import convert_pickle_dataset as conv
    finally:
        sys.path.pop(0)
    out = tmp_path / "train.jsonl"
    assert conv.main([str(pkl), str(out)]) == 2  # refuses without --trusted
    assert not out.exists()
    assert conv.main(["--trusted", str(pkl), str(out)]) == 0
    c.split_files = {"train": str(out), "dev": str(out), "test": str(out)}
    ds = data.load_text_dataset(c)
    assert ds.task_classes == ("nurse", "surgeon") and len(ds.splits["dev"]) == 8


def test_unknown_source_lists_valid():
    c = data.default_data_config()
    c.source = "bois"
    with pytest.raises(ValueError, match="Unknown data source 'bois'") as e:
        data.load_text_dataset(c)
    for name in ("synthetic", "tabular", "bios", "pan16", "fcdl18", "dwmw17_dialect"):
        assert name in str(e.value)


# ---------------------------------------------------------------- dwmw17


def test_dwmw17_preset_loads_real_file(monkeypatch):
    if not DWMW17.is_file():
        pytest.skip("dwmw17_dialect.csv not present")
    monkeypatch.chdir(REPO)  # configs reference it relative to the repo root
    c = data.default_data_config()
    c.source = "dwmw17_dialect"
    ds = data.load_text_dataset(c)
    sizes = {s: len(v) for s, v in ds.splits.items()}
    assert sizes == {"train": 7474, "dev": 1587, "test": 1614}
    assert sum(sizes.values()) == 10_675
    assert set(ds.task_classes) == {"hate", "offensive", "neither"}
    assert set(ds.attr_classes["dialect"]) == {"aae", "white"}
    assert not ds.synthetic and ds.name == "dwmw17_dialect"


# ---------------------------------------------------------------- balancing


def test_balancing_train_only():
    c = data.default_data_config()
    c.balance.attribute = "gender"
    plain = data.load_text_dataset(data.default_data_config())
    ds = data.load_text_dataset(c)
    train = ds.splits["train"]
    for t in range(len(ds.task_classes)):
        counts = [
            int(np.sum((train.task == t) & (train.attrs["gender"] == g)))
            for g in range(2)
        ]
        assert counts[0] == counts[1] > 0
    assert len(train) > len(plain.splits["train"])
    assert train.text[: len(plain.splits["train"])] == plain.splits["train"].text
    for s in ("dev", "test"):
        assert ds.splits[s].text == plain.splits[s].text
    again = data.load_text_dataset(c)
    assert again.splits["train"].text == train.text


def test_the_train_split_as_read_comes_back_for_probes_and_floors(tokenizer):
    """Balanced train feeds training; the probes and the floor's rule read
    train as read (on the balanced split the rule would have no signal)."""
    from moddiffy_jax.eval import removal

    plain = data.load_text_dataset(data.default_data_config())
    c = data.default_data_config()
    c.balance.attribute = "gender"
    ds = data.load_text_dataset(c)
    n = len(plain.splits["train"])
    assert ds.train_originals == n and plain.train_originals is None
    back = data.original_train(ds)
    assert back.train_originals is None and back.splits["train"].text == (
        plain.splits["train"].text
    )
    assert data.original_train(plain) is plain

    c.max_examples_per_split = 300
    c.max_length = 16
    tok = data.build_dataset(c, tokenizer)
    n_tok = tok.train_originals
    assert n_tok is not None and n_tok < len(tok.splits["train"])
    train_as_read = data.original_train(tok).splits["train"]
    assert len(train_as_read) == n_tok
    np.testing.assert_array_equal(
        train_as_read.input_ids, tok.splits["train"].input_ids[:n_tok]
    )

    def floor(split):
        return removal.leakage_floor(
            split.task,
            split.attrs["gender"],
            tok.splits["test"].task,
            tok.splits["test"].attrs["gender"],
            num_task_classes=2,
            num_attr_classes=2,
        )

    # gender follows the label at 0.8: the rule on train as read finds it;
    # on the balanced split every task label is a tie.
    assert floor(train_as_read) > 0.75
    assert floor(tok.splits["train"]) == 0.5


# ---------------------------------------------------------------- tokenization


def test_build_dataset_shapes(tokenizer):
    c = data.default_data_config()
    c.max_length = 24
    c.trim_padding = False
    c.max_examples_per_split = 50
    ds = data.build_dataset(c, tokenizer)
    assert ds.synthetic and ds.max_length == 24 and ds.name == "synthetic"
    for split in ds.splits.values():
        assert len(split) == 50
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            arr = getattr(split, k)
            assert arr.shape == (50, 24) and arr.dtype == np.int32
        assert split.task.shape == (50,) and split.task.dtype == np.int32
        assert set(split.attrs) == {"gender", "age"}
    ids = ds.splits["train"].input_ids
    assert (ids[:, 0] == tokenizer.cls_token_id).all()
    mask = ds.splits["train"].attention_mask
    assert ((ids == tokenizer.pad_token_id) == (mask == 0)).all()


def test_trim_padding_drops_only_padding(tokenizer):
    # The synthetic sentences are at most 14 tokens: padded to 40, the last
    # 24 columns are padding in every example of every split.
    c = data.default_data_config()
    c.max_length = 40
    c.trim_padding = False
    padded = data.build_dataset(c, tokenizer)
    c.trim_padding = True
    trimmed = data.build_dataset(c, tokenizer)
    used = max(
        int(np.flatnonzero(s.attention_mask.any(0))[-1]) + 1
        for s in padded.splits.values()
    )
    assert trimmed.max_length == -(-used // 8) * 8 < 40
    for name, split in padded.splits.items():
        cut = trimmed.splits[name]
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            full = getattr(split, k)
            np.testing.assert_array_equal(
                getattr(cut, k), full[:, : trimmed.max_length]
            )
        assert not split.attention_mask[:, trimmed.max_length :].any()
        np.testing.assert_array_equal(cut.task, split.task)
    # A real token in the last column (a left-padding tokenizer, or a split
    # at the cap) keeps every column.
    split = padded.splits["dev"]
    mask = split.attention_mask.copy()
    mask[0, -1] = 1
    edge = padded.replace(
        splits={**padded.splits, "dev": dataclasses.replace(split, attention_mask=mask)}
    )
    assert data.trim_padding(edge) is edge
    assert data.padded_length(padded, multiple=1) == used
    # config.data.trim_multiple=1 (size_for_cpu): the longest example's length.
    c.trim_multiple = 1
    assert data.build_dataset(c, tokenizer).max_length == used < trimmed.max_length
    c.trim_multiple = 0
    with pytest.raises(ValueError, match="config.data.trim_multiple=0"):
        data.build_dataset(c, tokenizer)


def test_cpu_sized_text_runs_trim_to_the_longest_example():
    """size_for_cpu cuts padding to the longest example (README command 1's
    config among them); the accelerator-sized and tiny configs keep 8."""
    from moddiffy_jax import config_lib

    def multiple(arg):
        return config_lib.experiment_config("moddiffy_par", arg).data.trim_multiple

    assert multiple(None) == multiple("data=dwmw17") == 1
    assert multiple("model=tiny") == 8
    assert data.default_data_config().trim_multiple == 8


def test_tokenize_pairs_and_truncation(tokenizer):
    split = data.RawSplit(
        text=["a b c d e f g h i j k l m n o p"],
        text_pair=["second segment"],
        task=np.zeros(1, np.int32),
        attrs={},
    )
    tok = data.tokenize_split(split, tokenizer, max_length=8)
    assert tok.input_ids.shape == (1, 8) and tok.attention_mask.all()
    assert tok.token_type_ids[0, -1] == 1


# ---------------------------------------------------------------- pipeline


def _index_split(n):
    ids = np.tile(np.arange(n, dtype=np.int32)[:, None], (1, 4))
    return data.TokenizedSplit(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        token_type_ids=np.zeros_like(ids),
        task=(np.arange(n) % 2).astype(np.int32),
        attrs={"gender": (np.arange(n) % 3 == 0).astype(np.int32)},
    )


def _assert_batches_equal(a, b):
    for k in ("input_ids", "attention_mask", "token_type_ids", "task"):
        np.testing.assert_array_equal(a[k], b[k])
    for k in a["attrs"]:
        np.testing.assert_array_equal(a["attrs"][k], b["attrs"][k])


@pytest.mark.parametrize("n,batch,seed,shards", [(10, 3, 0, 1), (37, 8, 5, 2)])
def test_train_iterator_order_is_grains_shuffle(n, batch, seed, shards):
    # The iterator calls grain's index shuffle directly; its order must stay
    # the one of grain's own graph, range(n).shuffle(s).repeat(), which earlier
    # runs (and their resumes) were trained on.
    import grain

    from moddiffy_jax.data import pipeline

    order = (
        grain.MapDataset.range(n).shuffle(seed=pipeline._shuffle_seed(seed)).repeat()
    )
    steps = n // batch
    local = batch // shards
    for shard in range(shards):
        it = data.TrainIterator(
            _index_split(n),
            batch_size=batch,
            seed=seed,
            shard_index=shard,
            shard_count=shards,
        )
        for step in range(3 * steps + 1):  # past two epoch boundaries
            epoch, j = divmod(step, steps)
            start = epoch * n + j * batch + shard * local
            want = [order[start + t] for t in range(local)]
            np.testing.assert_array_equal(next(it)["input_ids"][:, 0], want)
        it.close()


def test_train_iterator_epochs_and_batches():
    split = _index_split(10)
    it = data.TrainIterator(split, batch_size=3, seed=0)
    assert it.steps_per_epoch == 3
    batches = [next(it) for _ in range(9)]
    b = batches[0]
    assert b["input_ids"].shape == (3, 4) and b["input_ids"].dtype == np.int32
    assert b["task"].shape == (3,) and b["attrs"]["gender"].shape == (3,)
    epochs = [
        np.concatenate([x["input_ids"][:, 0] for x in batches[e * 3 : e * 3 + 3]])
        for e in range(3)
    ]
    for e in epochs:  # each epoch: 9 distinct examples, remainder dropped
        assert len(set(e.tolist())) == 9
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled per epoch
    it2 = data.TrainIterator(split, batch_size=3, seed=0)
    _assert_batches_equal(next(it2), batches[0])
    other = data.TrainIterator(split, batch_size=3, seed=1)
    firsts = np.concatenate([next(other)["input_ids"][:, 0] for _ in range(3)])
    assert not np.array_equal(firsts, epochs[0])
    it.close()


@pytest.mark.parametrize("consumed", [2, 3, 5])  # mid-epoch, boundary, across
def test_train_iterator_state_restore(consumed):
    split = _index_split(10)
    ref = data.TrainIterator(split, batch_size=3, seed=7)
    stream = [next(ref) for _ in range(consumed + 5)]
    it = data.TrainIterator(split, batch_size=3, seed=7)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # JSON round trip
    assert state["step"] == consumed and state["epoch"] == consumed // 3
    restored = data.TrainIterator(split, batch_size=3, seed=7)
    restored.set_state(state)
    for expected in stream[consumed:]:
        _assert_batches_equal(next(restored), expected)
    wrong = data.TrainIterator(split, batch_size=2, seed=7)
    with pytest.raises(ValueError, match="batch_size"):
        wrong.set_state(state)


def test_train_iterator_shards_partition_global_batch():
    split = _index_split(10)
    full = data.TrainIterator(split, batch_size=4, seed=3)
    shards = [
        data.TrainIterator(split, batch_size=4, seed=3, shard_index=i, shard_count=2)
        for i in range(2)
    ]
    for _ in range(5):
        parts = [next(s) for s in shards]
        assert parts[0]["input_ids"].shape == (2, 4)
        np.testing.assert_array_equal(
            np.concatenate([p["input_ids"] for p in parts]), next(full)["input_ids"]
        )


def test_eval_batches_pad_with_zero_weight():
    split = _index_split(10)
    batches = list(data.eval_batches(split, 4))
    assert len(batches) == data.num_eval_batches(split, 4) == 3
    for b in batches:
        assert b["input_ids"].shape == (4, 4) and b["weight"].dtype == np.float32
    np.testing.assert_array_equal(batches[-1]["weight"], [1, 1, 0, 0])
    seen = np.concatenate([b["input_ids"][:, 0][b["weight"] > 0] for b in batches])
    np.testing.assert_array_equal(seen, np.arange(10))  # in order, each once
    assert sum(float(b["weight"].sum()) for b in batches) == 10
    assert batches[-1]["attention_mask"][-1].any()  # padding is a real row


# ---------------------------------------------------------------- numeric bins


def test_a_numeric_attribute_is_cut_into_the_bins_given(tmp_path):
    ages = {"train": [17, 25, 34, 35, 49.5, 50, 64, 65, 80], "dev": [24.9, 66]}
    ages["test"] = [18, 40]
    files = {}
    for s, values in ages.items():
        rows = [
            {"sentence": f"{s} {i}", "y": ["pos", "neg"][i % 2], "age": a, "g": "f"}
            for i, a in enumerate(values)
        ]
        rows[0]["g"] = "m"
        files[s] = _write_jsonl(tmp_path / f"{s}.jsonl", rows)  # ages as numbers
    c = _tabular_config(split_files=files)
    c.attributes = ("gender", "age")
    c.columns.attributes = {"gender": "g"}
    c.attr_bins = {"age": (25, 35, 50, 65)}  # PAN16's five age groups
    ds = data.load_text_dataset(c)
    assert ds.attr_classes["age"] == ("<25", "[25,35)", "[35,50)", "[50,65)", ">=65")
    assert ds.attr_classes["gender"] == ("f", "m")  # others read as before
    # An edge value starts its bin; classes in the bins' order, not sorted.
    np.testing.assert_array_equal(
        ds.splits["train"].attrs["age"], [0, 1, 1, 2, 2, 3, 3, 4, 4]
    )
    np.testing.assert_array_equal(ds.splits["dev"].attrs["age"], [0, 4])
    np.testing.assert_array_equal(ds.splits["test"].attrs["age"], [0, 2])
    assert data.bin_labels((0.5,)) == ("<0.5", ">=0.5")
    # The same column from a CSV (its values read as text) gives the same.
    rows = [
        {"sentence": f"{s} {i}", "y": "pos" if i % 2 else "neg", "gen": "f", "age": a}
        for s, values in ages.items()
        for i, a in enumerate(values)
    ]
    for r in rows[:1] + rows[9:10] + rows[11:12]:
        r["gen"] = "m"
    for r, s in zip(rows, ["train"] * 9 + ["dev"] * 2 + ["test"] * 2, strict=True):
        r["part"] = s
    c = _tabular_config(path=_write_csv(tmp_path / "d.csv", rows), split_column="part")
    c.attributes = ("gender", "age")
    c.attr_bins = {"age": (25, 35, 50, 65)}
    np.testing.assert_array_equal(
        data.load_text_dataset(c).splits["train"].attrs["age"],
        [0, 1, 1, 2, 2, 3, 3, 4, 4],
    )


def test_bins_are_checked_and_raw_numbers_refused(tmp_path):
    rows = [
        {
            "sentence": f"{s} {i}",
            "y": "pos" if i % 2 else "neg",
            "gen": str(i),
            "part": s,
        }
        for s in ("train", "dev", "test")
        for i in range(30)
    ]
    path = _write_csv(tmp_path / "d.csv", rows)
    c = _tabular_config(path=path, split_column="part")
    with pytest.raises(ValueError, match=r"30 distinct numeric.*\(7, 15, 22\)"):
        data.load_text_dataset(c)
    # The suggested cut works; listing the classes keeps them as classes.
    c.attr_bins = {"gender": (7, 15, 22)}
    assert data.load_text_dataset(c).attr_classes["gender"][0] == "<7"
    c = _tabular_config(path=path, split_column="part")
    c.attr_classes = {"gender": tuple(str(i) for i in range(30))}
    assert len(data.load_text_dataset(c).attr_classes["gender"]) == 30
    for bins, message in [
        ((15, 7), "strictly increasing"),
        ((7, "x"), "must be numbers"),
    ]:
        c = _tabular_config(path=path, split_column="part")
        c.attr_bins = {"gender": bins}
        with pytest.raises(ValueError, match=message):
            data.load_text_dataset(c)
    c = _tabular_config(path=path, split_column="part")
    c.attr_bins = {"gender": (7,)}
    c.attr_classes = {"gender": ("a", "b")}
    with pytest.raises(ValueError, match="keep one"):
        data.load_text_dataset(c)
    c = _tabular_config(path=path, split_column="part")
    c.attr_bins = {"age": (7,)}
    with pytest.raises(ValueError, match=r"names \['age'\], which are not in"):
        data.load_text_dataset(c)
    c = data.default_data_config()
    c.attr_bins = {"age": (7,)}
    with pytest.raises(ValueError, match="synthetic source defines its own classes"):
        data.load_text_dataset(c)
    # Twenty numeric classes or fewer are read as classes, as before.
    few = [dict(r, gen=str(int(r["gen"]) % 20)) for r in rows]
    c = _tabular_config(path=_write_csv(tmp_path / "e.csv", few), split_column="part")
    assert len(data.load_text_dataset(c).attr_classes["gender"]) == 20


def test_rows_with_an_empty_value_are_an_error_or_left_out(tmp_path, caplog):
    rows = _rows("train", 8) + _rows("dev", 4) + _rows("test", 4)
    rows[1]["gen"] = ""  # train: no attribute value
    rows[2]["y"] = " "  # train: no task label
    rows[9]["sentence"] = ""  # dev: no text
    path = _write_csv(tmp_path / "d.csv", rows)
    c = _tabular_config(path=path, split_column="part")
    with pytest.raises(
        ValueError, match=r"Missing label in column 'y'.*missing='drop'"
    ):
        data.load_text_dataset(c)
    c.missing = "drop"
    with caplog.at_level("WARNING"):
        ds = data.load_text_dataset(c)
    assert {s: len(v) for s, v in ds.splits.items()} == {
        "train": 6,
        "dev": 3,
        "test": 4,
    }
    kept = [r["sentence"] for r in rows[:8] if r["gen"] and r["y"].strip()]
    assert ds.splits["train"].text == kept
    assert "2 of 8 rows of split 'train'" in caplog.text
    assert "{'y': 1, 'gen': 1}" in caplog.text
    # JSON nulls and NaNs are empty too.
    files = {}
    for s in ("train", "dev", "test"):
        rs = _rows(s, 6)
        rs[0]["gen"] = None
        rs[1]["y"] = float("nan")
        files[s] = _write_jsonl(tmp_path / f"{s}.jsonl", rs)
    c = _tabular_config(split_files=files, missing="drop")
    assert len(data.load_text_dataset(c).splits["dev"]) == 4
    c.missing = "skip"
    with pytest.raises(ValueError, match=r"data.missing='skip' is not one of"):
        data.load_text_dataset(c)
