"""Tests for moddiffy_jax.data.nli: SRNets pair readers, HANS mapping, features."""

import json

import numpy as np
import pytest

from moddiffy_jax import data
from moddiffy_jax.data import nli

MNLI_HEADER = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]
HANS_HEADER = [
    "gold_label",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "pairID",
    "heuristic",
    "subcase",
    "template",
]


def _write_tsv(path, header, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in [header, *rows]:
            f.write("\t".join(r) + "\n")
    return str(path)


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _mnli_rows(labels):
    return [
        [str(i), "p", "q", "fiction", "", "", "", "", f'The "cat" {i}.', f"h {i}"]
        + [lab, lab]
        for i, lab in enumerate(labels)
    ]


def _config(source, **split_files):
    c = data.default_data_config()
    c.source = source
    c.splits = tuple(split_files)
    for k, v in split_files.items():
        c.split_files[k] = v
    return c


def test_mnli_per_split_files(tmp_path):
    labels = ["entailment", "neutral", "contradiction", "entailment"]
    train = _write_tsv(tmp_path / "train.tsv", MNLI_HEADER, _mnli_rows(labels))
    dev = _write_tsv(tmp_path / "dm.tsv", MNLI_HEADER, _mnli_rows(["neutral"]))
    ds = data.load_text_dataset(_config("mnli", train=train, dev=dev))
    assert ds.task_classes == ("contradiction", "entailment", "neutral")
    assert ds.attr_classes == {} and ds.attributes == () and not ds.synthetic
    assert ds.name == "mnli"
    tr = ds.splits["train"]
    assert tr.text[0] == 'The "cat" 0.' and tr.text_pair[2] == "h 2"
    np.testing.assert_array_equal(tr.task, [1, 2, 0, 1])
    assert tr.attrs == {} and ds.splits["dev"].task.tolist() == [2]
    rows = nli.read_mnli_tsv(train)
    assert rows.guid[:2] == ["train-0", "train-1"]


def test_mnli_directory_layout(tmp_path):
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        _write_tsv(tmp_path / name, MNLI_HEADER, _mnli_rows(["neutral", "entailment"]))
    c = data.default_data_config()
    c.source = "mnli"
    c.path = str(tmp_path)
    ds = data.load_text_dataset(c)
    assert sorted(ds.splits) == ["dev", "test", "train"]


def test_hans_labels_meta_and_mnli_mapping(tmp_path):
    rows = [
        ["entailment", "", "", "", "", "The doctor ran .", "The doctor ran .", "ex0"]
        + ["lexical_overlap", "ln_subject", "t1"],
        ["non-entailment", "", "", "", "", "A b .", "B a .", "ex1"]
        + ["subsequence", "sn_NP/S", "t2"],
        ["non-entailment", "", "", "", "", "C d .", "D c .", "ex2"]
        + ["constituent", "cn_embedded", "t3"],
    ]
    path = _write_tsv(tmp_path / "heuristics_evaluation_set.txt", HANS_HEADER, rows)
    ds = data.load_text_dataset(_config("hans", test=path))
    assert ds.task_classes == ("non-entailment", "entailment")
    np.testing.assert_array_equal(ds.splits["test"].task, [1, 0, 0])
    assert ds.splits["test"].text[1] == "A b ." and ds.attr_classes == {}
    r = nli.read_hans_tsv(path)
    assert r.guid == ["ex0", "ex1", "ex2"]
    assert r.meta["heuristic"] == ["lexical_overlap", "subsequence", "constituent"]
    # MNLI predictions: contradiction 0, entailment 1, neutral 2.
    mapped = nli.mnli_to_hans_predictions(np.array([0, 1, 2, 1]))
    np.testing.assert_array_equal(mapped, [0, 1, 0, 1])
    assert [ds.task_classes[i] for i in mapped] == [
        "non-entailment",
        "entailment",
        "non-entailment",
        "entailment",
    ]
    with pytest.raises(ValueError, match="0, 1, 2"):
        nli.mnli_to_hans_predictions(np.array([3]))


def test_qqp_and_paws(tmp_path):
    qqp = _write_tsv(
        tmp_path / "qqp.tsv",
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        [
            ["7", "1", "2", "How?", "How so?", "1"],
            ["9", "3", "4", "Why?", "When?", "0"],
            ["11", "5", "6", "Who is it?", "Who's it?", "1"],
        ],
    )
    ds = data.load_text_dataset(_config("qqp", train=qqp))
    assert ds.task_classes == ("0", "1")
    assert ds.splits["train"].text == ["How?", "Why?", "Who is it?"]
    assert ds.splits["train"].text_pair[2] == "Who's it?"
    np.testing.assert_array_equal(ds.splits["train"].task, [1, 0, 1])
    assert nli.read_qqp_tsv(qqp, split="dev").guid == ["dev-7", "dev-9", "dev-11"]
    paws = _write_tsv(
        tmp_path / "dev.tsv",
        ["id", "sentence1", "sentence2", "label"],
        [["1", "a b", "b a", "0"], ["2", "c d", "c d", "1"]],
    )
    ds = data.load_text_dataset(_config("paws", dev=paws))
    assert ds.splits["dev"].text_pair == ["b a", "c d"]
    np.testing.assert_array_equal(ds.splits["dev"].task, [0, 1])


def test_fever_and_symmetric(tmp_path):
    train = _write_jsonl(
        tmp_path / "fever.train.jsonl",
        [
            {"claim": "c0", "evidence": "e0", "gold_label": "SUPPORTS"},
            {"claim": "c1", "evidence": "e1", "gold_label": "REFUTES"},
            {"claim": "c2", "evidence": "e2", "label": "NOT ENOUGH INFO"},
        ],
    )
    ds = data.load_text_dataset(_config("fever", train=train))
    assert ds.task_classes == ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")
    np.testing.assert_array_equal(ds.splits["train"].task, [0, 1, 2])
    assert ds.splits["train"].text_pair == ["e0", "e1", "e2"]
    assert nli.read_fever_jsonl(train).guid == ["train-0", "train-1", "train-2"]
    sym = _write_jsonl(
        tmp_path / "test.jsonl",
        [
            {"id": 5, "claim": "x", "evidence_sentence": "y", "label": "REFUTES"},
            {"id": 6, "claim": "z", "evidence_sentence": "w", "label": "SUPPORTS"},
        ],
    )
    ds = data.load_text_dataset(_config("fever_symmetric", test=sym))
    assert ds.task_classes == nli.FEVER_CLASSES and ds.attr_classes == {}
    np.testing.assert_array_equal(ds.splits["test"].task, [1, 0])
    assert ds.splits["test"].text == ["x", "z"]
    assert nli.read_fever_jsonl(sym, what="FEVER-Symmetric").guid == ["5", "6"]
    bad = _write_jsonl(
        tmp_path / "bad.jsonl",
        [{"claim": "x", "evidence": "y", "label": "MAYBE"}],
    )
    with pytest.raises(ValueError, match="MAYBE"):
        data.load_text_dataset(_config("fever_symmetric", test=bad))
    raw = _write_jsonl(
        tmp_path / "raw.jsonl",
        [{"claim": "x", "evidence": [[[1, 2, "Page", 0]]], "label": "SUPPORTS"}],
    )
    with pytest.raises(ValueError, match="expected a string"):
        nli.read_fever_jsonl(raw)


def test_missing_files_and_splits(tmp_path):
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="nope.tsv.*GLUE MNLI TSV"):
        data.load_text_dataset(_config("mnli", train=missing))
    with pytest.raises(FileNotFoundError, match="FEVER"):
        data.load_text_dataset(_config("fever", train=str(tmp_path / "f.jsonl")))
    c = data.default_data_config()
    c.source = "fever_symmetric"  # no train file in its layout
    with pytest.raises(ValueError, match="split_files.train"):
        data.load_text_dataset(c)


