#!/usr/bin/env bash
# One command for a machine with one (or more) NVIDIA GPU(s), nothing to install: Python 3 with CUDA torch,
# click, pyyaml, pytest and nvidia-ml-py; no Ray, no network. Runs tests/gpu (under torchrun), then the
# single-GPU throughput benchmark (bench/gpu_bench.py: hybrid ZeRO-0 beside FSDP2 on the ~1.4B built-in GPT,
# seq 2048, bf16), and writes the report to bench/RESULTS-gpu.md. Estimated 3-5 minutes on one H200 (not yet
# measured: no GPU has run it so far).
#
#   bash bench/gpu_check.sh               # on the GPU machine
#   bash bench/gpu_check.sh --cpu         # dry run of the same path on the CPU with gpt-tiny (CI runs this)
#   bash bench/gpu_check.sh --out FILE    # write the report elsewhere
#
# PYTHON overrides the interpreter (default: python3). Exit status: 0 when the tests passed and the report
# was written, 1 when tests failed or the benchmark failed, 2 for a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=bench/RESULTS-gpu.md
CPU=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) CPU="--cpu" ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a file path" >&2; exit 2; }; OUT=$2; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "error: unknown argument '$1'; use --cpu and/or --out FILE" >&2; exit 2 ;;
    esac
    shift
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo PYTHONWARNINGS=ignore::FutureWarning
if [ -n "$CPU" ]; then
    export CUDA_VISIBLE_DEVICES=""  # the dry run: tests/gpu skip themselves, the benchmark runs on the CPU
fi
COMMAND="bash bench/gpu_check.sh${CPU:+ $CPU}"
started=$(date +%s)
log() { echo "[gpu-check +$(( $(date +%s) - started ))s] $*"; }

log "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count())')"
log "step 1/2: tests/gpu"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
$PY -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$LOG"
tests_status=${PIPESTATUS[0]}
SUMMARY=$(grep -E '(passed|failed|skipped|error)' "$LOG" | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//')
log "tests/gpu: ${SUMMARY:-no summary} (exit $tests_status)"

log "step 2/2: throughput benchmark"
$PY -m bench.gpu_bench --out "$OUT" --tests "${SUMMARY:-no summary} (exit $tests_status)" --command "$COMMAND" $CPU
bench_status=$?
log "done: tests exit $tests_status, benchmark exit $bench_status, report $OUT"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
