# Session ae, call 1 (H100 form: no long shapes): the scores kernel's float32 operands (G, Akk) in swizzled SMEM (this tree)
# against main (37d5737, .old/base); this tree with fla and jla on every shape; GPU tests.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz /tmp/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv > $L/gpu.txt
K="--no-xla --no-gate-in-kernel"
(cd .old/base && PYTHONPATH=/tmp/site:. timeout 70 python3 benchmarks/kda_kernel.py $K --no-fla --no-jla \
    --shapes small,8x4096 --breakdown > $L/base.log 2>&1)
timeout 130 python3 benchmarks/kda_kernel.py $K --shapes small,8x4096 \
    --fla-tuning /tmp/fla.tgz --out $L/table_short.md > $L/peers_short.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 60 python3 benchmarks/kda_kernel.py $K --no-fla --no-jla --shapes small,8x4096 --breakdown > $L/new_breakdown.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 90 python3 -m pytest -q -rf tests/test_kda_mgpu.py -k "scores or dispatch" > $L/tests.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
