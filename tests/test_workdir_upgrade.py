"""A run directory written before a field was added to the library."""

import json

import pytest

from moddiffy_jax import workdir
from tests.helpers import tiny


def test_a_field_added_since_the_run_started_resumes_only_at_its_default(tmp_path):
    config = tiny("moddiffy_par")
    workdir.prepare_workdir(config, tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    # The run started before the library had this field.
    del saved["method"]["swap_compose"]
    path.write_text(json.dumps(saved))
    workdir.prepare_workdir(config, tmp_path)  # its default: the same run
    assert "swap_compose" not in json.loads(path.read_text())["method"]
    # Set away from its default it is another run, as is any changed field.
    for fields in ({"method.swap_compose": True}, {"seed": 5}):
        with pytest.raises(ValueError, match="different config"):
            workdir.prepare_workdir(tiny("moddiffy_par", **fields), tmp_path)
