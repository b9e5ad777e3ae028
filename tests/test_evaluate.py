"""The evaluate command on a tiny run: composition matrix, leakage, bad input."""

import concurrent.futures
import json
import shutil

import jax
import ml_collections
import pytest

from moddiffy_jax import evaluate, main, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.eval import composition, probes

FAST_PROBES = probes.ProbeConfig(members=2, max_epochs=3, patience=2, seeds=(0, 1))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("par")
    train.train_and_evaluate(experiment_config("moddiffy_par", "model=tiny"), workdir)
    return workdir


def test_composition_matrix(run):
    results = composition.evaluate_run(run, probe_config=FAST_PROBES)
    stages = results["timings"]  # this thread's stages, then the probes' wait
    assert list(stages) == ["compositions_s", "inlp_s", "probes_wait_s"]
    assert 0 < sum(stages.values()) <= results["wall_time_s"]
    rows = results["composition"]
    assert list(rows) == [
        "core",
        "core+gender",
        "core+age",
        "core+gender+age",
        "core+INLP(gender)",
        "core+INLP(age)",
    ]
    for row in rows.values():
        assert 0 <= row["test_task_acc"] <= 1
        assert "macro_f1" in row["task"]["test"]
        for attr in ("gender", "age"):
            leak = row["leakage"][attr]
            assert 0 <= leak["mean"] <= 1
            assert len(leak["per_seed_test"]) == 2
            assert leak["chance"] == 0.5
            assert "linear" in leak
            # The converged MLP probe (eval/probes.py CONVERGED_MLP).
            assert 0 <= leak["mlp"]["test_balanced_accuracy"] <= 1
            assert 0 <= leak["mlp"]["best_epoch"] < probes.MLP_EPOCHS
    saved = json.loads((run / "eval" / "results.json").read_text())
    assert saved["synthetic"] is True
    report = (run / "eval" / "report.md").read_text()
    assert "SYNTHETIC" in report and "core+gender+age" in report
    assert "whitened with the train split's statistics" in report
    assert "mean ± std over seeds (0, 1)" in report
    one_seed = {**results, "probe_config": {**results["probe_config"], "seeds": [0]}}
    assert "2 probes, one seed, 0)" in composition.format_report(one_seed)
    assert "| gender mlp |" in report and "gender gap closed (mlp)" in report
    # The run's printed table says which metric its attackers read.
    whole = json.loads((run / "results.json").read_text())
    whole["leakage"] = {label: row["leakage"] for label, row in rows.items()}
    whole["probe_whiten"] = True
    printed = main.format_results(whole)
    assert "whitened with the train split's covariance" in printed
    assert "gender mlp" in printed and "mlp: an MLP probe" in printed
    assert "(mean ± std over probe seeds;" in printed  # no "probe_seeds": 3
    whole["probe_seeds"] = [0]  # the main job's one attacker seed
    assert "(one probe seed: one ensemble;" in main.format_results(whole)
    del whole["probe_whiten"]  # a run from before the whitened attacker
    assert "standardized per feature" in main.format_results(whole)
    # A row far under the core's task accuracy is named under the table.
    core_acc = whole["composition"]["core"]["test_task_acc"]
    for row in whole["composition"].values():
        row["test_task_acc"] = core_acc
    assert "task lost" not in main.format_results(whole)
    whole["composition"]["core+gender"]["test_task_acc"] = core_acc - 0.3
    lost = [x for x in main.format_results(whole).splitlines() if "task lost" in x]
    assert lost == [
        "task lost: core+gender reads 30.0 points of test accuracy under the "
        "core; its leakage says nothing about removal"
    ]
    # The task accuracy of the core matches the training run's own table.
    trained = json.loads((run / "results.json").read_text())["composition"]
    assert rows["core"]["test_task_acc"] == pytest.approx(
        trained["core"]["test_task_acc"]
    )


