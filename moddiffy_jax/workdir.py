"""A run directory: its guards, the metrics writer, the preemption signal.

``prepare_workdir`` refuses a directory that holds a run of another config;
``RunLock`` keeps a second process out; ``check_inputs`` refuses a resume or
evaluation on another base model, tokenizer or data; ``MetricWriter``
appends JSON lines (and TensorBoard scalars) on process 0, with no repeated
steps after a resume; ``preemption_handler`` turns SIGTERM into a save and
a clean stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints
from moddiffy_jax._files import temp_file_beside

# Config keys whose change does not make a different run (how long to log,
# where to stop for a simulated preemption, ...).
_VOLATILE_KEYS = ("train.stop_at_step", "train.log_every", "train.progress")


def _flat_config(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A JSON-able dict of the resolved config (tuples become lists)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def _added_at_default(config, old: Mapping, new: Mapping) -> set[str]:
    """Fields the run's config.json lacks (added to the library since the run
    started) whose value is the library's default: the run had that
    behaviour, so a resume after an upgrade is the same run."""
    missing = set(new) - set(old)
    if not missing or "name" not in config.get("method", {}):
        return set()
    from moddiffy_jax import config_lib

    default = _flat_config(config_to_dict(config_lib.base_config(config.method.name)))
    default.update({k: v for k, v in _BEHAVIOUR_BEFORE.items() if k in default})
    return {k for k in missing if k in default and default[k] == new[k]}


#: Fields whose default is not what a run made before the field existed
#: did: its value there (``method.auto_mix``, stop 78: such a run sent every
#: attribute to the MMD where one fell short of the swaps' read).
_BEHAVIOUR_BEFORE = {"method.auto_mix": False}


def check_workdir(config: ml_collections.ConfigDict, workdir: Path) -> None:
    """Refuses ``workdir`` if it is a file or holds a run of another config.

    Writes nothing (a config that fails later validation leaves no trace).
    """
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise NotADirectoryError(
            f"--workdir {workdir} is a file, not a directory: choose another path."
        )
    if (workdir / "config.json").exists():
        prepare_workdir(config, workdir, write=False)


def prepare_workdir(
    config: ml_collections.ConfigDict, workdir: Path, *, write: bool = True
) -> None:
    """Creates ``workdir`` or checks it holds a run of the same config.

    Raises:
      ValueError: if ``workdir`` holds a run with a different config; nothing
        in it is touched.
    """
    workdir = Path(workdir)
    path = workdir / "config.json"
    new = config_to_dict(config)
    if path.exists():
        old = json.loads(path.read_text())
        a, b = _flat_config(old), _flat_config(new)
        added = _added_at_default(config, a, b)
        changed = sorted(
            k
            for k in set(a) | set(b)
            if a.get(k) != b.get(k) and k not in _VOLATILE_KEYS and k not in added
        )
        if changed:
            details = ", ".join(
                f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:8]
            )
            raise ValueError(
                f"{workdir} already holds a run with a different config ({details}). "
                "Use a new --workdir, or delete this one if you no longer need it."
            )
    if write and not path.exists() and jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoints.write_json_atomic(path, new)


def _record_key(record: Mapping[str, Any]) -> str:
    return json.dumps(sorted(k for k in record if k != "step") + [record.get("phase")])


class MetricWriter:
    """JSON lines plus TensorBoard scalars under the run directory.

    Args:
      workdir: the run directory.
      resume_step: the step the run resumes from (0 for a fresh start).
        Records after it, written by an earlier attempt that died before its
        next checkpoint, are dropped (and a torn last line), and records the
        resumed run writes again at ``resume_step`` itself (an evaluation
        after a phase's last step) are not repeated: every (step, kind of
        record) appears once.
    """

    def __init__(self, workdir: Path, *, resume_step: int = 0):
        self.path = workdir / "metrics.jsonl"
        self.tb = None
        self._at_resume: set[str] = set()
        self._resume_step = int(resume_step)
        if jax.process_index() != 0:
            return
        self._truncate()
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(workdir / "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self.tb = None

    def _truncate(self) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by a kill mid-write
                continue
            if record.get("step", 0) <= self._resume_step:
                kept.append(line)
                if record.get("step") == self._resume_step:
                    self._at_resume.add(_record_key(record))
        tmp = temp_file_beside(self.path)
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if jax.process_index() != 0:
            return
        record = {"step": int(step), **record}
        if step == self._resume_step and self._at_resume:
            key = _record_key(record)
            if key in self._at_resume:
                return
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Preempted(RuntimeError):
    """A run stopped early after saving: a SIGTERM, or ``train.stop_at_step``.

    ``main`` reports it and exits 0; re-running the same command resumes.
    """

    def __init__(self, step: int, reason: str = "config.train.stop_at_step"):
        super().__init__(
            f"Stopped at step {step} ({reason}) after saving its checkpoint; "
            "re-run the same command to resume."
        )
        self.step = step
        self.reason = reason


def progress_bar(config, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=config.method.name,
        disable=not config.train.progress,
        dynamic_ncols=True,
    )


# --------------------------------------------------------------------------
# One process per run directory.


class RunLocked(RuntimeError):
    """Another live process holds the run directory's lock."""


