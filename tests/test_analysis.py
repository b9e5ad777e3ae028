"""Tests of moddiffy_jax.analysis and the analyze CLI on hand-made diffs."""

import csv
import json
import math

import numpy as np
import pytest

from moddiffy_jax import analysis, checkpoints
from moddiffy_jax import analyze as analyze_cli
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets.selection import unflatten

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
H, INTER, VOCAB, POS, TYPES, LAYERS = 4, 8, 10, 6, 2, 2


@pytest.fixture
def needs_mpl():
    pytest.importorskip("matplotlib")


def fake_bert_shapes():
    """Flat {path: shape} of a tiny BERT-like encoder (2 layers)."""
    shapes = {
        "embeddings/word_embeddings/embedding": (VOCAB, H),
        "embeddings/position_embeddings/embedding": (POS, H),
        "embeddings/token_type_embeddings/embedding": (TYPES, H),
        "embeddings/LayerNorm/scale": (H,),
        "embeddings/LayerNorm/bias": (H,),
    }
    for i in range(LAYERS):
        pre = f"encoder/layer_{i}"
        for name in ("query", "key", "value"):
            shapes[f"{pre}/attention/self/{name}/kernel"] = (H, H)
            shapes[f"{pre}/attention/self/{name}/bias"] = (H,)
        shapes[f"{pre}/attention/output/dense/kernel"] = (H, H)
        shapes[f"{pre}/attention/output/dense/bias"] = (H,)
        shapes[f"{pre}/attention/output/LayerNorm/scale"] = (H,)
        shapes[f"{pre}/attention/output/LayerNorm/bias"] = (H,)
        shapes[f"{pre}/intermediate/dense/kernel"] = (H, INTER)
        shapes[f"{pre}/intermediate/dense/bias"] = (INTER,)
        shapes[f"{pre}/output/dense/kernel"] = (INTER, H)
        shapes[f"{pre}/output/dense/bias"] = (H,)
        shapes[f"{pre}/output/LayerNorm/scale"] = (H,)
        shapes[f"{pre}/output/LayerNorm/bias"] = (H,)
    shapes["pooler/dense/kernel"] = (H, H)
    shapes["pooler/dense/bias"] = (H,)
    return shapes


def dense_with(nonzero, *, shapes=None, seed=0):
    """Dense float32 subtree: ``nonzero[path]`` = flat indices (or their count).

    Values at the given indices are random with |v| >= 0.5, elsewhere 0.
    """
    shapes = fake_bert_shapes() if shapes is None else shapes
    rng = np.random.default_rng(seed)
    flat = {}
    for p, shape in shapes.items():
        a = np.zeros(math.prod(shape), np.float32)
        idx = nonzero.get(p, ())
        idx = np.arange(idx) if isinstance(idx, int) else np.asarray(idx, int)
        a[idx] = rng.choice([-1.0, 1.0], idx.size) * rng.uniform(0.5, 1.0, idx.size)
        flat[p] = a.reshape(shape)
    return unflatten(flat)


Q0 = "encoder/layer_0/attention/self/query/kernel"
Q0B = "encoder/layer_0/attention/self/query/bias"
I1 = "encoder/layer_1/intermediate/dense/kernel"
WORD = "embeddings/word_embeddings/embedding"
HAND = {Q0: 4, Q0B: 2, I1: 8, WORD: 10}


def hand_diff(name="gender", seed=0, fp="abc123"):
    return diffs_lib.SparseDiff.from_dense(
        dense_with(HAND, seed=seed), name=name, base_fingerprint=fp
    )


def pick(rows, **where):
    out = [r for r in rows if all(r[k] == v for k, v in where.items())]
    assert len(out) == 1, (where, out)
    return out[0]


# -----------------------------------------------------------------------------
# Classification of paths.


