"""The tiny MoDDiffy-par run end to end, and the runs checked against it:
exact budgets and the exported composition; resume after SIGTERM (in
process) and after SIGKILL during a checkpoint write and the export (command
line, two devices); the batch split over two devices, and two processes for
real (``jax.distributed`` with two CPU processes, local coordinator, gloo
collectives, one device each: training, a SIGTERM both processes agree on,
resume, export and evaluation), each equal to the one-device or two-device
run. Kept in one module so that its two reference runs are built once."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from moddiffy_jax import checkpoints, train
from moddiffy_jax.eval import composition
from moddiffy_jax.eval.evaluator import compositions
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection
from tests.helpers import (
    TINY_PAR_CLI,
    check_run,
    cli_env,
    exported_corrections,
    exported_diffs,
    tiny,
)

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def par_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("par")
    return workdir, train.train_and_evaluate(tiny("moddiffy_par"), workdir)


def test_moddiffy_par_exports_exact_budget_diffs(par_run):
    workdir, results = par_run
    core = check_run(workdir, results, "moddiffy_par")
    files = exported_diffs(workdir)
    assert [f.stem for f in files] == ["age", "gender"]
    assert set(results["composition"]) == {
        "core",
        "core+gender",
        "core+age",
        "core+gender+age",
    }
    config = tiny("moddiffy_par")
    selected = selection.select_paths(
        core, config.diff.include, exclude=config.diff.exclude
    )
    n = sum(int(np.size(selection.flatten(core)[p])) for p in selected)
    for f in files:
        diff = diffs_lib.load_sparse_diff(f, base=core)  # fingerprint checked
        assert diff.nnz() == round(config.diff.keep * n)
        assert diff.num_selected() == n
        assert results["diffs"][f.stem]["nnz"] == diff.nnz()
    # The diffs really differ from each other and from zero.
    a, b = (diffs_lib.load_sparse_diff(f) for f in files)
    assert any(np.any(np.asarray(v) != 0) for v in a.values.values())
    assert a.indices.keys() == b.indices.keys()
    # Both diffs erased (diff.erasure='auto', MMD): one correction of their
    # composition beside them, within the rows their erasers hold.
    (fix_file,) = exported_corrections(workdir)
    assert fix_file.stem == "gender+age"
    fix = diffs_lib.load_sparse_diff(fix_file, base=core)  # fingerprint checked
    eraser_entries = sum(results["finish"][a]["entries"] for a in ("gender", "age"))
    assert 0 < fix.nnz() <= eraser_entries
    assert results["diffs"]["gender+age"]["nnz"] == fix.nnz()
    assert set(results["finish"]["gender+age"]["attributes"]) == {"gender", "age"}


def test_exported_diff_composition_matches_results(par_run):
    """Re-evaluating the exported files reproduces the run's table."""
    workdir, results = par_run
    config = tiny("moddiffy_par")
    ctx = train.build_context(config)
    core, _ = checkpoints.load_params(workdir / "export" / "core.safetensors")
    head, _ = checkpoints.load_params(workdir / "export" / "task_head.safetensors")
    files = {f.stem: f for f in exported_diffs(workdir)}
    diffs = [diffs_lib.load_sparse_diff(files[n], base=core) for n in ("gender", "age")]
    (fix_file,) = exported_corrections(workdir)
    fix = diffs_lib.load_sparse_diff(fix_file, base=core)
    evaluator = train.Evaluator(ctx)
    # The row of both diffs adds their correction (methods/joint_erasure.py).
    params = evaluator.compose(core, [*diffs, fix])
    acc, h = evaluator.accuracy_and_reps(params, head, "dev")
    assert acc == pytest.approx(
        results["composition"]["core+gender+age"]["dev_task_acc"]
    )
    art = composition.load_artifacts(workdir)
    assert sorted(art.diffs) == ["age", "gender"] and list(art.joint) == ["gender+age"]
    rows = {
        label: p
        for label, _, p in compositions(
            evaluator, art.core, {**art.diffs, **art.joint}, ("gender", "age")
        )
    }
    np.testing.assert_array_equal(
        evaluator.forward.represent_split(
            rows["core+gender+age"], ctx.data.splits["dev"]
        ),
        h,
    )
    # Without the correction the composition differs.
    plain = evaluator.compose(core, diffs)
    assert not np.array_equal(
        evaluator.forward.represent_split(plain, ctx.data.splits["dev"]), h
    )


