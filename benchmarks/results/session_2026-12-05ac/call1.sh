# Session ac, call 1: the scaled diagonal blocks (this tree) against main before (.old), small
# and 8x4096, with fla and jla in the new run; GPU tests of the change.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz $OUT/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $L/gpu.txt
KK="benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel"
old() { (cd .old && PYTHONPATH=/tmp/site:. timeout $1 python3 $KK --no-fla --no-jla --shapes $2 $3); }
old 110 small,8x4096 --breakdown > $L/old1.log 2>&1
timeout 200 python3 $KK --shapes small,8x4096 --breakdown --fla-tuning $OUT/fla.tgz \
    --out $L/table_new.md > $L/new1.log 2>&1
timeout 90 python3 -m pytest -q -x tests/test_kda_mgpu.py \
    -k "scores or channels or scale_the_diagonal" > $L/tests.log 2>&1
timeout 80 python3 -m pytest -q tests/test_kda_pallas.py \
    -k "gpu and (bf16 or small_cotangent or variants_equal)" >> $L/tests.log 2>&1
old 45 small > $L/old2.log 2>&1
timeout 45 python3 $KK --no-fla --no-jla --shapes small > $L/new2.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
