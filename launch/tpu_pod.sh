#!/usr/bin/env bash
# TPU pod slice: run the SAME command on every worker, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command \
#     "cd moddiffy_jax && bash launch/tpu_pod.sh configs/moddiffy_par.py:data=dwmw17 /mnt/shared/runs/NAME"
# jax.distributed.initialize() discovers the other hosts; each host reads its
# own slice of every global batch and writes checkpoints to the shared workdir
# (a filesystem every worker mounts, e.g. a Filestore or gcsfuse mount).
# A maintenance event's SIGTERM makes all workers save one common step and
# exit 0; run the same command again to resume.
# Install on every worker, with the jax the package pins (setup.py):
#   pip install -e . && pip install "jax[tpu]>=0.10,<0.11"
set -euo pipefail
config=${1:?config file}; workdir=${2:?workdir}; shift 2
exec python -m moddiffy_jax.main --distributed --config="$config" --workdir="$workdir" \
  --config.model.dtype=bfloat16 "$@"