def test_the_run_says_where_its_time_went(run):
    """results.json "timings": the setup, each phase (its first step, which
    compiles), the export and table, the report and its stages; the summary
    line prints them."""
    results = json.loads((run / "results.json").read_text())
    timings = results["timings"]
    assert set(timings["phases"]) == set(results["phase_steps"])
    for phase in timings["phases"].values():
        assert 0 < phase["first_step_s"] <= phase["seconds"]
    parts = [timings["setup_s"], timings["export_and_table_s"]]
    parts += [p["seconds"] for p in timings["phases"].values()]
    # This tiny run has no report (eval.leakage off); a main job's has.
    assert ("report_s" in timings) == ("leakage" in results)
    parts += [timings["report_s"]] if "report_s" in timings else []
    assert all(x > 0 for x in parts)
    assert sum(parts) <= results["wall_time_s"]
    assert f"wall time: {results['wall_time_s']:.0f} s (setup " in (
        main.format_results(results)
    )


def test_task_only_rows(run):
    """The core's decision and the task bottleneck (eval/bottleneck.py) as
    rows beside the compositions, with their notes in the report."""
    results = composition.evaluate_run(
        run, probe_config=FAST_PROBES, inlp=False, task_only={"max_drop": 0.5}
    )
    rows = results["composition"]
    labels = list(rows)
    assert labels[:5] == [
        "core",
        "core+gender",
        "core+age",
        "core+gender+age",
        "core decision",
    ]
    assert labels[5:] == ["core+bottleneck"]
    cut = "core+bottleneck"
    info = rows[cut]["task_only"]
    assert info["kind"] == "bottleneck"
    assert len(info["coordinates"]) == info["k"]
    reached = info["dev_accuracy"] >= info["reference_dev_accuracy"] - 0.005
    best = max(c["dev_accuracy"] for c in info["curve"])
    assert reached or info["dev_accuracy"] == best
    assert info["reference_dev_accuracy"] == pytest.approx(rows["core"]["dev_task_acc"])
    decision = rows["core decision"]
    assert decision["task_only"] == {"kind": "decision", "width": 2}
    # The decision row's predictions are the core's own.
    assert decision["test_task_acc"] == rows["core"]["test_task_acc"]
    for row in (decision, rows[cut]):
        for attr in ("gender", "age"):
            assert {"mean", "linear", "mlp"} <= set(row["leakage"][attr])
    # No attacker on the decision's few logits (it is no reader there).
    assert decision["leakage"]["gender"]["mean"] is None
    assert rows[cut]["leakage"]["gender"]["mean"] is not None
    report = (run / "eval" / "report.md").read_text()
    assert "`core decision`:" in report
    assert f"`core+bottleneck`: the CLS vector cut to the {info['k']} " in report
    assert "| core decision |" in report
    whole = json.loads((run / "results.json").read_text())
    whole["leakage"] = {label: row["leakage"] for label, row in rows.items()}
    printed = main.format_results(whole)
    assert "core+bottleneck" in printed and "core decision: the core head's" in printed


def test_the_decision_row_without_the_bottleneck(run, monkeypatch):
    """task_only={"bottleneck": False} (the main job) keeps the decision row
    and never fits the bottleneck."""
    from moddiffy_jax.eval import bottleneck

    def no_fit(*args, **kwargs):
        raise AssertionError("the bottleneck was fitted")

    monkeypatch.setattr(bottleneck, "fit_bottleneck", no_fit)
    rows = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        inlp=False,
        mlp=False,
        task_only={"bottleneck": False},
    )["composition"]
    assert "core decision" in rows and "core+bottleneck" not in rows
    assert rows["core decision"]["test_task_acc"] == rows["core"]["test_task_acc"]