_LOCK_NAME = ".lock"


def _holder_text(info: Mapping[str, Any]) -> str:
    return (
        f"pid {info.get('pid', '?')} on host {info.get('host', '?')} "
        f"(since {info.get('started', '?')})"
    )


class RunLock:
    """An exclusive lock on a run directory, held while a process writes to it.

    ``workdir/.lock`` holds the holder's pid, host and start time. The lock
    itself is an ``fcntl.flock`` on that file, which the kernel drops when the
    holder dies (also on SIGKILL), so a lock left by a dead process on this
    host is taken over without asking. A lock file written on *another* host
    cannot be checked from here: it is refused unless ``break_lock`` (the
    ``--break_lock`` flag), or the file is deleted. In a multi-process run
    only process 0 takes it.

    Use as a context manager; ``acquire``/``release`` are idempotent.
    """

    def __init__(self, workdir: str | os.PathLike, *, break_lock: bool = False):
        self.path = Path(workdir) / _LOCK_NAME
        self.break_lock = break_lock
        self._fd: int | None = None

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLocked(
                    f"{self.path.parent} is in use by {_holder_text(self._read())}: "
                    "one process writes a run directory at a time. Wait for it to "
                    "finish, stop it, or use another --workdir."
                ) from None
            # The holder may have removed the file between our open and
            # flock: then we hold a lock on a deleted file; try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = self._read()
        if old and old.get("host") != host and not self.break_lock:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise RunLocked(
                f"{self.path.parent} was locked by {_holder_text(old)}, which this "
                f"host ({host}) cannot check. If that run has stopped, pass "
                f"--break_lock (train_and_evaluate(..., break_lock=True)) or delete "
                f"{self.path}."
            )
        if old:
            logging.warning(
                "Taking over the lock of %s, left by %s, which no longer runs.",
                self.path.parent,
                _holder_text(old),
            )
        info = {
            "pid": os.getpid(),
            "host": host,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(workdir: str | os.PathLike, *, break_lock: bool = False):
    """``RunLock`` on process 0 only (the others write nothing there)."""
    if jax.process_index() != 0:
        yield None
        return
    workdir = Path(workdir)
    created = not workdir.exists()
    try:
        with RunLock(workdir, break_lock=break_lock) as lock:
            yield lock
    finally:
        # A run refused before writing anything leaves no empty directory.
        if created and workdir.is_dir() and not any(workdir.iterdir()):
            workdir.rmdir()


# --------------------------------------------------------------------------
# Preemption: SIGTERM asks the loop to save at the next step and stop.


class _StopRequest:
    """Set by the SIGTERM handler; read by the training loops between steps."""

    signal_name: str | None = None


_STOP = _StopRequest()


def stop_requested() -> str | None:
    """The name of the signal that asked the run to stop, or None."""
    return _STOP.signal_name


@contextlib.contextmanager
def preemption_handler():
    """While active, SIGTERM makes :func:`stop_requested` true instead of killing.

    The loop then saves a checkpoint at the next step boundary and raises
    :class:`Preempted` (``main`` exits 0 with a note on how to resume). A
    second SIGTERM while saving is ignored; SIGKILL cannot be caught, and a
    run killed so resumes from its last periodic checkpoint. Outside the main
    thread (a notebook's worker thread) no handler can be installed and the
    signal keeps its default action.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        del frame
        _STOP.signal_name = signal.Signals(signum).name

    previous = signal.signal(signal.SIGTERM, handler)
    _STOP.signal_name = None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _STOP.signal_name = None


def agree_to_stop(local: bool) -> bool:
    """Whether any process wants to stop (all processes get the same answer)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([local], np.int32))
    return bool(np.any(flags))


