#!/usr/bin/env bash
# Nsight Compute over one KDA forward+backward (benchmarks/kda_profile.py) on a GPU where ncu
# reads the counters (the clocks are left alone). From the repository root:
#
#   python3 benchmarks/run.py kda_ncu --wheels=.whl --out_dir=$OUT   # sum, small, ours fla jla
#   bash benchmarks/kda_ncu.sh [full|sum|sweep]     # with fla and jla importable (PYTHONPATH)
#
# full (default):
# 1. Nsight Compute's full set (warp stalls, sampled stall locations, pipes, memory) over ours:
#    full_ours.txt, and the stall samples by SASS line: src_ours.csv.
# 2. Per kernel time, registers, shared memory and occupancy of each implementation in IMPLS
#    (ours, jla, fla: their wheels in .whl/), XLA's own kernels included: sum_IMPL.txt/.csv.
#    fla's autotuning under ncu takes minutes: FLA_TUNING=path.tgz (kda_kernel.py's
#    --fla_tuning) skips it; else give fla a call of its own (IMPLS=fla; ours' full set runs
#    first in every full call).
# sum: step 2 alone (no full set).
# sweep: per kernel times of ours under each launch-parameter change in TUNES (';' between
#    them, "" for the defaults), one process each: sweep.md (benchmarks/ncu_table.py).
#    TREES="dir ..." adds the defaults of other checkouts of the code (kda_profile.py is
#    copied there), to compare code in one call.
# Everything is packed into $OUT/ncu.tgz; the text reports are also copied to $OUT. W is the
# scratch folder (the .ncu-rep reports).
set -u
OUT=${OUT:-/tmp/ncu_out}
W=${W:-/tmp/ncu}
SHAPE=${SHAPE:-8x4096}
IMPLS=${IMPLS:-ours jla fla}
mkdir -p "$OUT" "$W"
# Command buffers off: each kernel is launched (and so profiled) on its own.
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS=--xla_gpu_enable_command_buffer=
NCU=(ncu --clock-control none --profile-from-start off --target-processes all -f)
METRICS=gpu__time_duration.sum,launch__registers_per_thread,launch__shared_mem_per_block,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem
ncu --version | tee "$W/ncu_version.txt"

pack() {
    tar czf "$OUT/ncu.tgz" -C "$W" --exclude='*.ncu-rep' . 2>/dev/null
    cp "$W"/*.txt "$OUT/" 2>/dev/null
    ls -la "$W"
}
trap pack EXIT

profile() {  # NAME LIMIT NCU-ARGS -- PROFILE-ARGS  (run in $DIR, default .)
    local name=$1 limit=$2
    shift 2
    local ncu_args=()
    while [ "$1" != -- ]; do ncu_args+=("$1"); shift; done
    shift
    (cd "${DIR:-.}" && PYTHONPATH=.:$PYTHONPATH timeout "$limit" "${NCU[@]}" "${ncu_args[@]}" \
        -o "$W/$name" python3 benchmarks/kda_profile.py --shape "$SHAPE" "$@") \
        > "$W/$name.log" 2>&1
    echo "$name: rc $? ($(grep -c '^window' "$W/$name.log") windows; $(tail -n 1 "$W/$name.log"))"
    ncu --import "$W/$name.ncu-rep" --page details > "$W/$name.txt" 2>&1
    ncu --import "$W/$name.ncu-rep" --page raw --csv --metrics "$METRICS" > "$W/$name.csv" 2>&1
}

MODE=${1:-full}
if [ "$MODE" = sweep ]; then
    # One process per launch-parameter set: each window compiles its own kernels.
    IFS=';' read -r -a tunes <<< "${TUNES:-}"
    [ ${#tunes[@]} -eq 0 ] && tunes=("")
    i=0
    for tune in "${tunes[@]}"; do
        profile "sweep_$i" 120 --section SpeedOfLight -- --impl ours --tune "$tune"
        python3 benchmarks/ncu_table.py "$W/sweep_$i.csv" --labels "$tune" | tee "$W/sweep_$i.md"
        i=$((i + 1))
    done
    for tree in ${TREES:-}; do
        name=sweep_$(basename "$tree" | tr -cd 'A-Za-z0-9_')
        cp benchmarks/kda_profile.py "$tree/benchmarks/"
        DIR=$tree profile "$name" 120 --section SpeedOfLight -- --impl ours
        python3 benchmarks/ncu_table.py "$W/$name.csv" --labels "$tree" | tee "$W/$name.md"
    done
    cat "$W"/sweep*.md > "$OUT/sweep.md"
    exit 0
fi
if [ "$MODE" != sum ]; then
    profile full_ours 200 --set full --import-source yes -- --impl ours
    ncu --import "$W/full_ours.ncu-rep" --page source --csv --print-source sass \
        > "$W/src_ours.csv" 2> "$W/src_ours.err"
fi
for impl in $IMPLS; do
    # fla autotunes its Triton kernels in the warm-up calls, which ncu slows down: it needs
    # more time than the others
    limit=110
    [ "$impl" = fla ] && limit=300
    tuning=()
    [ "$impl" = fla ] && [ -n "${FLA_TUNING:-}" ] && tuning=(--fla_tuning "$FLA_TUNING")
    profile "sum_$impl" "$limit" --section SpeedOfLight --section LaunchStats --section Occupancy \
        -- --impl "$impl" "${tuning[@]}"
done