def test_discriminant_rows(run):
    """One discriminant row per attribute and one for both
    (eval/discriminant.py), probed by lin and mlp, no attacker, with their
    note in the report and the printed table."""
    results = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        inlp=False,
        max_subset_size=0,
        discriminant={"max_drop": 0.5},
    )
    rows = results["composition"]
    labels = [
        "core+discriminant(gender)",
        "core+discriminant(age)",
        "core+discriminant(gender,age)",
    ]
    assert list(rows) == ["core"] + labels
    for label in labels:
        info = rows[label]["discriminant"]
        assert info["kind"] == "discriminant" and info["k"] == 1
        assert info["penalty"] in [c["penalty"] for c in info["candidates"]]
        assert info["reference_dev_accuracy"] == pytest.approx(
            rows["core"]["dev_task_acc"]
        )
        for attr in ("gender", "age"):
            leak = rows[label]["leakage"][attr]
            assert leak["mean"] is None and {"linear", "mlp"} <= set(leak)
            assert "discriminant: no attacker reading" in leak["notes"][0]
    assert rows[labels[2]]["discriminant"]["attributes"] == ["gender", "age"]
    # Each fit is written beside the report and names the core it projects.
    from moddiffy_jax.eval import discriminant
    from moddiffy_jax.subnets.sparse_diff import fingerprint

    core = composition.load_artifacts(run).core
    saved = discriminant.load_discriminant(
        run / "eval" / "discriminant" / "gender,age.safetensors",
        base_fingerprint=fingerprint(core),
    )
    assert saved.penalty == rows[labels[2]]["discriminant"]["penalty"]
    report = (run / "eval" / "report.md").read_text()
    assert "`core+discriminant(...)`: the core's representation projected" in report
    assert "| core+discriminant(gender,age) |" in report
    whole = json.loads((run / "results.json").read_text())
    whole["leakage"] = {label: row["leakage"] for label, row in rows.items()}
    assert "core+discriminant(a): the CLS vector" in main.format_results(whole)


