#!/usr/bin/env bash
# Single machine (CPU or one/many local GPUs): all visible devices form the mesh.
# Usage: launch/local.sh configs/moddiffy_par.py[:arg] runs/NAME [--config.x=y ...]
set -euo pipefail
config=${1:?config file}; workdir=${2:?workdir}; shift 2
exec python -m moddiffy_jax.main --config="$config" --workdir="$workdir" "$@"
