#!/usr/bin/env bash
# Everything one GPU can show about dpcompare, in one command, with a report at the end:
#
#   bash experiments/gpu_check.sh [OUT_DIR]        (default OUT_DIR: gpu-check/<date-time>)
#
# On one CUDA device it runs, each step logged and judged on its own (a failing step does not stop the rest): its
# exit status, then, for a step that runs dpcompare (which exits 0 whatever its verdict), what its result must show,
# judged by experiments/gpu_judge.py on the results in the step's own directory OUT_DIR/runs/<group>/<step> (the
# group is the part, or a set of runs reported together):
#   env            nvidia-smi, torch, CUDA, NCCL, cuDNN, and which backends are installed
#   nccl-ws1       ddp over NCCL at world size 1 (torchrun), CUDA-event timing and torch.cuda peak memory
#   dp-1dev        nn.DataParallel on one real device
#   nccl-refused   two ranks on one GPU with NCCL: must be refused in one line, exit 2 (NCCL cannot do it)
#   ddp/deepspeed/horovod-ws2   world size 2 on the one device over gloo (--opt dist_backend=gloo;
#                  Horovod's gloo controller), CUDA tensors; with two or more GPUs, NCCL one rank per GPU
#   gpt2-small-dropout   GPT-2 small with its dropout at world size 1: the CUDA masks captured, not replayed
#                  (each of these runs `equivalent`; nccl-refused writes no result)
#   amp-*          mixed precision on CUDA: bf16 and fp16 autocast under ddp, dp and horovod, a forced fp16
#                  overflow (initial loss scale 2^24) every backend must skip, DeepSpeed's bf16 and fp16 engines
#                  (fp32 master weights; fp16 weights exist on CUDA, refused on the CPU accelerator); every run
#                  `equivalent`, each overflow run with at least one checked step skipped, where the oracle predicted
#                  the overflow (the judge's --skips)
#   sharding-*     ZeRO-2, ZeRO-3 and FSDP2 on NCCL at world size 1 (AdamW, gpt-tiny): each judged against the
#                  float64 oracle, CUDA memory per component (metrics.model_state_mib_per_rank) beside the ZeRO
#                  formula, and the same at world size 2 (gloo over one GPU, or NCCL with two GPUs); every run
#                  `equivalent`, its measured parameters and optimizer state within 10 % of the formula (--memory)
#   resnet50, gpt2-small        throughput of every installed backend (world size 1 and 2), dropout on;
#                  ResNet-50 without --sync-bn is judged per replica (its distance from the global batch stated);
#                  its one checked step `equivalent` in every run
# then `python -m dpcompare report` per group of runs, and OUT_DIR/gpu_check.md: one table of every run (verdict,
# step time, samples/s, peak memory, clock) and one of every step (exit status, seconds, the judge's line).
#
# Budget: the whole check is sized for 8 minutes on one H100 at the default GPU_CHECK_STEPS=10; most of a step's
# time is its start-up (torch, the process group, the float64 oracle), not its timed steps. Where a slot is
# shorter, split the parts over invocations (GPU_CHECK_PARTS=functional, then GPU_CHECK_PARTS="amp sharding", ...):
# each part computes what it needs on its own and takes its own rendezvous ports (functional 29600, amp 29700,
# sharding 29800, resnet50 29900, gpt2-small 30000), so parts may also run side by side, each invocation with its
# own OUT_DIR.
#
# Knobs: DPCOMPARE_PY (python with dpcompare installed; default .venv/bin/python, else python3),
# GPU_CHECK_STEPS (measured steps per run, default 10), GPU_CHECK_TIMEOUT_S (per run, 600),
# GPU_CHECK_PARTS (default "functional amp sharding resnet50 gpt2-small": any subset, e.g. to split the work in two).
# Exit status: 0 when every step did what it should, 1 otherwise (each step that fell short listed at the end),
# 2 when there is no CUDA device.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${DPCOMPARE_PY:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
out=${1:-gpu-check/$(date +%Y%m%d-%H%M%S)}
steps=${GPU_CHECK_STEPS:-10}
parts=" ${GPU_CHECK_PARTS:-functional amp sharding resnet50 gpt2-small} "
timeout_s=${GPU_CHECK_TIMEOUT_S:-600}
mkdir -p "$out/logs" || { echo "gpu_check: cannot create $out: choose a writable OUT_DIR" >&2; exit 2; }
out=$(cd "$out" && pwd)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
bindir=$(dirname "$("$py" -c 'import sys; print(sys.executable)')")
export PATH="$bindir:$PATH"