def test_discriminant_weight_rows(run):
    """With weights, each discriminant row is the encoder with a sparse diff
    of its last layer added (eval/discriminant_diff.py), read by the core's
    own head; the diff is saved with the core's fingerprint and, loaded and
    added again, gives the row's representations."""
    import numpy as np

    from moddiffy_jax.eval import discriminant_diff
    from moddiffy_jax.subnets import diffs as diffs_lib

    results = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        inlp=False,
        max_subset_size=0,
        discriminant={"max_drop": 0.5, "weights": True},
    )
    rows = results["composition"]
    art = composition.load_artifacts(run)
    ctx = train.build_context(composition.load_run_config(run))
    hidden = ctx.model.bert_config.hidden_size
    inter = ctx.model.bert_config.intermediate_size
    rep = composition.Representer(ctx, 64)
    label = "core+discriminant(gender,age)"
    info = rows[label]["discriminant"]["weights"]
    assert len(info["kept_coordinates"]) == 1
    assert info["entries"] <= 2 * hidden + inter + 1
    assert 0 <= info["projection_test_accuracy"] <= 1
    sd = diffs_lib.load_sparse_diff(
        run / "eval" / "discriminant" / "gender,age.diff.safetensors",
        base=art.core,
    )
    assert sd.nnz() == info["entries"]
    h = rep.represent(diffs_lib.apply_diffs(art.core, [sd]), "test")
    # Every coordinate but the kept one is constant; the row's task accuracy
    # is the core head's on these vectors.
    kept = info["kept_coordinates"][0]
    held = np.delete(h, kept, axis=1)
    np.testing.assert_allclose(held, np.broadcast_to(held[0], held.shape), atol=1e-5)
    assert h[:, kept].std() > 0
    acc = np.mean(rep.predict(art.head, h) == ctx.data.splits["test"].task)
    assert rows[label]["test_task_acc"] == pytest.approx(acc, abs=1e-6)
    assert discriminant_diff.problem(ctx.model) is None
    report = (run / "eval" / "report.md").read_text()
    assert "Each is written into a sparse diff of the core's last layer" in report
    assert f"{label}: {info['entries']:,} entries" in report
    # Sets whose fits project alike share one diff and one encoding.
    from moddiffy_jax.eval import discriminant

    saved = [
        discriminant.load_discriminant(
            run / "eval" / "discriminant" / f"{a}.safetensors"
        )
        for a in ("gender", "age")
    ]
    alike = discriminant._same_projection(*saved)
    age = rows["core+discriminant(age)"]["discriminant"]["weights"]
    assert age.get("same_as") == ("core+discriminant(gender)" if alike else None)
    print("tiny run: gender and age project alike:", alike)
    # Every set at penalty 0 (Fisher's direction, as on the main job): one
    # diff, probed once, its readings in every row.
    fisher = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        inlp=False,
        max_subset_size=0,
        discriminant={"max_drop": 0.5, "weights": True, "penalties": (0.0,)},
    )["composition"]
    first = fisher["core+discriminant(gender)"]
    for other in ("core+discriminant(age)", "core+discriminant(gender,age)"):
        assert fisher[other]["discriminant"]["weights"]["same_as"] == (
            "core+discriminant(gender)"
        )
        assert fisher[other]["leakage"] == first["leakage"]
        assert fisher[other]["test_task_acc"] == first["test_task_acc"]
    # A larger train split is sampled for the readout (seeded).
    core_reps = {s: rep.represent(art.core, s) for s in ("train", "dev")}
    small = discriminant_diff.Writer(
        ctx, rep, art.head, art.core, core_reps, max_rows=50
    )
    assert small.y.shape[0] == small.g.shape[0] == len(small.rows) == 50
    assert len(set(small.rows.tolist())) == 50
    # With the core's last-layer parts (what the report reads since stop
    # 70), the fit reads no encoder pass and a diff's vectors are closed
    # form: the same features, the same diff, the same vectors as the pass.
    from moddiffy_jax.subnets.sparse_diff import fingerprint

    splits = {s: ctx.data.splits[s] for s in ("train", "dev", "test")}
    reps, parts = discriminant_diff.encode_core(rep, art.core, splits, {}, {})
    for s in splits:
        np.testing.assert_allclose(reps[s], rep.represent(art.core, s), atol=1e-5)
        assert parts[s][1].shape == (len(splits[s]), inter)
    plain = discriminant_diff.Writer(ctx, rep, art.head, art.core, reps)
    closed = discriminant_diff.Writer(ctx, rep, art.head, art.core, reps, parts=parts)
    assert plain.parts is None and closed.parts is not None
    np.testing.assert_allclose(closed.y, plain.y, atol=1e-5)
    np.testing.assert_allclose(closed.g, plain.g, atol=1e-5)
    fp = fingerprint(art.core)
    written = [w.write(saved[0], "gender", fp) for w in (plain, closed)]
    dense = [jax.tree.leaves(w.diff.to_dense()) for w in written]
    for a, b in zip(*dense, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    by_pass = plain.represent(written[1].diff)
    # To the vectors' scale: the closed form sums the last layer in another
    # order, and on an AVX-512 machine (stop 72) the diff's coordinate (up to
    # ~26) moved by up to 0.026 (a wrong diff moves it by its whole size).
    for s, h in closed.represent(written[1].diff).items():
        scale = float(np.abs(by_pass[s]).max())
        np.testing.assert_allclose(h, by_pass[s], atol=2e-3 * scale)
    # Known vectors and parts are kept: no pass (no model to run here).
    again = discriminant_diff.encode_core(None, None, splits, reps, parts)
    assert all(
        again[0][s] is reps[s] or np.array_equal(again[0][s], reps[s]) for s in splits
    )
    assert all(again[1][s][1] is parts[s][1] for s in splits)
    # Evaluated again without weights, the earlier diffs are not left beside
    # the new fits (they would not be this report's rows).
    saved = run / "eval" / "discriminant"
    assert (saved / "gender,age.diff.safetensors").exists()
    discriminant.discriminant_reps(
        ctx, rep, art.head, core_reps, save_dir=saved, weights=False
    )
    assert (saved / "gender,age.safetensors").exists()
    assert not list(saved.glob("*.diff.safetensors"))


def test_weights_and_subset_size(run):
    results = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        weights={"gender": 0.5},
        max_subset_size=1,
        inlp=False,
        linear=False,
    )
    assert list(results["composition"]) == ["core", "core+0.5*gender", "core+age"]
    with pytest.raises(ValueError, match="not diffs of this run"):
        composition.evaluate_run(run, probe_config=FAST_PROBES, weights={"race": 1})