def test_layer_kind_param_of_paths():
    assert analysis.layer_of(Q0) == "layer_0"
    assert analysis.layer_of("encoder/layer_11/output/dense/bias") == "layer_11"
    assert analysis.layer_of(WORD) == "embeddings"
    assert analysis.layer_of("pooler/dense/kernel") == "pooler"
    assert analysis.layer_of("task_head/kernel") == "other"
    kinds = {p: analysis.kind_of(p) for p in fake_bert_shapes()}
    assert kinds[Q0] == "query" and kinds[Q0B] == "query"
    assert kinds["encoder/layer_1/attention/self/value/kernel"] == "value"
    assert kinds["encoder/layer_1/attention/output/dense/kernel"] == (
        "attention_output"
    )
    assert kinds["encoder/layer_1/attention/output/LayerNorm/scale"] == "layernorm"
    assert kinds["encoder/layer_0/output/dense/kernel"] == "output"
    assert kinds["encoder/layer_0/output/LayerNorm/bias"] == "layernorm"
    assert kinds[I1] == "intermediate"
    assert kinds["embeddings/LayerNorm/bias"] == "layernorm"
    assert kinds["embeddings/position_embeddings/embedding"] == "position_embeddings"
    assert kinds["embeddings/token_type_embeddings/embedding"] == (
        "token_type_embeddings"
    )
    assert kinds["pooler/dense/kernel"] == "pooler"
    assert analysis.kind_of("encoder/layer_0/adapter/down/kernel") == "adapter"
    assert set(kinds.values()) <= set(analysis.KINDS)
    assert analysis.param_of(Q0) == "kernel"
    assert analysis.param_of("embeddings/LayerNorm/scale") == "scale"


# -----------------------------------------------------------------------------
# Sparsity.


def test_sparsity_rows_match_hand_counts():
    rows = analysis.sparsity_rows(hand_diff(), run="r")
    assert all(r["run"] == "r" and r["diff"] == "gender" for r in rows)
    # Sizes: embeddings 40 + 24 + 8 + 4 + 4 = 80; one layer:
    # q/k/v/attn-out 4 * (16 + 4) + attn LN 8 + inter 32 + 8 + out 32 + 4 + LN 8.
    layer_size = 4 * 20 + 8 + 40 + 36 + 8
    total = 80 + LAYERS * layer_size + 20
    overall = pick(rows, level="overall")
    assert (overall["size"], overall["nnz"]) == (total, 24)
    assert overall["density"] == pytest.approx(24 / total)
    assert overall["percent"] == pytest.approx(100 * 24 / total)
    assert overall["share"] == 1.0
    # Per layer.
    emb = pick(rows, level="layer", layer="embeddings")
    assert (emb["size"], emb["nnz"]) == (80, 10)
    l0 = pick(rows, level="layer", layer="layer_0")
    assert (l0["size"], l0["nnz"], l0["density"]) == (layer_size, 6, 6 / layer_size)
    l1 = pick(rows, level="layer", layer="layer_1")
    assert (l1["nnz"], l1["share"]) == (8, 8 / 24)
    assert pick(rows, level="layer", layer="pooler")["nnz"] == 0
    layers = [r["layer"] for r in rows if r["level"] == "layer"]
    assert layers == ["embeddings", "layer_0", "layer_1", "pooler"]
    # Per matrix kind (kernels and biases of both layers together).
    q = pick(rows, level="kind", kind="query")
    assert (q["size"], q["nnz"], q["density"]) == (40, 6, 0.15)
    inter = pick(rows, level="kind", kind="intermediate")
    assert (inter["size"], inter["nnz"], inter["density"]) == (80, 8, 0.1)
    assert pick(rows, level="kind", kind="word_embeddings")["density"] == 0.25
    assert pick(rows, level="kind", kind="key")["nnz"] == 0
    ln = pick(rows, level="kind", kind="layernorm")
    assert ln["size"] == 8 + LAYERS * 16
    # Kernels vs biases.
    assert pick(rows, level="param", param="bias")["nnz"] == 2
    assert pick(rows, level="param", param="kernel")["nnz"] == 12
    assert pick(rows, level="kind_param", kind="query", param="bias")["density"] == (
        2 / 8
    )
    # Layer x kind cell.
    cell = pick(rows, level="layer_kind", layer="layer_0", kind="query")
    assert (cell["size"], cell["nnz"]) == (20, 6)
    assert all(r["nonzero"] == r["nnz"] for r in rows)


