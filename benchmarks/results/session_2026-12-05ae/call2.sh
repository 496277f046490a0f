# Session ae, call 2 (H200): this tree with fla and jla on every shape (o and its vjp, fla's
# work); ours' per-kernel times at the small shape if time is left.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz /tmp/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv > $L/gpu.txt
K="--no-xla --no-gate-in-kernel"
timeout 130 python3 benchmarks/kda_kernel.py $K --shapes small,8x4096 \
    --fla-tuning /tmp/fla.tgz --out $L/table_short.md > $L/peers_short.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 180 python3 benchmarks/kda_kernel.py $K --shapes 2x16384,1x65536,1x262144 \
    --fla-tuning /tmp/fla.tgz --out $L/table_long.md > $L/peers_long.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 50 python3 benchmarks/kda_kernel.py $K --no-fla --no-jla --shapes small --breakdown > $L/breakdown.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