def test_token_merge_rows(run):
    from moddiffy_jax.subnets import diff_files

    results = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        max_subset_size=0,
        inlp=False,
        linear=False,
        token_merge={"max_drop": 100.0, "select_train": 200, "candidates": 4},
    )
    assert list(results["composition"]) == [
        "core",
        "core+merge(gender)",
        "core+merge(age)",
        "core+merge(gender)+merge(age)",
    ]
    for attr in ("gender", "age"):
        merge = results["token_merge"][attr]
        assert 1 <= merge["merged"] <= 4 and len(merge["tokens"]) == merge["merged"]
        assert all(isinstance(t, str) for t in merge["tokens"])
        diff = diff_files.load_sparse_diff(run / "token_merge" / f"{attr}.safetensors")
        assert diff.info["method"] == "token_merge"
        assert len(diff.info["tokens"]) == merge["merged"]
        chosen = [r for r in merge["read"] if r["size"] == merge["merged"]][0]
        assert chosen["bound"] == pytest.approx(chosen["fitted"] + chosen["se"])
    report = (run / "eval" / "report.md").read_text()
    assert "core+merge(gender)+merge(age)" in report
    assert "task cost read on train + dev" in report


def test_strength_rows(run):
    results = composition.evaluate_run(
        run,
        probe_config=FAST_PROBES,
        max_subset_size=1,
        inlp=False,
        linear=False,
        weights={"age": 1.0},
        strength={"max_drop": 100.0, "select_train": 200, "up": (2.0,)},
    )
    # Any weight is within a 100-point budget: gender goes up to 2 unless its
    # dev leakage reaches the floor at weight 1; age keeps the given weight.
    gender = results["strength"]["gender"]
    assert "age" not in results["strength"]
    assert [r["scale"] for r in gender["read"]] in ([1.0], [1.0, 2.0])
    label = "core+gender" if gender["scale"] == 1.0 else "core+2*gender"
    assert list(results["composition"]) == ["core", label, "core+age"]
    assert results["weights"] == {"age": 1.0, "gender": gender["scale"]}
    for r in gender["read"]:
        assert r["bound"] == pytest.approx(r["cost"] + r["se"])
        assert 0.0 <= r["leakage"] <= 1.0
    report = (run / "eval" / "report.md").read_text()
    assert "- gender: weight " in report


def test_strength_from_the_command_line(run, capsys):
    from moddiffy_jax import evaluate

    argv = ["--workdir", str(run), "--max_epochs=1", "--noinlp", "--nolinear"]
    argv += ["--max_subset_size=1", "--strength", "--strength_max_drop=0"]
    assert evaluate.main(argv) == 0
    # No weight costs nothing on the tiny run's dev split, or the rule went
    # down to one that does: either way each diff's weight is reported.
    out = capsys.readouterr().out
    assert "- gender: weight " in out and "- age: weight " in out


