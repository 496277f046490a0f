# Session ac, call 2: per-matrix scales with early stores (this tree, "Q") against main before
# (.old) and call 1's shared scales (.altP), small and 8x4096; GPU tests of the change.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz $OUT/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $L/gpu.txt
KK="benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel"
tree() { (cd $1 && PYTHONPATH=/tmp/site:. timeout $2 python3 $KK --no-fla --no-jla --shapes $3 $4); }
timeout 200 python3 $KK --shapes small,8x4096 --breakdown --fla-tuning $OUT/fla.tgz \
    --out $L/table_q.md > $L/q1.log 2>&1
tree .old 110 small,8x4096 --breakdown > $L/old1.log 2>&1
tree .altP 70 small --breakdown > $L/p1.log 2>&1
timeout 100 python3 -m pytest -q tests/test_kda_mgpu.py \
    -k "scores or channels or scale_the_diagonal or dispatch" > $L/tests.log 2>&1
timeout 70 python3 -m pytest -q tests/test_kda_pallas.py \
    -k "gpu and (bf16 or small_cotangent or variants_equal)" >> $L/tests.log 2>&1
tree .old 40 small > $L/old2.log 2>&1
timeout 40 python3 $KK --no-fla --no-jla --shapes small > $L/q2.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