def test_sparsity_counts_stored_zeros_separately():
    # Pruning a mostly-zero diff to a budget stores zeros (ties at low indices).
    dense = dense_with({Q0: [5]})
    diff = diffs_lib.prune_to_sparsity(dense, keep=3, name="x")
    overall = pick(analysis.sparsity_rows(diff, levels=("overall",)), level="overall")
    assert (overall["nnz"], overall["nonzero"]) == (3, 1)
    with pytest.raises(ValueError, match="Unknown levels"):
        analysis.sparsity_rows(diff, levels=("bogus",))


def test_density_grid_and_heatmap_png(tmp_path, needs_mpl):
    diff = hand_diff()
    layers, kinds, grid = analysis.density_grid(diff)
    assert layers == ["embeddings", "layer_0", "layer_1", "pooler"]
    assert kinds[:3] == [
        "word_embeddings",
        "position_embeddings",
        "token_type_embeddings",
    ]
    assert grid.shape == (4, len(kinds))
    assert grid[1, kinds.index("query")] == pytest.approx(30.0)
    assert np.isnan(grid[0, kinds.index("query")])  # embeddings have no query
    path = analysis.plot_sparsity_heatmap(
        {"gender": diff, "age": hand_diff("age", seed=1)},
        tmp_path / "sub" / "heat.png",
        run="myrun",
    )
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_write_csv_roundtrip(tmp_path):
    rows = analysis.sparsity_rows(hand_diff(), run="r")
    path = analysis.write_csv(rows, tmp_path / "s.csv")
    with path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows)
    assert back[0]["level"] == "overall" and int(back[0]["nnz"]) == 24
    with pytest.raises(ValueError, match="outside the columns"):
        analysis.write_csv(rows, tmp_path / "t.csv", columns=["run"])


# -----------------------------------------------------------------------------
# Overlap.


def hand_pair():
    shapes = {Q0: (H, H), Q0B: (H,)}
    a_dense = {
        Q0: np.array([1.0, -1.0, 1.0, 1.0] + [0.0] * 12, np.float32).reshape(H, H),
        Q0B: np.array([2.0, 0.0, 0.0, 0.0], np.float32),
    }
    b_dense = {
        Q0: np.array([0.0, 0.0, 3.0, -1.0, 5.0] + [0.0] * 11, np.float32).reshape(H, H),
        Q0B: np.array([0.0, -2.0, 0.0, 0.0], np.float32),
    }
    a = diffs_lib.SparseDiff.from_dense(unflatten(a_dense), name="gender")
    b = diffs_lib.SparseDiff.from_dense(unflatten(b_dense), name="age")
    return a, b, shapes