def test_the_command_line_takes_the_runs_own_merge_and_strength_settings(
    run, monkeypatch
):
    """--token_merge / --strength re-build what the run's report built (its
    config.eval sections), with only the flags given in their place."""
    seen = {}

    def fake_evaluate_run(workdir, **kwargs):
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(composition, "evaluate_run", fake_evaluate_run)
    monkeypatch.setattr(composition, "format_report", lambda results: "")
    section = composition.load_run_config(run).eval
    argv = ["--workdir", str(run), "--token_merge", "--strength"]
    assert evaluate.main(argv + ["--token_merge_target=0.5"]) == 0
    merge = {k: v for k, v in section.token_merge.items() if k != "enabled"}
    assert seen["token_merge"] == {**merge, "target": 0.5}
    assert seen["strength"] == {
        k: v for k, v in section.strength.items() if k != "enabled"
    }
    assert seen["task_only"] == {
        "max_drop": section.task_only.max_drop,
        "bottleneck": section.task_only.bottleneck,
    }
    assert evaluate.main(argv[:2] + ["--nobottleneck"]) == 0
    assert seen["task_only"]["bottleneck"] is False
    assert evaluate.main(argv[:3] + ["--token_merge_max_drop=0.25"]) == 0
    assert seen["token_merge"] == {**merge, "max_drop": 0.25}
    assert seen["strength"] is None
    assert evaluate.main(argv[:2] + ["--task_only_max_drop=2"]) == 0
    assert seen["task_only"]["max_drop"] == 2.0
    assert evaluate.main(argv[:2] + ["--notask_only"]) == 0
    assert seen["task_only"] is None
    assert seen["discriminant"] == {
        "max_drop": section.discriminant.max_drop,
        "weights": section.discriminant.weights,
    }
    assert evaluate.main(argv[:2] + ["--discriminant_max_drop=1"]) == 0
    assert seen["discriminant"] == {"max_drop": 1.0, "weights": "auto"}
    assert evaluate.main(argv[:2] + ["--nodiscriminant_weights"]) == 0
    assert seen["discriminant"]["weights"] is False
    # A run written before the setting existed: 'auto'.
    older = section.to_dict()
    del older["discriminant"]["weights"]
    monkeypatch.setattr(
        composition,
        "load_run_config",
        lambda workdir: ml_collections.ConfigDict({"eval": older}),
    )
    assert evaluate.main(argv[:2]) == 0
    assert seen["discriminant"] == {
        "max_drop": section.discriminant.max_drop,
        "weights": "auto",
    }
    assert evaluate.main(argv[:2] + ["--nodiscriminant"]) == 0
    assert seen["discriminant"] is None


def test_diff_from_another_base_is_refused(run, tmp_path):
    """Diffs checked against a core that is not the one they were trained on."""
    import jax

    from moddiffy_jax import checkpoints
    from moddiffy_jax import export as export_lib

    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    core_path = mixed / "export" / "core.safetensors"
    core, meta = checkpoints.load_params(core_path)
    other = jax.tree.map(lambda x: x * 1.01, core)
    checkpoints.save_params(core_path, other, metadata=meta, overwrite=True)
    # The export's manifest notices the changed core first ...
    with pytest.raises(export_lib.IncompleteExport, match="SHA-256"):
        composition.evaluate_run(mixed, probe_config=FAST_PROBES)
    # ... and an export assembled by hand (manifest rewritten) is still
    # refused, by the diffs' base fingerprint.
    export_lib.write_manifest(mixed / "export", fingerprint="hand-made")
    with pytest.raises(ValueError, match="fingerprint"):
        composition.evaluate_run(mixed, probe_config=FAST_PROBES)
    assert evaluate.main(["--workdir", str(mixed), "--max_epochs=1"]) == 2


def test_partial_run_is_refused(run, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="config.json"):
        composition.evaluate_run(tmp_path)
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "export" / "core.safetensors").unlink()
    assert evaluate.main(["--workdir", str(partial)]) == 2
    assert "has not finished" in capsys.readouterr().err


