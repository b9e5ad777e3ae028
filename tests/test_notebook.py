"""notebooks/compose_diffs.ipynb runs top to bottom (its code cells, in
order, from its own folder) on the tiny config: the composition table and
its heat map, the weight sweep, per-layer sparsity and per-example routing."""

import json
import pathlib

import matplotlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_compose_diffs_notebook(tmp_path, monkeypatch, capsys):
    matplotlib.use("Agg")
    nb = json.loads((REPO / "notebooks" / "compose_diffs.ipynb").read_text())
    monkeypatch.setenv("MODDIFFY_RUN", str(tmp_path / "absent"))
    monkeypatch.chdir(REPO / "notebooks")  # as Jupyter starts it
    namespace = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(
                compile("".join(cell["source"]), "compose_diffs.ipynb", "exec"),
                namespace,
            )
    out = capsys.readouterr().out
    assert "synthetic data" in out
    assert namespace["ROOT"] == REPO  # found from notebooks/
    rows = namespace["rows"]
    assert set(rows) == {"core", "core+gender", "core+age", "core+all", "core+all/2"}
    for row in rows.values():
        assert 0 <= row["test_acc"] <= 1
        assert 0 <= row["gender leakage"] <= 1
    sweep = namespace["sweep"]
    assert len(sweep) == 7
    # w = 0 is the core, w = 1 the diff alone (the first diff: "age").
    assert namespace["swept"] == "age"
    assert sweep[2]["test_acc"] == rows["core"]["test_acc"]
    assert sweep[4]["test_acc"] == rows["core+age"]["test_acc"]
    assert list(namespace["routed_pred"]) == namespace["composed_pred"]
    import matplotlib.pyplot as plt

    plt.close("all")
