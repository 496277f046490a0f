# Session ad, call 4: this tree with fla and jla in the same run (forward+backward as o and its
# vjp, fla's work), small and 8x4096; the Triton scaling test in interpret mode on the GPU.
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_PREALLOCATE=false
cp benchmarks/results/fla_autotune_h200.tgz /tmp/fla.tgz
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv > $L/gpu.txt
timeout 150 python3 benchmarks/kda_kernel.py --no-xla --no-gate-in-kernel --shapes small,8x4096 \
    --fla-tuning /tmp/fla.tgz --out $L/table.md > $L/peers.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
timeout 40 python3 -m pytest -q -rf tests/test_kda_mgpu.py -k "scale_the_diagonal_blocks_exactly" > $L/test_scale.log 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
