#!/usr/bin/env bash
# One call on the lent H200 (device tool): trainer throughput on configs/small.py, then forward
# time and peak memory against sequence length. Writes logs and tables under $OUT.
#
#   run(command="bash benchmarks/h200_run.sh", carry=[".whl"])
#
# The GPU image has JAX, flax, optax, orbax, tqdm and tokenizers; ml_collections and tensorboardX
# travel as wheels in .whl/ (see the device README).
set -u
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/ml_collections-*.whl .whl/tensorboardx-*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

TRAIN_STEPS=${TRAIN_STEPS:-150}
timeout "${TRAIN_SECONDS:-200}" python3 benchmarks/train_throughput.py --config=configs/small.py \
    --workdir=/tmp/small --config.train.steps="$TRAIN_STEPS" --out="$OUT/train_throughput_small.md" \
    2>&1 | tee "$OUT/train_small.log" | grep -vE "^\s*$" | tail -n 25

timeout "${LC_SECONDS:-210}" python3 benchmarks/long_context_memory.py --out_dir="$OUT" \
    --seq_lens=8192,32768,131072,524288,1048576 --repeats=2 --max_seconds=15 \
    2>&1 | tee "$OUT/long_context.log" | grep -E "RESULT|Error|error" | tail -n 40
ls -la "$OUT"
