#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one run of at most 8 minutes; results under DIR.
#   bash scripts/gpu_check.sh DIR
# On a machine without network: pip install --no-deps --no-build-isolation -e . first.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + 470))  # leave headroom under the 8-minute budget
left() { echo $((deadline - SECONDS)); }

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to DIR/NAME.log, never abort the script
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 10 )) && { echo "skip $name: out of time" | tee -a "$out/summary.txt"; return; }
  (( limit > budget )) && limit=$budget
  echo "== $name (limit ${limit}s)" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$out/summary.txt"
  tail -n 5 "$out/$name.log" | sed 's/^/   | /' | tee -a "$out/summary.txt"
}

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
step doctor 60 sh -c "python -m gptopt doctor --smoke --json > '$out/doctor.json'"
step cuda_tests 120 python -m pytest -q -m cuda -p no:cacheprovider tests
step prepare 60 python -m gptopt prepare --output_dir data/stdlib
# issue targets: gpt2 (124M) at 1024 context, bf16 + compile, MFU against the table peak
step train_gpt2 120 python -m gptopt train --preset gpt2 --seq_len 1024 --batch_size 16 --use_amp --use_compile \
  --max_steps 40 --eval_interval 0 --save_interval 1000 --output_dir "$out/train_gpt2" --overwrite
# --overwrite: a rerun into the same DIR replaces the earlier reports (each mode only its own files)
step bench 270 python -m gptopt bench --output_dir "$out/bench" --json --overwrite
step bench_infer 150 python -m gptopt bench --mode infer --rungs hf,kv,compiled,int8 --batch_size 8 \
  --output_dir "$out/bench" --json --overwrite
echo "done in ${SECONDS}s" | tee -a "$out/summary.txt"
