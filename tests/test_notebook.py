"""notebooks/compose_diffs.ipynb runs top to bottom (its code cells, in order)."""

import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_compose_diffs_notebook(tmp_path, monkeypatch, capsys):
    nb = json.loads((REPO / "notebooks" / "compose_diffs.ipynb").read_text())
    monkeypatch.setenv("MODDIFFY_RUN", str(tmp_path / "absent"))
    namespace = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(
                compile("".join(cell["source"]), "compose_diffs.ipynb", "exec"),
                namespace,
            )
    out = capsys.readouterr().out
    assert "synthetic data" in out
    rows = namespace["rows"]
    assert set(rows) == {"core", "core+gender", "core+age", "core+all", "core+all/2"}
    for row in rows.values():
        assert 0 <= row["test_acc"] <= 1
        assert 0 <= row["gender leakage"] <= 1
