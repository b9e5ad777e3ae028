#!/usr/bin/env bash
# One prepared call of a lent GPU machine for benchmarks/gpu.py (issue 14).
#
#   bash benchmarks/gpu_lease.sh prepare     # here: wheels into .whl/, MiniLM's
#                                            # tokenizer files into .gpu/tok/
#   bash benchmarks/gpu_lease.sh run [ARGS]  # there (carry .whl and .gpu):
#                                            # benchmarks/gpu.py ARGS
#
# The machine's image has jax (CUDA), flax, optax, orbax and chex but not
# ml-collections, grain, array-record or portpicker, and no MiniLM package;
# .whl/ and .gpu/ are ignored by git: name both in the call's carry. `run` turns
# XLA's GPU autotuning and Triton GEMMs off unless XLA_FLAGS is set: with
# the defaults the MoDDiffy-par step had not compiled after 4.5 minutes
# (stop 29, docs/speed.md). Output goes to $OUT (the device tool's folder).
# Stop 52's open questions (docs/speed.md): the pipelined MoDDiffy-par step
# with the smaller optimizer state (role_partition.py), then with XLA's
# update-free command buffers (a DebugOptions field, not an XLA_FLAGS flag);
# each call leaves 400 s for the compile:
#   PROBES=0 BUDGET=450 bash benchmarks/gpu_lease.sh run --batch 256
#   --methods moddiffy_par --dtypes bfloat16 --attention cudnn:0 --steps 10
#   --no_compose [--compiler_option xla_gpu_command_buffer_update_mode=1]
# PAIR="ARGS" runs a second gpu.py with ARGS added (e.g. PAIR="--compiler_option
# xla_gpu_command_buffer_update_mode=1"), compiling at the same time (each
# with 45% of the device memory; output gpu_pair.jsonl, log_pair.txt); the
# two time their steps one after the other once both have compiled. Use it
# with PROBES=0 (the probes' four 8% shares do not fit beside two of 45%).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  rm -rf .whl && mkdir -p .whl .gpu/tok
  for pkg in ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$pkg" || exit 1
  done
  tok=$(python -c "from moddiffy_jax.models import bert; print(bert.resolve_model_dir(None))") || exit 1
  for f in vocab.txt tokenizer.json tokenizer_config.json special_tokens_map.json config.json; do
    cp "$tok/$f" .gpu/tok/ || exit 1
  done
  du -sh .whl .gpu
  ;;
run)
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MODDIFFY_MODEL_DIR=$PWD/.gpu/tok
  out="${OUT:-/tmp/gpu_out}" && mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  if [ "${PROBES:-1}" = 1 ]; then
    # Which XLA flag slows the compile: the fine-tuning step (batch 32 x 128,
    # bf16) compiled under four flag sets at once, each in its own process
    # with a small share of the device memory and a PROBE_S limit; "off" (both
    # flags) is the control under the same load. The main run starts beside
    # them and times its steps after its own first compile (longer than
    # PROBE_S), so the probes' autotuning does not overlap the timed steps.
    for probe in "default|" "autotune_on|--xla_gpu_enable_triton_gemm=false" \
      "triton_on|--xla_gpu_autotune_level=0" \
      "off|--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"; do
      name=${probe%%|*}
      XLA_FLAGS=${probe#*|} XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 \
        timeout "${PROBE_S:-150}" python3 benchmarks/bench_steps.py --one \
        --methods finetune --models bert-base --batch 32 --length 128 \
        --dtype bfloat16 --steps 1 >"$out/probe_$name.txt" 2>&1 &
    done
  fi
  export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0}"
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
  if [ -n "${PAIR:-}" ]; then
    # A second benchmarks/gpu.py with PAIR's extra arguments, compiling beside
    # the first (the compile is host work); bench_steps.device_turn then has
    # each time its steps alone, after both have compiled.
    rm -rf /tmp/bench_turn  # no marks left from an earlier call
    export BENCH_TURN=/tmp/bench_turn,2 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    # shellcheck disable=SC2086  # PAIR is a list of arguments
    timeout -s ABRT "${BUDGET:-330}" python3 -X faulthandler benchmarks/gpu.py \
      --out "$out/gpu_pair.jsonl" --trace /tmp/gpu_trace_pair "$@" $PAIR \
      >"$out/log_pair.txt" 2>&1 &
  fi
  timeout -s ABRT "${BUDGET:-330}" python3 -X faulthandler benchmarks/gpu.py \
    --out "$out/gpu.jsonl" --trace /tmp/gpu_trace "$@" 2>&1 | tee "$out/log.txt"
  wait
  [ -n "${PAIR:-}" ] && cat "$out/log_pair.txt"
  for f in "$out"/probe_*.txt; do
    echo "$f: $(grep -o '"compile_s": [0-9.]*' "$f" || echo "no result (limit ${PROBE_S:-150} s)")"
  done
  # The traces themselves, where small (summaries are in gpu.jsonl).
  for dir in /tmp/gpu_trace /tmp/gpu_trace_pair; do
    find "$dir" -name perfetto_trace.json.gz -size -40M 2>/dev/null |
      while read -r f; do cp "$f" "$out/$(basename "$dir")_$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$f")")")")").json.gz"; done
  done
  ls -la "$out"
  ;;
*)
  echo "usage: bash benchmarks/gpu_lease.sh prepare | run [gpu.py arguments]" >&2
  exit 2
  ;;
esac
