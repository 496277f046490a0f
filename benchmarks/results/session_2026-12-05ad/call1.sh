# Session ad, call 1: the landed form (this tree, 3f5855d) against main before session ac (.old,
# aa57294), small and 8x4096, with fla and jla in the same run; GPU tests of session ac's change;
# Nsight Compute's full set (stall samples by SASS line) over ours at the small shape.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz /tmp/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $L/gpu.txt
KK="benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel"
S=$(date +%s); t() { echo "$1 $(( $(date +%s) - S )) s" >> $L/times.txt; }
timeout 100 python3 -m pytest -q tests/test_kda_mgpu.py tests/test_kda_pallas.py \
    -k "scale_the_diagonal or scores_matches or channels or dispatch or gpu and (small_cotangent or bf16 or variants_equal)" > $L/tests.log 2>&1; t tests
timeout 150 python3 $KK --shapes small,8x4096 --breakdown --fla-tuning /tmp/fla.tgz \
    --out $L/table_new.md > $L/new1.log 2>&1; t new1
(cd .old && timeout 45 python3 $KK --no-fla --no-jla --shapes small) > $L/old1.log 2>&1; t old1
timeout 40 python3 $KK --no-fla --no-jla --shapes small > $L/new2.log 2>&1; t new2
(cd .old && timeout 40 python3 $KK --no-fla --no-jla --shapes small) > $L/old2.log 2>&1; t old2
tar -czf $OUT/logs.tgz -C $OUT logs
SHAPE=small IMPLS=" " timeout 190 bash benchmarks/kda_ncu.sh full > $L/ncu.log 2>&1; t ncu
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
