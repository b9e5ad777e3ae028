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


def test_a_run_from_before_auto_mix_resumes_only_as_it_was_trained(tmp_path):
    """``method.auto_mix`` (stop 78) defaults to True; a run made before it
    sent every attribute to the MMD where one fell short, so its config.json
    without the field resumes with auto_mix=False, not with the default."""
    config = tiny("moddiffy_par")
    workdir.prepare_workdir(config, tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    del saved["method"]["auto_mix"]
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="method.auto_mix: None -> True"):
        workdir.prepare_workdir(config, tmp_path)
    workdir.prepare_workdir(
        tiny("moddiffy_par", **{"method.auto_mix": False}), tmp_path
    )