gpus=$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "$gpus" = 0 ]; then
  echo "gpu_check: $py sees no CUDA device (torch.cuda.is_available() is False): run this on a GPU machine" >&2
  exit 2
fi
has() { "$py" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null; }

steps_tsv="$out/steps.tsv"
: >"$steps_tsv"
failed=0
short=()    # "STEP: why" for every step that fell short, listed at the end
group=none  # the runs' group: OUT_DIR/runs/<group>/<step> (set per part; `dpcompare report` reads a group)
port=29600  # the part's base rendezvous port (set per part); torchrun_n takes the next one
# step NAME EXPECTED_RC [JUDGE_FLAG... --] CMD...: run one step with its own log and its own results directory
# ($run_dir, which the dpcompare launchers below pass as --out); record its exit status and duration. With judge
# flags (experiments/gpu_judge.py's: --verdict, --skips, --memory, --count), a step that exited as expected is then
# judged on the results in $run_dir, and the judge's line is its verdict.
step() {
  local name=$1 want=$2; shift 2
  local judge=()
  if [[ ${1:-} == --?* ]]; then
    while [ $# -gt 0 ] && [ "$1" != -- ]; do judge+=("$1"); shift; done
    if [ $# -eq 0 ]; then echo "gpu_check: step $name: judge flags ${judge[*]} need '--' before the command" >&2; exit 2; fi
    shift
  fi
  local t0=$SECONDS rc verdict=ok short_of=""
  run_dir="$out/runs/$group/$name"
  [ ${#judge[@]} -gt 0 ] && mkdir -p "$run_dir"
  echo "== $name: $*"
  "$@" >"$out/logs/$name.log" 2>&1
  rc=$?
  if [ "$rc" != "$want" ]; then
    short_of="expected exit $want, got $rc"
  elif [ ${#judge[@]} -gt 0 ]; then
    local said line lines=()
    local judged
    said=$("$py" "$root/experiments/gpu_judge.py" "$run_dir" --step "$name" "${judge[@]}" 2>&1)
    judged=$?
    if [ "$judged" = 0 ]; then
      verdict="ok; ${said#"$name: ok: "}"
    else  # the judge's lines, one per shortfall, joined into one
      while IFS= read -r line; do [ -n "$line" ] && lines+=("${line#"$name: "}"); done <<<"$said"
      [ ${#lines[@]} -gt 0 ] || lines=("the judge exited $judged without a line")
      short_of=$(printf '%s; ' "${lines[@]}"); short_of=${short_of%; }
    fi
  fi
  if [ -n "$short_of" ]; then
    verdict="FELL SHORT: ${short_of//$'\t'/ }"; failed=1; short+=("$name: $short_of")
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$verdict" "$*" >>"$steps_tsv"
  echo "   exit $rc in $((SECONDS - t0)) s: $verdict"
  tail -n 2 "$out/logs/$name.log" | sed 's/^/   | /'
}
# Each launch is bounded by dpcompare's own watchdog (--timeout-s) and, should that fail, by timeout(1); each writes
# into the step's own directory.
bound() { timeout "$((timeout_s + 60))" "$@"; }
run1() { bound "$py" -m dpcompare run --device cuda --timeout-s "$timeout_s" --out "$run_dir" "$@"; }
torchrun_n() {
  local n=$1; shift; port=$((port + 1))
  bound torchrun --nproc_per_node="$n" --master-port "$port" -m dpcompare run --device cuda --timeout-s "$timeout_s" \
    --out "$run_dir" "$@"
}
horovod_n() {
  local n=$1; shift
  bound horovodrun --gloo --network-interface lo -np "$n" -H "localhost:$n" "$py" -m dpcompare run --device cuda \
    --timeout-s "$timeout_s" --out "$run_dir" "$@"
}
# part NAME BASE_PORT: is part NAME asked for (GPU_CHECK_PARTS)? If so, its runs take ports from BASE_PORT on, so
# parts started side by side in separate invocations do not meet at one rendezvous port.
part() { [[ "$parts" == *" $1 "* ]] || return 1; group=$1 port=$2; }

# World size 2: with one GPU two ranks share it over gloo (NCCL refuses two ranks on one device); with two or more,
# NCCL one rank per GPU. Set once, for every part.
ws2_args=(--opt dist_backend=gloo)
if [ "$gpus" -ge 2 ]; then ws2_args=(); fi

# --- environment --------------------------------------------------------------------------------------------
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  "$py" - <<'EOF'
import importlib.util, platform, torch
print(f"python: {platform.python_version()}  torch: {torch.__version__}  cuda: {torch.version.cuda}  "
      f"cudnn: {torch.backends.cudnn.version()}  nccl: {'.'.join(map(str, torch.cuda.nccl.version()))}")
for name in ("torchvision", "deepspeed", "horovod", "mpi4py"):
    spec = importlib.util.find_spec(name)
    version = "not installed"
    if spec:
        try:
            version = __import__(name).__version__
        except Exception as exc:  # an installed package that does not import is reported, not fatal
            version = f"installed, does not import: {type(exc).__name__}: {exc}"
    print(f"{name}: {version}")
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# --- the functional checks ----------------------------------------------------------------------------------
eq=(--verdict equivalent)
if part functional 29600; then
step nccl-ws1 0 "${eq[@]}" -- torchrun_n 1 --backend ddp --model resnet18-cifar --sync-bn --steps 2 --measure-steps "$steps"
step dp-1dev 0 "${eq[@]}" -- run1 --backend dp --model resnet18-cifar --steps 2 --measure-steps "$steps"
if [ "$gpus" -lt 2 ]; then
  # torchrun reports its ranks' exit 2 as its own exit 1; the ranks' one line is what must be there, and no result.
  group=refused
  step nccl-refused 1 --count 0 -- torchrun_n 2 --backend ddp --model mlp --steps 1 --measure-steps 0
  step nccl-refused-says-why 0 grep -q "NCCL refuses two ranks on one device: use --opt dist_backend=gloo" \
    "$out/logs/nccl-refused.log"
  group=functional
fi
step ddp-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend ddp "${ws2_args[@]}" --model resnet18-cifar --sync-bn --steps 2 \
  --measure-steps "$steps"
if has deepspeed; then
  step deepspeed-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --model gpt-tiny --steps 2 \
    --measure-steps "$steps"
fi
if has horovod; then
  step horovod-ws2 0 "${eq[@]}" -- horovod_n 2 --backend horovod --model gpt-tiny --steps 2 --measure-steps "$steps"
fi
# GPT-2 small trains with dropout: each rank's CUDA masks are captured during its forward and applied in the
# float64 oracle, so the verdict must be `equivalent` (`unverifiable`, naming the module whose mask was not
# captured, falls short: the capture is what the step shows). Without dropout the same network is checked
# deterministically. Each is reported on its own (ddp at world size 1 and 2 would supersede the resnet18 runs).
group=gpt2-small-dropout
step gpt2-small-dropout-ws1 0 "${eq[@]}" -- torchrun_n 1 --backend ddp --model gpt2-small --global-batch 2 --steps 2 \
  --measure-steps 0
group=gpt2-small-no-dropout
step gpt2-small-no-dropout-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend ddp "${ws2_args[@]}" --model gpt2-small \
  --no-dropout --global-batch 4 --steps 2 --measure-steps 0
fi

# --- mixed precision (--amp) -----------------------------------------------------------------------------------
# Each recipe judged against the float64 oracle on the floor of its own precision; the forced overflow must be
# skipped exactly where the oracle's rank-by-rank emulation of the recipe overflows (equivalence.precision).
# The overflow runs (mlp, 8 checked steps) are judged with --skips: at least one checked step skipped, each where
# the oracle predicted the overflow, and the verdict equivalent.
if part amp 29700; then
  amp_common=(--model gpt-tiny --steps 2 --measure-steps "$steps")
  overflow=(--model mlp --amp fp16 --loss-scale 16777216 --steps 8 --measure-steps 0)
  step amp-bf16-ddp-ws1 0 "${eq[@]}" -- torchrun_n 1 --backend ddp --amp bf16 "${amp_common[@]}"
  step amp-fp16-ddp-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend ddp "${ws2_args[@]}" --amp fp16 "${amp_common[@]}"
  step amp-bf16-dp-1dev 0 "${eq[@]}" -- run1 --backend dp --amp bf16 "${amp_common[@]}"
  group=amp-overflow
  step amp-fp16-overflow-ddp-ws1 0 --skips -- torchrun_n 1 --backend ddp "${overflow[@]}"
  group=amp
  if has horovod; then
    step amp-fp16-horovod-ws2 0 "${eq[@]}" -- horovod_n 2 --backend horovod --amp fp16 "${amp_common[@]}"
  fi
  if has deepspeed; then
    step amp-bf16-deepspeed-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --amp bf16 \
      "${amp_common[@]}"
    step amp-bf16-deepspeed-engine-ws2 0 "${eq[@]}" -- torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --amp bf16 \
      --opt amp_recipe=engine "${amp_common[@]}"
    step amp-fp16-deepspeed-engine-ws1 0 "${eq[@]}" -- torchrun_n 1 --backend deepspeed --amp fp16 \
      --opt amp_recipe=engine "${amp_common[@]}"
    group=amp-overflow
    step amp-fp16-overflow-deepspeed-engine-ws1 0 --skips -- torchrun_n 1 --backend deepspeed --opt amp_recipe=engine \
      "${overflow[@]}"
  fi
fi

# --- sharded data parallelism ------------------------------------------------------------------------------------
# ZeRO-2, ZeRO-3 and FSDP2 over NCCL (world size 1: NCCL's collectives on one rank) and at world size 2; AdamW, so
# the optimizer state is the largest component, measured on the device beside the ZeRO paper's formula: each run
# is judged `equivalent` and (--memory) its measured parameters and optimizer state per rank within 10 % of the
# formula (a component left unsharded at world size 2 is twice it).
if part sharding 29800; then
  shard_common=(--model gpt-tiny --optimizer adamw --steps 2 --measure-steps "$steps")
  for ws in 1 2; do
    extra=(); [ "$ws" = 2 ] && extra=("${ws2_args[@]}")
    if has deepspeed; then
      for stage in 2 3; do
        step "sharding-zero$stage-ws$ws" 0 "${eq[@]}" --memory -- torchrun_n "$ws" --backend deepspeed "${extra[@]}" \
          --opt zero_stage=$stage "${shard_common[@]}"
      done
    fi
    step "sharding-fsdp-ws$ws" 0 "${eq[@]}" --memory -- torchrun_n "$ws" --backend fsdp "${extra[@]}" "${shard_common[@]}"
  done
  if has deepspeed; then
    step sharding-zero3-bf16-ws1 0 "${eq[@]}" --memory -- torchrun_n 1 --backend deepspeed --opt zero_stage=3 --amp bf16 \
      "${shard_common[@]}"
  fi
fi

# --- throughput on the real models --------------------------------------------------------------------------
# (model, global batch): ResNet-50 at 64 images of 224x224 (32 per rank at world size 2), GPT-2 small at 8
# sequences of 1024 tokens. One checked step each (the float64 oracle runs on the GPU), then the timed steps; the
# checked step must be `equivalent` in every run (GPT-2's dropout masks captured; ResNet-50 without --sync-bn judged
# per replica).
for spec in resnet50:64:29900 gpt2-small:8:30000; do
  IFS=: read -r model batch base <<<"$spec"
  part "$model" "$base" || continue
  common=(--model "$model" --global-batch "$batch" --steps 1 --warmup-steps 5 --measure-steps "$steps")
  step "$model-reference" 0 "${eq[@]}" -- run1 --backend reference "${common[@]}"
  step "$model-dp" 0 "${eq[@]}" -- run1 --backend dp "${common[@]}"
  step "$model-ddp-ws1" 0 "${eq[@]}" -- torchrun_n 1 --backend ddp "${common[@]}"
  step "$model-ddp-ws2" 0 "${eq[@]}" -- torchrun_n 2 --backend ddp "${ws2_args[@]}" "${common[@]}"
  if has deepspeed; then
    step "$model-deepspeed-ws2" 0 "${eq[@]}" -- torchrun_n 2 --backend deepspeed "${ws2_args[@]}" "${common[@]}"
  fi
  if has horovod; then
    step "$model-horovod-ws2" 0 "${eq[@]}" -- horovod_n 2 --backend horovod "${common[@]}"
  fi
done

# --- reports --------------------------------------------------------------------------------------------------
# One report per group of runs that wrote results (OUT_DIR/runs/<group>/report.md).
group=reports
for d in "$out"/runs/*/; do
  d=${d%/}
  compgen -G "$d/*/*.json" >/dev/null && step "report-$(basename "$d")" 0 bound "$py" -m dpcompare report "$d"
done
if ! "$py" "$root/experiments/gpu_summary.py" "$out" >"$out/gpu_check.md" 2>"$out/logs/summary.log"; then
  failed=1; short+=("summary: experiments/gpu_summary.py failed (logs/summary.log)")
fi
cat "$out/gpu_check.md"
if [ "$failed" != 0 ]; then
  echo
  echo "gpu_check: ${#short[@]} step(s) fell short:"
  printf '  %s\n' "${short[@]}"
fi
exit "$failed"
