#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build for a bounded time.
#   tools/run_fuzz.sh BUILD_DIR SECONDS_PER_TARGET [JOBS [SEED]]
# SEED (make test passes one) fixes libFuzzer's mutation sequence, so CI
# explores the same inputs on every run (how far depends on the machine's
# speed) and goes red for a regression, not for a new find by chance; `make
# fuzz` leaves it random.
# Each target starts from its seed corpus (tests/fuzz/corpus/<op>/, read
# only, which also holds the inputs of past findings: they rerun first, every
# time) and writes what it learns to BUILD_DIR/corpus/<op>/. A finding leaves
# its input in BUILD_DIR/findings/<op>/ and fails the run. Targets run JOBS at
# a time; the summary gives each one's executions.
set -euo pipefail
build=${1:?build dir}
seconds=${2:?seconds per target}
jobs=${3:-$(nproc)}
seed=${4:-0}  # 0: libFuzzer picks one
root=$(cd "$(dirname "$0")/.." && pwd)
targets=()
for src in "$root"/tests/fuzz/fuzz_*.cpp; do
  name=$(basename "$src" .cpp)
  targets+=("${name#fuzz_}")
done

run_one() {
  local op=$1 build=$2 seconds=$3 root=$4 seed=$5
  mkdir -p "$build/corpus/$op" "$build/findings/$op" "$build/fuzz-logs" "$root/tests/fuzz/corpus/$op"
  # -timeout: one input may run 10 s (the decoder caps tensor sizes, so a slow
  # input is a hang); -rss_limit_mb: ASan's shadow included; -use_value_profile
  # helps through the exact-size comparisons of the validation.
  if "$build/tests/fuzz/fuzz_$op" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 \
      -use_value_profile=1 -print_final_stats=1 -seed="$seed" -artifact_prefix="$build/findings/$op/" \
      "$build/corpus/$op" "$root/tests/fuzz/corpus/$op" > "$build/fuzz-logs/$op.log" 2>&1; then
    echo "fuzz_$op: ok, $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$build/fuzz-logs/$op.log" | grep -o '[0-9]*$') executions in ${seconds} s"
  else
    echo "fuzz_$op: FAILED (log: $build/fuzz-logs/$op.log, input in $build/findings/$op/)"
    tail -n 40 "$build/fuzz-logs/$op.log"
    return 1
  fi
}
export -f run_one
printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} "$build" "$seconds" "$root" "$seed"
