#!/usr/bin/env bash
# The GPU check, in one run of under 8 minutes on one H100, every result under $OUT (default ./gpu_out):
#   1. nvidia-smi                                    -> nvidia-smi.txt
#   2. the CUDA tests (those of every test module that marks pytest.mark.gpu or checks
#      torch.cuda.is_available()), then the Triton kernel tests -> cuda_tests.*, triton_tests.*
#   3. bench/gpu_decode.py: a Llama-3.1-8B-shaped model with random weights (--load-format dummy),
#      decode at batch 1/32/128 x context 1k/8k/32k and an 8k prefill, Triton paged kernels against
#      the gather path, each beside its floor  -> gpu_decode.json, gpu_decode.md, gpu_decode.log
#   4. bench/pd_vs_colocated.py --device cuda: prefill + decode instances against two colocated
#      replicas, all on the one GPU, with torch profiler traces of one long prompt's layer-by-layer
#      KV send and load -> pd_vs_colocated.json, pd_vs_colocated.log,
#      pd_profile/budget2048/{prefill,decode}_trace.json
# Each step has its own timeout and a failed step does not stop the next; summary.txt lists every
# step's exit status and seconds, and the targets. See docs/gpu_check.md.
#
#   OUT=/tmp/gpu bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

# step NAME SECONDS LOG COMMAND...: run COMMAND under `timeout SECONDS`, its output in LOG, and
# record its exit status (124: timed out) and wall time in the summary.
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local started=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - started)) s (log: $(basename "$log"))" | tee -a "$SUMMARY"
    tail -n 5 "$log"
}

step nvidia-smi 15 "$OUT/nvidia-smi.txt" nvidia-smi

# The CUDA tests: in every module that marks pytest.mark.gpu or checks torch.cuda.is_available(), the
# tests whose names (module included) or marks say cuda or gpu. The Triton kernel tests run in a
# process of their own (they may set TRITON_INTERPRET=1, which must not reach the CUDA tests).
CUDA_TESTS=$(grep -rlE "pytest\.mark\.gpu|torch\.cuda\.is_available\(\)" tests --include='test_*.py' \
             | grep -v triton | sort)
TRITON_TESTS=$(ls tests/unit/test_triton*.py tests/engine/test_triton*.py 2>/dev/null)
# shellcheck disable=SC2086 # one path per word
step cuda-tests 100 "$OUT/cuda_tests.txt" "$PYTHON" -m pytest -q -p no:cacheprovider -rs -k "cuda or gpu" \
    --junitxml="$OUT/cuda_tests.xml" $CUDA_TESTS
if [ -n "$TRITON_TESTS" ]; then
    # shellcheck disable=SC2086
    step triton-tests 45 "$OUT/triton_tests.txt" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
        --junitxml="$OUT/triton_tests.xml" $TRITON_TESTS
else
    echo "triton-tests: none in this tree (tests/*/test_triton*.py)" | tee -a "$SUMMARY"
fi

step gpu-decode 180 "$OUT/gpu_decode.log" "$PYTHON" bench/gpu_decode.py --device cuda --out "$OUT"

step pd-vs-colocated 130 "$OUT/pd_vs_colocated.log" "$PYTHON" bench/pd_vs_colocated.py --device cuda \
    --rounds 2 --budgets 2048 --interval 2 --long-prompts 2 --decode-tokens 64 --warm-s 1 \
    --profile-dir "$OUT/pd_profile" --out "$OUT/pd_vs_colocated.json"

# The targets, from the result files that exist.
"$PYTHON" - "$OUT" >> "$SUMMARY" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
decode = os.path.join(out, "gpu_decode.json")
if os.path.exists(decode):
    for t in json.load(open(decode))["targets"].values():
        print(f"target: {t['target']}: {t['status']}")
pd = os.path.join(out, "pd_vs_colocated.json")
if os.path.exists(pd):
    for run in json.load(open(pd))["runs"]:
        for name, met in run["targets_met"].items():
            print(f"target: PD {name} (ratio {run['ratios']}): {'met' if met else 'missed'}")
EOF
echo "== summary ($SUMMARY)"
cat "$SUMMARY"