def test_overlap_jaccard_and_sign_agreement_by_hand():
    a, b, _ = hand_pair()
    rows = analysis.overlap_rows(a, b)
    q = pick(rows, level="leaf", path=Q0)
    # a = {0, 1, 2, 3}, b = {2, 3, 4}: shared {2, 3}; signs (+,+) and (+,-).
    assert (q["nnz_a"], q["nnz_b"], q["intersection"], q["union"]) == (4, 3, 2, 5)
    assert q["jaccard"] == pytest.approx(0.4)
    assert (q["same_sign"], q["sign_agreement"]) == (1, 0.5)
    assert q["expected_intersection"] == pytest.approx(4 * 3 / 16)
    assert (q["a"], q["b"], q["layer"], q["kind"]) == (
        "gender",
        "age",
        "layer_0",
        "query",
    )
    bias = pick(rows, level="leaf", path=Q0B)
    assert (bias["intersection"], bias["union"]) == (0, 2)
    assert bias["jaccard"] == 0.0 and math.isnan(bias["sign_agreement"])
    total = pick(rows, level="total")
    assert (total["intersection"], total["union"]) == (2, 7)
    assert total["jaccard"] == pytest.approx(2 / 7)
    assert total["sign_agreement"] == 0.5
    assert total["expected_intersection"] == pytest.approx(12 / 16 + 1 / 4)
    kind = pick(rows, level="kind", kind="query")
    assert kind["intersection"] == 2 and kind["size"] == 20
    # Symmetric in the counts; identical diffs overlap fully with equal signs.
    back = pick(analysis.overlap_rows(b, a), level="total")
    assert back["jaccard"] == total["jaccard"]
    same = pick(analysis.overlap_rows(a, a, levels=("total",)), level="total")
    assert (same["jaccard"], same["sign_agreement"]) == (1.0, 1.0)


def test_overlap_nonzero_only_ignores_stored_zeros():
    x = diffs_lib.prune_to_sparsity(dense_with({Q0: [9]}, seed=0), keep=4)
    y = diffs_lib.prune_to_sparsity(dense_with({Q0: [12]}, seed=1), keep=4)
    stored = pick(analysis.overlap_rows(x, y, levels=("total",)), level="total")
    assert stored["intersection"] == 3  # the zero ties at flat indices 0, 1, 2
    nonzero = pick(
        analysis.overlap_rows(x, y, levels=("total",), nonzero_only=True),
        level="total",
    )
    assert (nonzero["nnz_a"], nonzero["intersection"]) == (1, 0)


def test_pairwise_overlap_table_and_errors():
    a, b, _ = hand_pair()
    c = a.replace(name="race")
    rows = analysis.pairwise_overlap([("gender", a), ("age", b), ("race", c)])
    assert [(r["a"], r["b"]) for r in rows] == [
        ("gender", "age"),
        ("gender", "race"),
        ("age", "race"),
    ]
    assert all(r["level"] == "total" for r in rows)
    assert rows[1]["jaccard"] == 1.0
    with pytest.raises(ValueError, match="Duplicate diff labels"):
        analysis.pairwise_overlap([("x", a), ("x", b)])
    other = hand_diff()  # the full fake tree: different leaves
    with pytest.raises(ValueError, match="same leaves") as err:
        analysis.pairwise_overlap([("gender", a), ("full", other)])
    assert "only 'full' has" in str(err.value)
    wrong_shape = diffs_lib.SparseDiff.from_dense(
        unflatten({Q0: np.ones((H, 2 * H), np.float32), Q0B: np.ones(H, np.float32)})
    )
    with pytest.raises(ValueError, match="shapes differ"):
        analysis.overlap_rows(a, wrong_shape)


# -----------------------------------------------------------------------------
# Trade-off plot and composition results.


def test_composition_points_are_tolerant():
    results = {
        "composition": {
            "core": {
                "test_task_acc": 0.8,
                "leakage": {"gender": {"mean": 0.7, "std": 0.02}},
            },
            "core+gender": {
                "dev_task_acc": {"mean": 0.78, "std": 0.01},
                "leakage": {"gender": 0.52, "age": [0.6, 0.03]},
            },
            "no_leakage": {"test_task_acc": 0.8},
            "broken": "n/a",
        }
    }
    points = analysis.composition_points(results, label_prefix="run/")
    assert [p["label"] for p in points] == ["run/core", "run/core+gender"]
    assert points[0] == {
        "label": "run/core",
        "task_acc": 0.8,
        "leakage": {"gender": 0.7},
        "leakage_std": {"gender": 0.02},
    }
    assert points[1]["task_acc"] == 0.78 and points[1]["task_std"] == 0.01
    assert points[1]["leakage"] == {"gender": 0.52, "age": 0.6}
    assert analysis.composition_points(None) == []
    assert analysis.composition_points({"other": 1}) == []


