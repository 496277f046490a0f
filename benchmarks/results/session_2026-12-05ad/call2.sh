# Session ad, call 2: this tree (intra_bwd_scores' SMEM at heads of 64 cut to two CTAs per SM;
# intra_bwd_channels' state operands loaded before the score part; forward+backward timed as
# o and its vjp) against main (.old/base, 3f5855d), small with fla and jla; GPU tests.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz /tmp/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $L/gpu.txt
KK="benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel"
S=$(date +%s); t() { echo "$1 $(( $(date +%s) - S )) s" >> $L/times.txt; }
base() { (cd .old/base && PYTHONPATH=/tmp/site:. timeout $1 python3 $KK --no-fla --no-jla --shapes $2 $3); }
timeout 130 python3 $KK --shapes small --breakdown --fla-tuning /tmp/fla.tgz \
    --out $L/table_new.md > $L/new1.log 2>&1; t new1
base 40 small > $L/base1.log 2>&1; t base1
timeout 40 python3 $KK --no-fla --no-jla --shapes small --sum-loss > $L/new_sum.log 2>&1; t new_sum
CHAN_ORDER=0 timeout 40 python3 $KK --no-fla --no-jla --shapes small > $L/new_order0.log 2>&1; t order0
DA_FIRST=1 timeout 40 python3 $KK --no-fla --no-jla --shapes small > $L/new_dafirst.log 2>&1; t dafirst
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 70 python3 -m pytest -q -x -rf tests/test_kda_mgpu.py -k "scale_the_diagonal_blocks_exactly and triton" > $L/test_scale.log 2>&1; t test_scale
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 150 python3 -m pytest -q -rf tests/test_kda_mgpu.py tests/test_kda_pallas.py \
    -k "scale_the_diagonal or scores_matches or channels_matches or bwd_dispatch or gpu and (small_cotangent or bf16 or variants_equal)" > $L/tests.log 2>&1; t tests
tar -czf $OUT/logs.tgz -C $OUT logs
base 45 8x4096 > $L/base_8x4096.log 2>&1; t base8
timeout 45 python3 $KK --no-fla --no-jla --shapes 8x4096 > $L/new_8x4096.log 2>&1; t new8
timeout 40 python3 $KK --no-fla --no-jla --shapes small > $L/new2.log 2>&1; t new2
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