def test_malformed_rows(tmp_path):
    rows = _mnli_rows(["entailment", "neutral"])
    rows[1] = rows[1][:5]
    path = _write_tsv(tmp_path / "m.tsv", MNLI_HEADER, rows)
    with pytest.raises(ValueError, match="line 3"):
        nli.read_mnli_tsv(path)
    no_col = _write_tsv(tmp_path / "p.tsv", ["id", "s1", "s2", "label"], [["1"] * 4])
    with pytest.raises(ValueError, match="lacks columns"):
        nli.read_paws_tsv(no_col)
    with open(tmp_path / "j.jsonl", "w") as f:
        f.write('{"claim": "x", "evidence": "y", "label": "SUPPORTS"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        nli.read_fever_jsonl(str(tmp_path / "j.jsonl"))
    no_field = _write_jsonl(tmp_path / "k.jsonl", [{"claim": "x", "label": "REFUTES"}])
    with pytest.raises(ValueError, match="evidence or evidence_sentence"):
        nli.read_fever_jsonl(no_field)


def test_config_checks(tmp_path):
    train = _write_tsv(tmp_path / "t.tsv", MNLI_HEADER, _mnli_rows(["neutral"] * 2))
    with pytest.raises(ValueError, match="single class"):
        data.load_text_dataset(_config("mnli", train=train))
    c = _config("mnli", train=train)
    c.attributes = ("gender",)
    with pytest.raises(ValueError, match="no protected attribute"):
        data.load_text_dataset(c)


def test_zero_attributes_through_pipeline(tmp_path):
    labels = ["entailment", "neutral", "contradiction", "entailment", "neutral"]
    train = _write_tsv(tmp_path / "train.tsv", MNLI_HEADER, _mnli_rows(labels))
    ds = data.load_text_dataset(_config("mnli", train=train))
    raw = ds.splits["train"]
    ids = np.arange(len(raw) * 4, dtype=np.int32).reshape(len(raw), 4)
    split = data.TokenizedSplit(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        token_type_ids=np.zeros_like(ids),
        task=raw.task,
        attrs=raw.attrs,
    )
    it = data.TrainIterator(split, batch_size=2, seed=0, num_threads=0)
    batch = next(it)
    assert batch["attrs"] == {} and batch["task"].shape == (2,)
    it.close()
    batches = list(data.eval_batches(split, 2))
    assert len(batches) == 3 and batches[-1]["weight"].tolist() == [1.0, 0.0]
    summary = data.summarize_dataset(ds)
    assert summary["attr_classes"] == {}
    assert summary["splits"]["train"]["attrs"] == {}
    assert data.truncate_splits(ds, max_examples=2).splits["train"].attrs == {}


def test_word_overlap_features():
    p = ["The doctor saw the lawyer .", "A cat sat on the mat today ."]
    h = ["the lawyer", "the dog sat"]
    f = nli.word_overlap_features(p, h)
    assert f.shape == (2, len(nli.OVERLAP_FEATURE_NAMES)) and f.dtype == np.float32
    # Pair 0: "the lawyer" is a contiguous run of the premise; 6 - 2 tokens.
    np.testing.assert_allclose(f[0], [1.0, 1.0, 1.0, np.log(4)], rtol=1e-6)
    # Pair 1: "dog" is missing; 8 - 3 tokens.
    np.testing.assert_allclose(f[1], [0.0, 0.0, 2 / 3, np.log(5)], rtol=1e-6)
    # Lowercasing; not contiguous; hypothesis longer than premise -> log(1).
    g = nli.word_overlap_features("Doctor saw lawyer", "doctor lawyer saw doctor")
    np.testing.assert_allclose(g[0], [0.0, 1.0, 1.0, 0.0])
    empty_h = nli.word_overlap_features("a b", "")
    np.testing.assert_allclose(empty_h, [[0, 0, 0, np.log(2)]], rtol=1e-6)
    with pytest.raises(ValueError, match="2 premises"):
        nli.word_overlap_features(p, h[:1])