def _assert_same_exports(full_dir, workdir):
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(full_dir / "export" / name)
        b, _ = checkpoints.load_params(workdir / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    assert exported_diffs(full_dir)
    for f in exported_diffs(full_dir) + exported_corrections(full_dir):
        a = diffs_lib.load_sparse_diff(f)
        b = diffs_lib.load_sparse_diff(workdir / "export" / f.parent.name / f.name)
        for p in a.indices:
            np.testing.assert_array_equal(a.indices[p], b.indices[p])
            np.testing.assert_array_equal(a.values[p], b.values[p])


def test_sigterm_saves_at_the_next_step_and_resumes_exactly(
    par_run, tmp_path, monkeypatch
):
    from moddiffy_jax import parallel

    shard, calls = parallel.shard_batch, []

    def shard_then_signal(batch, mesh):
        calls.append(1)
        if len(calls) == 6:  # the preemption notice arrives during step 6
            os.kill(os.getpid(), signal.SIGTERM)
        return shard(batch, mesh)

    monkeypatch.setattr(parallel, "shard_batch", shard_then_signal)
    config = tiny("moddiffy_par", **{"eval.leakage": False})  # exports only
    with pytest.raises(train.Preempted, match="SIGTERM received.*re-run") as info:
        train.train_and_evaluate(config, tmp_path)
    assert info.value.step == 6  # in the fixmask phase (the L0 phase: the
    # command-line tests stop and resume there)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed
    ckpt = checkpoints.RunCheckpointer(tmp_path / "checkpoints")
    assert ckpt.latest_step() == 6
    ckpt.close()
    monkeypatch.undo()
    train.train_and_evaluate(config, tmp_path)
    _assert_same_exports(par_run[0], tmp_path)
    steps = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]
    assert steps == sorted(steps)


def _wait_for(proc, condition, what, timeout=300.0):
    """Polls ``condition`` every millisecond while ``proc`` runs."""
    import time

    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run ended before {what}:\n{out}\n{err[-3000:]}")
        time.sleep(0.001)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def test_data_parallel_run_equals_the_single_device_run(par_run, two_device_run):
    """The whole tiny MoDDiffy-par run with the batch split over two devices
    (command line) against one device (in process): equal to float32
    rounding (the batch reductions are split differently), same kept
    entries."""
    one, two = par_run[0], two_device_run
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(one / "export" / name)
        b, _ = checkpoints.load_params(two / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # The closed-form eraser (diff.erasure; methods/erasure_refit.py) is a
    # least-squares fit to float32 features through a within-class
    # covariance with a small ridge, on this tiny model ill-conditioned: the
    # rounding of the split batch reductions moves it by up to about 2%
    # (measured: 1.8% in single entries, 1.6% of the bias's norm); the
    # eraser as a whole must agree within 5%.
    last = f"encoder/layer_{tiny('moddiffy_par').model.num_layers - 1}/output/dense/"
    for f in exported_diffs(one):
        a = diffs_lib.load_sparse_diff(f)
        b = diffs_lib.load_sparse_diff(two / "export" / "diffs" / f.name)
        for p in a.indices:
            np.testing.assert_array_equal(a.indices[p], b.indices[p])
            if p.startswith(last):
                gap = np.linalg.norm(a.values[p] - b.values[p])
                assert gap <= 5e-2 * np.linalg.norm(a.values[p]), (p, gap)
                continue
            np.testing.assert_allclose(a.values[p], b.values[p], rtol=1e-4, atol=1e-5)
    # The correction of the composition (methods/joint_erasure.py) is the
    # difference of two such fits: what must agree within 5% is what it
    # makes of the composed last layer, both diffs and the correction added.
    (fix,) = exported_corrections(one)
    parts = [*exported_diffs(one), fix]
    for p in diffs_lib.load_sparse_diff(fix).indices:
        a, b = (
            sum(
                _dense(diffs_lib.load_sparse_diff(run / f.parent.name / f.name), p)
                for f in parts
            )
            for run in (one / "export", two / "export")
        )
        gap = np.linalg.norm(a - b)
        assert gap <= 5e-2 * np.linalg.norm(a), (p, gap)


def _dense(sd, path):
    """The values of ``sd`` at ``path`` as a dense flat array."""
    out = np.zeros(int(np.prod(dict(sd.shapes)[path])), np.float64)
    out[np.asarray(sd.indices[path])] = np.asarray(sd.values[path])
    return out


def test_killed_runs_resume_to_the_uninterrupted_result(two_device_run, tmp_path):
    """The command line run (two devices), SIGKILLed during an async
    checkpoint write and during the export; the last resume ends with the
    uninterrupted run's exports, bit for bit."""
    workdir = tmp_path / "run"
    command = [sys.executable, *TINY_PAR_CLI, f"--workdir={workdir}"]

    def start():
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=cli_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def saving():
        return any(".orbax-checkpoint-tmp" in p.name for p in ckpts.glob("*"))

    ckpts = workdir / "checkpoints"
    # (SIGTERM through the command line: the two-process test below.)
    run = start()  # 1. SIGKILL while Orbax writes a checkpoint
    _wait_for(run, saving, "an async checkpoint write")
    run.kill()
    run.communicate()
    run = start()  # 2. SIGKILL while the export is being written
    _wait_for(run, lambda: any(workdir.glob(".export-new-*")), "the export")
    run.kill()
    run.communicate()
    assert not (workdir / "results.json").exists()
    with pytest.raises(FileNotFoundError, match="incomplete|missing"):
        composition.load_artifacts(workdir)
    run = start()  # 3. to the end
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    _assert_same_exports(two_device_run, workdir)
    assert not list(workdir.glob(".export-*"))
    steps = [json.loads(x)["step"] for x in open(workdir / "metrics.jsonl")]
    assert steps == sorted(steps)


def test_workdir_with_other_run_is_refused(par_run):
    workdir, _ = par_run
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="different config"):
        train.train_and_evaluate(tiny("moddiffy_par", seed=1), workdir)
    after = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
    assert before == after