def test_plot_tradeoff_png(tmp_path, needs_mpl):
    points = [
        {"label": "core", "task_acc": 0.8, "leakage": {"gender": 0.7, "age": 0.6}},
        {
            "label": "core+gender",
            "task_acc": 0.79,
            "leakage": {"gender": 0.52},
            "std": {"task_acc": 0.01, "gender": 0.02},
        },
    ]
    for axis in ("x", "y"):
        path = analysis.plot_tradeoff(
            points, tmp_path / f"t_{axis}.png", task_axis=axis, chance=0.5
        )
        assert path.read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="needs 'label'"):
        analysis.plot_tradeoff([{"label": "x"}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="Duplicate point labels"):
        analysis.plot_tradeoff(points + points[:1], tmp_path / "bad.png")


# -----------------------------------------------------------------------------
# Run directories and the CLI.


def make_run(root, name, *, seed=0, attrs=("gender", "age"), with_eval=True):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(
        json.dumps({"method": {"name": "moddiffy"}, "seed": seed})
    )
    core = unflatten(
        {p: np.zeros(s, np.float32) for p, s in fake_bert_shapes().items()}
    )
    fp = diffs_lib.fingerprint(core)
    checkpoints.save_params(
        run / "export" / "core.safetensors", core, metadata={"fingerprint": fp}
    )
    (run / "export" / "diffs").mkdir(parents=True)
    for k, attr in enumerate(attrs):
        d = diffs_lib.prune_to_sparsity(
            dense_with({Q0: 6, I1: [3, 5, 7, 9], WORD: 4}, seed=10 * seed + k),
            keep=10,
            name=attr,
            base_fingerprint=fp,
        )
        diffs_lib.save_sparse_diff(run / "export" / "diffs" / f"{attr}.safetensors", d)
    comp = {"core": {"dev_task_acc": 0.8, "test_task_acc": 0.79}}
    results = {
        "method": "moddiffy",
        "dataset": "fake",
        "synthetic": True,
        "attributes": list(attrs),
        "core_fingerprint": fp,
        "composition": comp,
    }
    (run / "results.json").write_text(json.dumps(results))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    if with_eval:
        (run / "eval").mkdir()
        ev = {
            "composition": {
                "core": {
                    "test_task_acc": 0.79,
                    "leakage": {a: {"mean": 0.7, "std": 0.01} for a in attrs},
                },
                "core+gender": {
                    "test_task_acc": 0.78,
                    "leakage": {"gender": {"mean": 0.51, "std": 0.02}},
                },
            }
        }
        (run / "eval" / "results.json").write_text(json.dumps(ev))
    return run, fp


def test_load_run_reads_what_the_directory_holds(tmp_path):
    run_dir, fp = make_run(tmp_path, "r0")
    run = analysis.load_run(run_dir)
    assert run.name == "r0" and run.path == run_dir.absolute()
    assert run.config["seed"] == 0 and run.results["dataset"] == "fake"
    assert run.metrics == [{"step": 1, "loss": 1.0}]  # truncated last line skipped
    assert run.diff_names == ("age", "gender")
    assert run.core_fingerprint == fp
    gender = run.diff("gender")
    assert gender.name == "gender" and gender.nnz() == 10
    assert run.diff("gender") is gender  # cached
    assert run.eval_results["composition"]["core"]["test_task_acc"] == 0.79
    with pytest.raises(KeyError, match="valid: age, gender"):
        run.diff("race")


def test_partial_run_dirs_give_clear_errors(tmp_path):
    with pytest.raises(analysis.RunError, match="not a directory"):
        analysis.load_run(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(analysis.RunError, match="config.json is missing") as err:
        analysis.load_run(empty)
    assert str(empty) in str(err.value)
    (empty / "config.json").write_text("{}")
    with pytest.raises(analysis.RunError, match="export/diffs is missing") as err:
        analysis.load_run(empty)
    assert "Partial run directory" in str(err.value)
    assert analysis.load_run(empty, require_diffs=False).diff_names == ()
    (empty / "export" / "diffs").mkdir(parents=True)
    with pytest.raises(analysis.RunError, match="is empty"):
        analysis.load_run(empty)
    bad = empty / "export" / "diffs" / "gender.safetensors"
    bad.write_bytes(b"not a safetensors file")
    run = analysis.load_run(empty)  # lazy: the diff is read on first use
    with pytest.raises(analysis.RunError, match="Unreadable diff file") as err:
        run.diff("gender")
    assert str(bad) in str(err.value)
    with pytest.raises(analysis.RunError, match="Unreadable diff file"):
        analysis.load_run(empty, load_diffs=True)
    (empty / "config.json").write_text("{broken")
    with pytest.raises(analysis.RunError, match="Cannot read config"):
        analysis.load_run(empty)
    # The CLI reports it and exits with status 2.
    assert analyze_cli.main([str(tmp_path / "empty")]) == 2


def test_cli_single_run(tmp_path, capsys, needs_mpl):
    run_dir, _ = make_run(tmp_path, "r0")
    assert analyze_cli.main([str(run_dir)]) == 0
    out = run_dir / "analysis"
    expected = {
        "sparsity.csv",
        "sparsity_heatmap.png",
        "overlap_attributes.csv",
        "tradeoff.png",
        "summary.md",
    }
    assert {p.name for p in out.iterdir()} == expected
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(out / n) for n in expected)
    for png in ("sparsity_heatmap.png", "tradeoff.png"):
        assert (out / png).read_bytes().startswith(PNG_SIGNATURE)
    with (out / "sparsity.csv").open() as f:
        rows = list(csv.DictReader(f))
    overall = [r for r in rows if r["level"] == "overall"]
    assert {r["diff"] for r in overall} == {"gender", "age"}
    assert all(int(r["nnz"]) == 10 for r in overall)
    with (out / "overlap_attributes.csv").open() as f:
        rows = list(csv.DictReader(f))
    total = [r for r in rows if r["level"] == "total"]
    assert [(r["a"], r["b"]) for r in total] == [("age", "gender")]
    summary = (out / "summary.md").read_text()
    assert "synthetic data" in summary and "gender" in summary


def test_cli_several_runs_and_no_eval(tmp_path, needs_mpl):
    r0, _ = make_run(tmp_path, "seed0", seed=0, with_eval=False)
    r1, _ = make_run(tmp_path, "seed1", seed=1, attrs=("gender",), with_eval=False)
    out = tmp_path / "out"
    assert analyze_cli.main([str(r0), str(r1), "--out", str(out)]) == 0
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert names == {
        "seed0/sparsity.csv",
        "seed0/sparsity_heatmap.png",
        "seed0/overlap_attributes.csv",
        "seed1/sparsity.csv",
        "seed1/sparsity_heatmap.png",
        "sparsity_all.csv",
        "overlap_runs.csv",
        "summary.md",
    }  # no eval/results.json: no trade-off plot
    with (out / "overlap_runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    total = [r for r in rows if r["level"] == "total"]
    assert [(r["diff"], r["a"], r["b"]) for r in total] == [
        ("gender", "seed0", "seed1")
    ]
    assert "trade-off plot skipped" in (out / "summary.md").read_text()


def test_run_labels_are_unique():
    assert analysis.run_labels(["/x/a", "/x/b"]) == ["a", "b"]
    assert analysis.run_labels(["/x/a/seed0", "/y/a/seed0"]) == [
        "x_a_seed0",
        "y_a_seed0",
    ]
    assert analysis.run_labels(["/x/a", "/x/a"]) == ["a-0", "a-1"]
