"""The README stays true: its example runs, and CI runs its test command."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    bash = _blocks("bash")
    test_command = next(b.strip() for b in bash if "pytest" in b)
    ci = (REPO / ".ci" / "run").read_text()
    assert test_command in ci


def test_readme_main_command_uses_an_existing_config():
    main = next(b for b in _blocks("bash") if "moddiffy_jax.main" in b)
    config = re.search(r"--config=(\S+?\.py)", main).group(1)
    assert (REPO / config).is_file()


def test_api_example_runs(capsys):
    blocks = _blocks("python")
    assert len(blocks) == 2  # the diff API, then per-example routing
    ns = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), ns)
    out = capsys.readouterr().out
    # Routing: row 0 ran on params + loaded, row 2 on params alone.
    import numpy as np

    from moddiffy_jax.models import bert

    routed, batch = ns["out"].last_hidden_state, ns["batch"]
    for row, p in ((0, ns["debiased"]), (2, ns["params"])):
        one = {k: v[row : row + 1] for k, v in batch.items()}
        want = bert.encode(ns["config"], p, one).last_hidden_state[0]
        np.testing.assert_allclose(routed[row], want, atol=1e-4)
    kept = re.search(r"([\d,]+) of ([\d,]+) kept", out)
    nnz, total = (int(x.replace(",", "")) for x in kept.groups())
    assert nnz == round(0.01 * total)
    assert float(out.split("CLS change:")[1]) > 0
