#!/usr/bin/env bash
# Issue 20's training settings, compared on paper 000's MNIST LeNet-5-Caffe at a budget of 20 epochs: every
# (setting, family, seed) trains in its own process of benchmarks/structured_sparsity.py --train-only, JOBS at
# a time (one torch thread each; on a machine with a GPU they share it), seed 0 of every setting first. Training
# stops at TRAIN_S seconds after the start (an unfinished run keeps its last epoch's checkpoint and is listed as
# not trained); then every setting is measured, for at most MEASURE_S seconds (default 150), (--measure-only, test split, onnxruntime latency) into
# OUT/<setting>.{json,md}, and OUT/grid.tar.gz holds those and the logs.
#
#   benchmarks/structured_sparsity_grid.sh OUT [TRAIN_S] [JOBS]
#   EPOCHS=1 SEEDS=0 SETTINGS="base" benchmarks/structured_sparsity_grid.sh /tmp/grid 600 2   # a smoke run
#
# The settings (name, then structured_sparsity.py arguments). Selection among them is by validation accuracy
# (the trainer's per-epoch record), never by the test split the tables report.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT [TRAIN_S] [JOBS]}
TRAIN_S=${2:-330}
JOBS=${3:-$(nproc)}
EPOCHS=${EPOCHS:-20}
SEEDS=${SEEDS:-"0 1 2"}
PYTHON=${PYTHON:-python3}
MEASURE_S=${MEASURE_S:-150}
LATENCY=${LATENCY:-1}   # 0: leave the ONNX latency out of the measurement
CONFIG=configs/mnist-lenet5-ssgl.yaml   # structured_sparsity.py sets the family of each row
declare -A ARGS=(
    [base]="--batch-size 128"
    [decay15]="--batch-size 128 --set train.lr_milestones=[15]"
    [b64]="--batch-size 64"
    [b64-decay15]="--batch-size 64 --set train.lr_milestones=[15]"
    [warm10-decay15]="--batch-size 128 --set train.kl_warmup_epochs=10 --set train.lr_milestones=[15]"
    [rho1e-2-decay15]="--batch-size 128 --set train.rho_lr=1e-2 --set train.lr_milestones=[15]"
)
SETTINGS=${SETTINGS:-"base decay15 b64 b64-decay15 warm10-decay15 rho1e-2-decay15"}
mkdir -p "$OUT/logs"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s)

jobs_file="$OUT/jobs.txt"
: > "$jobs_file"
for seed in $SEEDS; do
    for setting in $SETTINGS; do
        families="ss-ig ss-gl ss-ghs"
        [ "$setting" = base ] && families="dnn bnn $families"   # the baselines once, at the config's optimizer
        for family in $families; do echo "$setting $family $seed" >> "$jobs_file"; done
    done
done

train_one() {   # setting family seed: train until the deadline
    set +e
    local began=$(date +%s) left=$(( start + TRAIN_S - $(date +%s) ))
    [ "$left" -gt 10 ] || { echo "$1 $2 $3: no time left, not started"; return 0; }
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$left" "$PYTHON" benchmarks/structured_sparsity.py --config "$CONFIG" --families "$2" \
        --seeds "$3" --epochs "$EPOCHS" ${ARGS[$1]} --runs-dir "runs/grid/$1" --train-only \
        > "$OUT/logs/$1-$2-s$3.log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - began ))
    [ "$rc" = 0 ] && echo "$1 $2 $3: trained in $took s" || echo "$1 $2 $3: stopped after $took s (exit $rc)"
}
export -f train_one
export start TRAIN_S EPOCHS PYTHON CONFIG OUT
export ARGS_DEF="$(declare -p ARGS)"
xargs -P "$JOBS" -L 1 bash -c 'eval "$ARGS_DEF"; train_one "$@"' _ < "$jobs_file"
echo "training done after $(( $(date +%s) - start )) s"

export OMP_NUM_THREADS=2
for setting in $SETTINGS; do
    families="ss-ig ss-gl ss-ghs"
    [ "$setting" = base ] && families="dnn bnn $families"
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$MEASURE_S" "$PYTHON" benchmarks/structured_sparsity.py --config "$CONFIG" \
        --families $families --seeds $SEEDS \
        --epochs "$EPOCHS" ${ARGS[$setting]} --runs-dir "runs/grid/$setting" --measure-only \
        $([ "$LATENCY" = 0 ] && echo --no-latency) \
        --out "$OUT/$setting" > "$OUT/logs/measure-$setting.log" 2>&1 &
done
wait || true
echo "measured after $(( $(date +%s) - start )) s"
tar -czf "$OUT.tar.gz.tmp" -C "$OUT" . && mv "$OUT.tar.gz.tmp" "$OUT/grid.tar.gz"
