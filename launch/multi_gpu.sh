#!/usr/bin/env bash
# One machine with several GPUs: one process drives every GPU; the batch is
# split across them on the "data" mesh axis (config.train.batch_size must be a
# multiple of the GPU count). Install the CUDA build of the jax the package
# pins (setup.py): pip install -e . && pip install "jax[cuda12]>=0.10,<0.11"
# Usage: launch/multi_gpu.sh configs/moddiffy_par.py:data=dwmw17 runs/NAME [overrides]
set -euo pipefail
config=${1:?config file}; workdir=${2:?workdir}; shift 2
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-true}
exec python -m moddiffy_jax.main --config="$config" --workdir="$workdir" \
  --config.model.dtype=bfloat16 "$@"