@pytest.fixture(scope="module")
def two_device_run(tmp_path_factory):
    """The tiny MoDDiffy-par command line, one process driving two CPU
    devices (the batch split on "data"): the reference of the crash and
    multi-process tests, and the data-parallel side of the one-device check."""
    workdir = tmp_path_factory.mktemp("two_devices") / "run"
    out = subprocess.run(
        [sys.executable, *TINY_PAR_CLI, f"--workdir={workdir}"],
        cwd=REPO,
        env=cli_env(2),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_pair(workdir):
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, *TINY_PAR_CLI, f"--workdir={workdir}", "--distributed"]
            + [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
            + [f"--process_id={i}"],
            cwd=REPO,
            env=cli_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]


def _finish(procs):
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    return [out for out, _ in outs]


def test_two_processes_equal_one_process_on_two_devices(two_device_run, tmp_path):
    one, two = two_device_run, tmp_path / "two"
    procs = _start_pair(two)
    # The preemption notice reaches both once the first checkpoint exists.
    end = time.time() + 300
    while not (two / "metrics.jsonl").exists() and time.time() < end:
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = _finish(procs)
    stops = {o.split("Stopped at step ")[1].split()[0] for o in outs}
    assert len(stops) == 1, outs  # both saved the same step
    assert not (two / "results.json").exists()
    outs = _finish(_start_pair(two))  # resume, export, evaluate
    assert "results:" in outs[0] and "results:" not in outs[1]  # the chief prints
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(one / "export" / name)
        b, _ = checkpoints.load_params(two / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    diffs = sorted((one / "export" / "diffs").glob("*.safetensors"))
    assert diffs
    for f in diffs:
        a = diffs_lib.load_sparse_diff(f)
        b = diffs_lib.load_sparse_diff(two / "export" / "diffs" / f.name)
        for p in a.indices:
            np.testing.assert_array_equal(a.indices[p], b.indices[p])
            np.testing.assert_array_equal(a.values[p], b.values[p])
    r1 = json.loads((one / "results.json").read_text())
    r2 = json.loads((two / "results.json").read_text())
    assert r1["composition"] == r2["composition"]


def test_hugging_face_export_round_trip(par_run, tmp_path):
    """core + 1.0 gender + 0.5 age written as a BERT directory reads back
    through our loader as exactly the composed encoder, with the run's
    tokenizer and task head beside it."""
    import safetensors.numpy

    from moddiffy_jax import hf_export
    from moddiffy_jax.models import bert_files

    workdir, _ = par_run
    out = tmp_path / "hf"
    hf_export.export_hf(workdir, out, {"gender": 1.0, "age": 0.5})
    core, _ = checkpoints.load_params(workdir / "export" / "core.safetensors")
    files = {f.stem: f for f in exported_diffs(workdir)}
    d = [diffs_lib.load_sparse_diff(files[n], base=core) for n in ("age", "gender")]
    want = diffs_lib.apply_diffs(core, d, [0.5, 1.0])
    config, got = bert_files.load_pretrained(out)
    # The run's own layer count (the tiny configs: 1), not BertConfig.tiny's 2.
    assert config.num_hidden_layers == 1 and config.hidden_size == 32
    flat_got, flat_want = selection.flatten(got), selection.flatten(want)
    assert flat_got.keys() == flat_want.keys()
    for p in flat_want:
        np.testing.assert_array_equal(np.asarray(flat_got[p]), np.asarray(flat_want[p]))
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    q = tensors["encoder.layer.0.attention.self.query.weight"]
    np.testing.assert_array_equal(
        q, np.asarray(flat_want["encoder/layer_0/attention/self/query/kernel"]).T
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["architectures"] == ["BertModel"]
    assert bert_files.load_tokenizer(out)("a test")["input_ids"][0] == 101
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
    info = json.loads((out / "moddiffy.json").read_text())
    assert info["diffs"] == {"age": 0.5, "gender": 1.0}
    assert info["encoder_fingerprint"] == diffs_lib.fingerprint(want)
    head, _ = checkpoints.load_params(out / hf_export.HEAD_FILE)
    run_head, _ = checkpoints.load_params(workdir / "export" / "task_head.safetensors")
    for x, y in zip(jax.tree.leaves(head), jax.tree.leaves(run_head), strict=True):
        np.testing.assert_array_equal(x, y)
    # Both at weight 1: the composition's correction is added, as in the
    # run's table (methods/joint_erasure.py).
    hf_export.export_hf(workdir, tmp_path / "both", {"gender": 1.0, "age": 1.0})
    (fix_file,) = exported_corrections(workdir)
    fix = diffs_lib.load_sparse_diff(fix_file, base=core)
    want = diffs_lib.apply_diffs(core, [*d, fix], [1.0, 1.0, 1.0])
    _, got = bert_files.load_pretrained(tmp_path / "both")
    flat_got, flat_want = selection.flatten(got), selection.flatten(want)
    for p in flat_want:
        np.testing.assert_array_equal(np.asarray(flat_got[p]), np.asarray(flat_want[p]))
    info = json.loads((tmp_path / "both" / "moddiffy.json").read_text())
    assert info["joint_correction"] == "gender+age"


def test_hugging_face_export_refuses_bad_requests(par_run, tmp_path, capsys):
    from moddiffy_jax import hf_export

    workdir, _ = par_run
    out = tmp_path / "hf"
    args = [f"--workdir={workdir}", f"--out={out}"]
    assert hf_export.main([*args, "--diff=race"]) == 2
    assert (
        "has no diff ['race']; its diffs: ['age', 'gender']" in capsys.readouterr().err
    )
    assert hf_export.main([*args, "--diff=age=half"]) == 2
    assert "'half' is not a number" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".hf-new-*"))
    assert hf_export.main(args) == 0  # the core alone
    before = (out / "model.safetensors").read_bytes()
    assert hf_export.main([*args, "--diff=gender"]) == 2
    assert (
        "exists; choose a new directory or pass --overwrite" in capsys.readouterr().err
    )
    assert (out / "model.safetensors").read_bytes() == before  # untouched
    assert hf_export.main([*args, "--diff=gender", "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != before
    assert json.loads((out / "moddiffy.json").read_text())["diffs"] == {"gender": 1.0}
