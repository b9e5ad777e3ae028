#!/usr/bin/env bash
# Several GPU hosts (or several processes on one host), one process per host
# or per GPU, all running the SAME command. Under SLURM (srun) or Open MPI
# (mpirun) JAX finds the coordinator, process count and index by itself:
#   srun --nodes=2 --ntasks-per-node=1 --gpus-per-task=8 \
#     bash launch/multi_host_gpu.sh configs/moddiffy_par.py:data=dwmw17 /shared/runs/NAME
# Elsewhere (a torchrun-like launcher, Kubernetes) set, on every process:
#   COORDINATOR=host0:12355 NUM_PROCESSES=2 PROCESS_ID=<0 or 1>
# The run directory must be on a filesystem every process mounts: process 0
# takes its lock and writes config, metrics, exports and results; Orbax
# checkpoints are written by all processes together. A SIGTERM to every
# process (a preemption) saves one common step and exits 0; re-run the same
# command to resume. Install the CUDA build of the jax the package pins
# (setup.py): pip install -e . && pip install "jax[cuda12]>=0.10,<0.11".
# tests/test_multiprocess.py runs two CPU processes this way on one machine.
set -euo pipefail
config=${1:?config file}; workdir=${2:?workdir}; shift 2
extra=()
if [[ -n "${COORDINATOR:-}" ]]; then
  extra=(--coordinator_address="$COORDINATOR" --num_processes="${NUM_PROCESSES:?}"
         --process_id="${PROCESS_ID:?}")
fi
exec python -m moddiffy_jax.main --distributed "${extra[@]}" --config="$config" \
  --workdir="$workdir" --config.model.dtype=bfloat16 "$@"
