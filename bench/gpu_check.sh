#!/usr/bin/env bash
# One command for a machine with one (or more) NVIDIA GPU(s), nothing to install: Python 3 with CUDA torch,
# click, pyyaml, pytest and nvidia-ml-py (numpy too for the checkpoint test and `hybrid monitor`); no Ray, no
# network. Checks those first, runs tests/gpu (under torchrun, every collective issued even on one GPU), then
# the single-GPU benchmark (bench/gpu_bench.py: hybrid ZeRO 0-3 with and without activation checkpointing,
# ZeRO-3 with offload, FSDP2, on the ~1.4B built-in GPT, seq 2048, bf16), writing each row to
# bench/RESULTS-gpu.jsonl as it is measured and the report to bench/RESULTS-gpu.md after every row.
# Estimated 5 minutes on one H200 (tests ~1.5, benchmark ~3); at most ~8 (tests stop at TESTS_TIMEOUT_S,
# the benchmark starts no row after BENCH_LIMIT_S and is stopped at BENCH_TIMEOUT_S).
#
#   bash bench/gpu_check.sh               # on the GPU machine
#   bash bench/gpu_check.sh --cpu         # dry run of the same path on the CPU with gpt-tiny (CI runs this)
#   bash bench/gpu_check.sh --out FILE    # write the report elsewhere (the rows beside it, FILE's .jsonl)
#
# PYTHON overrides the interpreter (default: python3). Exit status: 0 when the tests passed and every
# benchmark row was measured, 1 when a test or a row failed, 2 for a bad argument or a missing prerequisite.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=bench/RESULTS-gpu.md
CPU=""
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-180}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-240}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-300}
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) CPU="--cpu" ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a file path" >&2; exit 2; }; OUT=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
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
# run "$@" stopped after $1 seconds (SIGTERM, SIGKILL 15 s later) where coreutils' timeout exists
limited() { local s=$1; shift; if command -v timeout >/dev/null 2>&1; then timeout --kill-after=15 "$s" "$@"; else "$@"; fi; }

# Prerequisites: what nothing can run without stops the check here (exit 2); what only some tests need is
# named, and those tests fail by themselves.
command -v "$PY" >/dev/null 2>&1 || { echo "error: no Python interpreter '$PY'; set PYTHON to one with CUDA torch." >&2; exit 2; }
MISSING=$("$PY" - "$CPU" <<'EOF'
import importlib.util, sys
need = {"torch": "torch", "pytest": "pytest", "yaml": "pyyaml", "click": "click"}
want = {"numpy": "numpy (torch.distributed.checkpoint and `hybrid monitor` need it: the checkpoint and "
                 "monitor tests will fail)",
        "pynvml": "nvidia-ml-py (the NVML probe test will fail and the memory meter reads no NVML figures)"}
hard = [pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None]
if hard:
    print(f"error: the GPU check needs {' and '.join(hard)}, not importable with {sys.executable}; install "
          f"{'them' if len(hard) > 1 else 'it'} or set PYTHON to an interpreter that has {'them' if len(hard) > 1 else 'it'}.")
    sys.exit(2)
import torch
if not sys.argv[1] and not torch.cuda.is_available():
    print(f"error: torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False, CUDA build "
          f"{torch.version.cuda}); run on a machine with a GPU and a CUDA build of torch, or pass --cpu.")
    sys.exit(2)
soft = [text for mod, text in want.items() if importlib.util.find_spec(mod) is None]
print("missing: " + "; ".join(soft) + "." if soft else "")
EOF
)
prereq_status=$?
if [ "$prereq_status" -ne 0 ]; then
    echo "${MISSING:-error: the prerequisite check itself failed (exit $prereq_status) with $PY}" >&2
    exit 2
fi
log "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count())')"
log "prerequisites: ${MISSING:-all present}"

log "step 1/2: tests/gpu"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
limited "$TESTS_TIMEOUT_S" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$LOG"
tests_status=${PIPESTATUS[0]}
SUMMARY=$(grep -E '(passed|failed|skipped|error)' "$LOG" | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//')
[ "$tests_status" -eq 124 ] || [ "$tests_status" -eq 137 ] && SUMMARY="stopped after ${TESTS_TIMEOUT_S} s: ${SUMMARY:-no summary}"
log "tests/gpu: ${SUMMARY:-no summary} (exit $tests_status)"

log "step 2/2: throughput benchmark"
limited "$BENCH_TIMEOUT_S" "$PY" -m bench.gpu_bench --out "$OUT" --time-limit-s "$BENCH_LIMIT_S" \
    --tests "${SUMMARY:-no summary} (exit $tests_status)" --command "$COMMAND" --prerequisites "$MISSING" $CPU
bench_status=$?
log "done: tests exit $tests_status, benchmark exit $bench_status, report $OUT"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
