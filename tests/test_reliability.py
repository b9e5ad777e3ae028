"""Run-directory guards: the lock, metrics after a resume, staged exports with
a manifest, and the inputs' fingerprints."""

import json
import os
import socket

import numpy as np
import pytest

from moddiffy_jax import export as export_lib
from moddiffy_jax import train
from moddiffy_jax import workdir as workdir_lib
from tests.helpers import tiny


def _snapshot(directory):
    return {
        p.relative_to(directory): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_lock_keeps_a_second_writer_out_and_names_the_holder(tmp_path):
    with workdir_lib.RunLock(tmp_path):
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(workdir_lib.RunLocked) as e:
            workdir_lib.RunLock(tmp_path).acquire()
        assert f"pid {os.getpid()}" in str(e.value)
        assert socket.gethostname() in str(e.value)
        # The trainer refuses before reading or writing anything.
        before = _snapshot(tmp_path)
        with pytest.raises(workdir_lib.RunLocked):
            train.train_and_evaluate(tiny("finetune"), tmp_path)
        assert _snapshot(tmp_path) == before
    assert not (tmp_path / ".lock").exists()
    with workdir_lib.RunLock(tmp_path):  # free again
        pass


def test_stale_lock_is_taken_over_and_a_foreign_one_needs_break_lock(tmp_path):
    lock = tmp_path / ".lock"
    # Left by a process of this host that died (nobody holds the flock).
    lock.write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))
    with workdir_lib.RunLock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    # Left on another host: cannot be checked from here.
    lock.write_text(json.dumps({"pid": 12, "host": "node-17.example"}))
    with pytest.raises(workdir_lib.RunLocked, match="node-17.example.*--break_lock"):
        workdir_lib.RunLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["host"] == "node-17.example"  # untouched
    with workdir_lib.RunLock(tmp_path, break_lock=True):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_metrics_after_a_resume_have_no_repeated_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "phase": "l0", "loss": float(s)} for s in range(1, 7)]
    lines.append({"step": 4, "phase": "fixmask", "probe": 0.5})  # eval after a cut
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "pha'  # torn
    )
    writer = workdir_lib.MetricWriter(tmp_path, resume_step=4)
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 4]
    writer.write(4, {"phase": "fixmask", "probe": 0.5})  # written again: skipped
    writer.write(5, {"phase": "fixmask", "loss": 5.0})
    writer.close()
    steps = [
        (r["step"], r["phase"]) for r in map(json.loads, path.read_text().splitlines())
    ]
    assert len(steps) == len(set(steps)) == 6


def test_staged_export_lands_whole_or_not_at_all(tmp_path):
    with export_lib.staged_export(tmp_path, fingerprint="abc") as stage:
        assert stage.dir != tmp_path / "export"
        (stage.dir / "diffs").mkdir()
        (stage.dir / "core.bin").write_bytes(b"core")
        (stage.dir / "diffs" / "a.bin").write_bytes(b"diff")
        report = stage.final_paths({"path": str(stage.dir / "diffs" / "a.bin")})
        assert not (tmp_path / "export").exists()
    export = tmp_path / "export"
    assert report["path"] == str(export / "diffs" / "a.bin")
    manifest = export_lib.verify_export(export)
    assert manifest["base_fingerprint"] == "abc"
    assert set(manifest["files"]) == {"core.bin", "diffs/a.bin"}
    before = _snapshot(tmp_path)
    # A failed re-export leaves the finished one as it was, and no temporary.
    with pytest.raises(RuntimeError):
        with export_lib.staged_export(tmp_path, fingerprint="abc") as stage:
            (stage.dir / "core.bin").write_bytes(b"half")
            raise RuntimeError("killed")
    assert _snapshot(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    # A changed file or a missing manifest is refused, naming the fix.
    (export / "diffs" / "a.bin").write_bytes(b"DIFF")
    with pytest.raises(export_lib.IncompleteExport, match="SHA-256.*Re-run"):
        export_lib.verify_export(export)
    (export / export_lib.MANIFEST_NAME).unlink()
    with pytest.raises(export_lib.IncompleteExport, match="MANIFEST.json"):
        export_lib.verify_export(export)


def test_changed_inputs_are_refused_with_what_changed(tmp_path):
    import dataclasses

    ctx = train.build_context(tiny("finetune"))
    recorded = workdir_lib.check_inputs(tmp_path, ctx)
    assert {"base model", "tokenizer", "train split", "test split"} <= set(recorded)
    assert workdir_lib.check_inputs(tmp_path, ctx) == recorded
    train_split = ctx.data.splits["train"]
    flipped = dataclasses.replace(train_split, task=1 - np.asarray(train_split.task))
    data = dataclasses.replace(ctx.data, splits={**ctx.data.splits, "train": flipped})
    changed = dataclasses.replace(ctx, data=data)
    with pytest.raises(workdir_lib.InputsChanged, match="train split.*--allow_changed"):
        workdir_lib.check_inputs(tmp_path, changed)
    workdir_lib.check_inputs(tmp_path, changed, allow_changed=True)
    # The record keeps what the run started with.
    assert json.loads((tmp_path / "inputs.json").read_text()) == recorded


def test_compilation_cache_defaults_to_the_user_cache_dir():
    from moddiffy_jax import main

    xdg = {"XDG_CACHE_HOME": "/c"}
    assert main.compilation_cache_dir(None, xdg) == "/c/moddiffy_jax/jax"
    env = {"JAX_COMPILATION_CACHE_DIR": "/j", **xdg}
    assert main.compilation_cache_dir(None, env) == "/j"
    assert main.compilation_cache_dir("/f", env) == "/f"
    assert main.compilation_cache_dir("", env) == ""  # off
