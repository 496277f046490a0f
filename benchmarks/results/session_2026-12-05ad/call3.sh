# Session ad, call 3: this tree (intra_bwd_scores' SMEM cut; channels as main) against main
# (.old/base, 3f5855d) at small and 8x4096, both harness forms.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv > $L/gpu.txt
KK="benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel --no-fla --no-jla"
base() { (cd .old/base && PYTHONPATH=/tmp/site:. timeout 60 python3 $KK --shapes $1); }
timeout 60 python3 $KK --shapes small,8x4096 --sum-loss > $L/new_sum.log 2>&1
base small,8x4096 > $L/base.log 2>&1
timeout 60 python3 $KK --shapes small,8x4096 > $L/new.log 2>&1
timeout 60 python3 $KK --shapes small,8x4096 --sum-loss > $L/new_sum2.log 2>&1
base small,8x4096 > $L/base2.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