def test_analyze_on_a_trained_run(run, tmp_path, capsys):
    from moddiffy_jax import analyze

    composition.evaluate_run(run, probe_config=FAST_PROBES, inlp=False)
    out = tmp_path / "analysis"
    assert analyze.main([str(run), "--out", str(out)]) == 0
    written = {p.name for p in out.iterdir()}
    assert {"sparsity.csv", "sparsity_heatmap.png", "summary.md"} <= written
    assert "overlap_attributes.csv" in written and "tradeoff.png" in written
    assert (out / "sparsity_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert "gender" in summary and "age" in summary


def test_command_lines_take_absl_flags(capsys):
    from moddiffy_jax import analyze, evaluate

    runs = evaluate.parse(["a", "--weight=g=0.5", "b", "--noinlp"], evaluate.FLAGS)
    assert runs == ["a", "b"]
    assert evaluate.FLAGS.weight == ["g=0.5"] and not evaluate.FLAGS.inlp
    assert evaluate.parse([], evaluate.FLAGS) == []  # parsed afresh each time
    assert evaluate.FLAGS.weight == [] and evaluate.FLAGS.inlp
    assert analyze.parse(["r1", "--out", "/o", "r2"], analyze.FLAGS) == ["r1", "r2"]
    assert analyze.FLAGS.out == "/o"
    assert evaluate.main(["--bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert evaluate.main(["--weight=x"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
    assert evaluate.main([]) == 2 and "--workdir" in capsys.readouterr().err
    assert analyze.main(["--split=train"]) == 2
    assert analyze.main([]) == 2


def test_known_representations_are_not_encoded_again(run, monkeypatch):
    """``known_reps`` (what the end-of-training table encoded) stand in for
    those rows' splits: the same results, only the rest encoded, and
    representations of another split's size are refused."""
    from moddiffy_jax.context import build_context
    from moddiffy_jax.eval import evaluator as evaluator_lib
    from moddiffy_jax.eval import forward

    fresh = composition.evaluate_run(run, probe_config=FAST_PROBES, inlp=False)
    ctx = build_context(composition.load_run_config(run))
    art = composition.load_artifacts(run)
    known: dict = {}
    rows = evaluator_lib.composition_table(
        ctx,
        evaluator_lib.Evaluator(ctx),
        art.core,
        art.head,
        # The run's order, and the correction of the two diffs' composition.
        {**{a: art.diffs[a] for a in ctx.attributes}, **art.joint},
        ("dev", "test"),
        reps_out=known,
    )
    assert list(known) == list(rows) and set(known["core"]) == {"dev", "test"}
    for label, row in rows.items():  # the table's accuracies read those reps
        assert row["test_task_acc"] == fresh["composition"][label]["test_task_acc"]
    encoded = []
    original = forward.Representer.represent

    def counted(self, params, split):
        encoded.append(split)
        return original(self, params, split)

    monkeypatch.setattr(forward.Representer, "represent", counted)
    again = composition.evaluate_run(
        run, probe_config=FAST_PROBES, inlp=False, known_reps=known
    )
    assert encoded == ["train"] * len(known)
    for label, row in fresh["composition"].items():
        assert again["composition"][label]["leakage"] == row["leakage"]
    known["core"]["test"] = known["core"]["test"][:5]
    with pytest.raises(ValueError, match="has 5 rows"):
        composition.evaluate_run(
            run, probe_config=FAST_PROBES, inlp=False, known_reps=known
        )


def test_attackers_on_worker_threads_give_the_same_table(run):
    """With ``threads`` > 1 the attackers train on worker threads while the
    next rows are encoded; every row (compositions, INLP, merges) reads as
    with one thread, in the same order."""
    import dataclasses

    merge = {"max_drop": 100.0, "select_train": 200, "candidates": 4}
    tables = [
        composition.evaluate_run(
            run,
            probe_config=dataclasses.replace(FAST_PROBES, threads=threads),
            token_merge=merge,
            task_only={},
        )["composition"]
        for threads in (1, 2)
    ]
    assert list(tables[0]) == list(tables[1])
    assert "core+INLP(age)" in tables[0] and "core+merge(age)" in tables[0]
    assert "core decision" in tables[0]
    for label, row in tables[0].items():
        assert tables[1][label]["leakage"] == row["leakage"], label


def test_a_row_sharing_an_earlier_rows_diff_copies_its_readings(monkeypatch):
    """The main job's three discriminant sets share one diff: probed once,
    each row keeps its own info."""
    probed = []

    def fake_row(ctx, readout, head, reps, *args, **kwargs):
        probed.append(reps)
        return {"leakage": {"gender": {"linear": len(probed)}}}

    monkeypatch.setattr(composition, "_row", fake_row)
    built = {
        "core+discriminant(gender)": ("a", None, {"kind": "discriminant"}),
        "core+discriminant(age)": (
            "a",
            None,
            {
                "kind": "discriminant",
                "weights": {"same_as": "core+discriminant(gender)"},
            },
        ),
        "core+discriminant(x)": ("b", None, {"kind": "discriminant", "weights": {}}),
    }
    rows = composition._readout_rows(None, built, None, True, (), None, True, "d")
    assert probed == ["a", "b"]
    assert rows["core+discriminant(age)"]["leakage"] == {"gender": {"linear": 1}}
    assert rows["core+discriminant(age)"]["d"]["weights"]["same_as"]
    assert rows["core+discriminant(gender)"]["d"] == {"kind": "discriminant"}
    assert rows["core+discriminant(x)"]["leakage"] == {"gender": {"linear": 2}}
    # Its own leakage mapping (each row's futures are resolved in place).
    first = rows["core+discriminant(gender)"]
    assert rows["core+discriminant(age)"]["leakage"] is not first["leakage"]
    future = concurrent.futures.Future()
    first["leakage"]["gender"] = future
    rows["core+discriminant(age)"]["leakage"]["gender"] = future
    future.set_result({"linear": 3})
    composition._resolve_leakage(rows)
    assert rows["core+discriminant(age)"]["leakage"]["gender"] == {"linear": 3}
    assert first["leakage"]["gender"] == {"linear": 3}


def test_the_parts_functions_are_kept_for_the_last_few_models_only():
    """``discriminant_diff._parts_fn`` keeps one jitted function per model
    object, for the latest ``_PARTS_KEPT`` models: a notebook that builds
    many models does not keep them all alive."""
    import types

    from moddiffy_jax.eval import discriminant_diff as dd

    dd._PARTS_FNS.clear()
    models = [
        types.SimpleNamespace(bert_config=types.SimpleNamespace(num_hidden_layers=2))
        for _ in range(dd._PARTS_KEPT + 2)
    ]
    first = dd._parts_fn(models[0])
    assert dd._parts_fn(models[0]) is first  # the same model: the same function
    for m in models[1:]:
        dd._parts_fn(m)
    held = [id(entry[0]) for entry in dd._PARTS_FNS.values()]
    assert held == [id(m) for m in models[-dd._PARTS_KEPT :]]
    dd._PARTS_FNS.clear()


def test_a_removal_the_converged_mlp_reads_back_is_named_linear_only():
    from moddiffy_jax.eval import report

    def row(lin, mlp):
        return {
            "leakage": {
                "dialect": {
                    "linear": {"test_balanced_accuracy": lin},
                    "mlp": {"test_balanced_accuracy": mlp},
                }
            }
        }

    floors = {"dialect": {"floor": 0.8, "chance": 0.5}}
    rows = {
        "core": row(0.96, 0.96),
        "core+eraser": row(0.85, 0.93),  # 0.69 linear, 0.19 mlp
        "core+swap": row(0.86, 0.87),  # 0.62, 0.56: both past half
        "core+weak": row(0.93, 0.95),  # under half under both
    }
    found = report.linear_only(rows, ["dialect"], floors)
    assert [(r, a) for r, a, _, _ in found] == [("core+eraser", "dialect")]
    assert found[0][2:] == pytest.approx((0.6875, 0.1875))
    lines = report._linear_only_lines(rows, ["dialect"], floors)
    assert "core+eraser (dialect: 0.69 linear, 0.19 mlp)" in lines[-1]
    # A row with no converged-MLP reading is left out, not flagged.
    rows["core+old"] = {
        "leakage": {"dialect": {"linear": {"test_balanced_accuracy": 0.8}}}
    }
    assert len(report.linear_only(rows, ["dialect"], floors)) == 1