# --------------------------------------------------------------------------
# What a run was trained from: the base model, tokenizer and data.


class InputsChanged(ValueError):
    """The base model, tokenizer or data differ from those the run started with."""


_INPUTS_NAME = "inputs.json"


def _hash_arrays(h, name: str, value: Any) -> None:
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(json.dumps([name, list(a.shape), str(a.dtype)]).encode())
        h.update(a.reshape(-1).view(np.uint8))
    elif isinstance(value, Mapping):
        for k in sorted(value):
            _hash_arrays(h, f"{name}/{k}", value[k])


def split_fingerprint(split: Any) -> str:
    """A content hash of a data split's arrays (token ids, images, labels).

    Derived extras (``extras``, e.g. a teacher's probabilities) are left out:
    they are recomputed from the inputs.
    """
    h = hashlib.sha256()
    for field in dataclasses.fields(split):
        if field.name != "extras":
            _hash_arrays(h, field.name, getattr(split, field.name))
    return h.hexdigest()[:16]


def _tokenizer_fingerprint(config) -> str:
    from moddiffy_jax.models import text as text_lib

    tok = text_lib.load_tokenizer_for(config.model)
    backend = getattr(tok, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else json.dumps(sorted(tok.get_vocab().items()))
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run_core_fingerprint(run_dir: str) -> str:
    from safetensors import safe_open

    path = Path(run_dir) / "export" / "core.safetensors"
    if not path.is_file():  # the method that reads it says what is wrong
        return "missing"
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("metadata", "{}"))
    return str(meta.get("fingerprint", ""))


def input_fingerprints(ctx) -> dict[str, str]:
    """Content hashes of what a run reads: base params, tokenizer, data splits
    and any run it builds on (``method.core_run``, ``method.teacher_run``)."""
    from moddiffy_jax.context import is_vision
    from moddiffy_jax.subnets import sparse_diff

    out = {"base model": sparse_diff.fingerprint(ctx.pretrained)}
    if not is_vision(ctx.config):
        out["tokenizer"] = _tokenizer_fingerprint(ctx.config)
    for name in sorted(ctx.data.splits):
        out[f"{name} split"] = split_fingerprint(ctx.data.splits[name])
    for key in ("core_run", "teacher_run"):
        run = ctx.config.method.get(key)
        if run:
            out[f"method.{key} core"] = _run_core_fingerprint(run)
    return out


def check_inputs(
    workdir: str | os.PathLike,
    ctx,
    *,
    allow_changed: bool = False,
    record: bool = True,
) -> dict[str, str]:
    """Refuses to go on with inputs other than those the run started with.

    The first call on a run directory records ``inputs.json`` (when
    ``record``); later calls (a resume, ``evaluate``) compare.

    Raises:
      InputsChanged: naming each input that differs, unless ``allow_changed``
        (``--allow_changed_inputs``), which logs a warning instead and keeps
        the recorded fingerprints.
    """
    path = Path(workdir) / _INPUTS_NAME
    now = input_fingerprints(ctx)
    if not path.exists():
        if record:
            record_inputs(workdir, now)
        return now
    before = json.loads(path.read_text())
    changed = sorted(k for k in set(before) & set(now) if before[k] != now[k])
    if changed:
        what = "; ".join(f"{k}: {before[k]} -> {now[k]}" for k in changed)
        message = (
            f"The inputs of the run in {workdir} changed since it started ({what}). "
            "A resume or evaluation on other inputs would mix two runs: restore "
            "the original model directory / data files, or use a new --workdir. "
            "If the change is harmless (e.g. the same data re-exported), pass "
            "--allow_changed_inputs."
        )
        if not allow_changed:
            raise InputsChanged(message)
        logging.warning("%s Going on (--allow_changed_inputs).", message)
    return now


def record_inputs(workdir: str | os.PathLike, fingerprints: Mapping[str, str]) -> None:
    """Writes ``inputs.json`` (process 0) unless the run already has one."""
    path = Path(workdir) / _INPUTS_NAME
    if not path.exists() and jax.process_index() == 0:
        checkpoints.write_json_atomic(path, dict(fingerprints))
