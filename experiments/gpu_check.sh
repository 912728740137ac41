#!/usr/bin/env bash
# Everything one GPU can show about dpcompare, in one command, with a report at the end:
#
#   bash experiments/gpu_check.sh [OUT_DIR]        (default OUT_DIR: gpu-check/<date-time>)
#
# On one CUDA device it runs, each step logged and judged on its own (a failing step does not stop the rest):
#   env            nvidia-smi, torch, CUDA, NCCL, cuDNN, and which backends are installed
#   nccl-ws1       ddp over NCCL at world size 1 (torchrun), CUDA-event timing and torch.cuda peak memory
#   dp-1dev        nn.DataParallel on one real device
#   nccl-refused   two ranks on one GPU with NCCL: must be refused in one line, exit 2 (NCCL cannot do it)
#   ddp/deepspeed/horovod-ws2   world size 2 on the one device over gloo (--opt dist_backend=gloo;
#                  Horovod's gloo controller), CUDA tensors; with two or more GPUs, NCCL one rank per GPU
#   gpt2-small-dropout   GPT-2 small with its dropout at world size 1: the CUDA masks captured, not replayed
#   amp-*          mixed precision on CUDA: bf16 and fp16 autocast under ddp, dp and horovod, a forced fp16
#                  overflow (initial loss scale 2^24) every backend must skip, DeepSpeed's bf16 and fp16 engines
#                  (fp32 master weights; fp16 weights exist on CUDA, refused on the CPU accelerator)
#   sharding-*     ZeRO-2, ZeRO-3 and FSDP2 on NCCL at world size 1 (AdamW, gpt-tiny): each judged against the
#                  float64 oracle, CUDA memory per component (metrics.model_state_mib_per_rank) beside the ZeRO
#                  formula, and the same at world size 2 (gloo over one GPU, or NCCL with two GPUs)
#   resnet50, gpt2-small        throughput of every installed backend (world size 1 and 2), dropout on;
#                  ResNet-50 without --sync-bn is judged per replica (its distance from the global batch stated)
# then `python -m dpcompare report` per model, and OUT_DIR/gpu_check.md: one table of every run (verdict,
# step time, samples/s, peak memory, clock) and one of every step (exit status, seconds).
#
# Knobs: DPCOMPARE_PY (python with dpcompare installed; default .venv/bin/python, else python3),
# GPU_CHECK_STEPS (measured steps per throughput run, default 20), GPU_CHECK_TIMEOUT_S (per run, 600),
# GPU_CHECK_PARTS (default "functional amp sharding resnet50 gpt2-small": any subset, e.g. to split the work in two).
# Exit status: 0 when every step did what it should, 1 otherwise, 2 when there is no CUDA device.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${DPCOMPARE_PY:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
out=${1:-gpu-check/$(date +%Y%m%d-%H%M%S)}
steps=${GPU_CHECK_STEPS:-20}
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
port=29600
# step NAME EXPECTED_RC CMD...: run one step with its own log; record its exit status and duration.
step() {
  local name=$1 want=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name: $*"
  "$@" >"$out/logs/$name.log" 2>&1
  rc=$?
  local verdict=ok
  if [ "$rc" != "$want" ]; then verdict="FAILED (expected exit $want)"; failed=1; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$verdict" "$*" >>"$steps_tsv"
  echo "   exit $rc in $((SECONDS - t0)) s: $verdict"
  tail -n 2 "$out/logs/$name.log" | sed 's/^/   | /'
}
# Each launch is bounded by dpcompare's own watchdog (--timeout-s) and, should that fail, by timeout(1).
bound() { timeout "$((timeout_s + 60))" "$@"; }
run1() { bound "$py" -m dpcompare run --device cuda --timeout-s "$timeout_s" "$@"; }
torchrun_n() { local n=$1; shift; port=$((port + 1)); bound torchrun --nproc_per_node="$n" --master-port "$port" -m dpcompare run --device cuda --timeout-s "$timeout_s" "$@"; }
horovod_n() { local n=$1; shift; bound horovodrun --gloo --network-interface lo -np "$n" -H "localhost:$n" "$py" -m dpcompare run --device cuda --timeout-s "$timeout_s" "$@"; }

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
want() { [[ "$parts" == *" $1 "* ]]; }
f="$out/functional"
if want functional; then
step nccl-ws1 0 torchrun_n 1 --backend ddp --model resnet18-cifar --sync-bn --steps 2 --measure-steps "$steps" --out "$f"
step dp-1dev 0 run1 --backend dp --model resnet18-cifar --steps 2 --measure-steps "$steps" --out "$f"
ws2_args=(--opt dist_backend=gloo)
if [ "$gpus" -ge 2 ]; then ws2_args=(); else
  # torchrun reports its ranks' exit 2 as its own exit 1; the ranks' one line is what must be there.
  step nccl-refused 1 torchrun_n 2 --backend ddp --model mlp --steps 1 --measure-steps 0 --out "$out/refused"
  step nccl-refused-says-why 0 grep -q "NCCL refuses two ranks on one device: use --opt dist_backend=gloo" \
    "$out/logs/nccl-refused.log"
fi
step ddp-ws2 0 torchrun_n 2 --backend ddp "${ws2_args[@]}" --model resnet18-cifar --sync-bn --steps 2 --measure-steps "$steps" --out "$f"
if has deepspeed; then
  step deepspeed-ws2 0 torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --model gpt-tiny --steps 2 --measure-steps "$steps" --out "$f"
fi
if has horovod; then
  step horovod-ws2 0 horovod_n 2 --backend horovod --model gpt-tiny --steps 2 --measure-steps "$steps" --out "$f"
fi
# GPT-2 small trains with dropout: each rank's CUDA masks are captured during its forward and applied in the
# float64 oracle, so the verdict is `equivalent`, or `unverifiable` naming the one module whose mask cannot be
# captured. Without dropout the same network is checked deterministically.
step gpt2-small-dropout-ws1 0 torchrun_n 1 --backend ddp --model gpt2-small --global-batch 2 --steps 2 \
  --measure-steps 0 --out "$out/gpt2-small-dropout"
step gpt2-small-no-dropout-ws2 0 torchrun_n 2 --backend ddp "${ws2_args[@]}" --model gpt2-small --no-dropout \
  --global-batch 4 --steps 2 --measure-steps 0 --out "$out/gpt2-small-no-dropout"
fi

# --- mixed precision (--amp) -----------------------------------------------------------------------------------
# Each recipe judged against the float64 oracle on the floor of its own precision; the forced overflow must be
# skipped exactly where the oracle's rank-by-rank emulation of the recipe overflows (equivalence.precision).
a="$out/amp"
if want amp; then
  amp_common=(--model gpt-tiny --steps 2 --measure-steps "$steps")
  step amp-bf16-ddp-ws1 0 torchrun_n 1 --backend ddp --amp bf16 "${amp_common[@]}" --out "$a"
  step amp-fp16-ddp-ws2 0 torchrun_n 2 --backend ddp "${ws2_args[@]}" --amp fp16 "${amp_common[@]}" --out "$a"
  step amp-bf16-dp-1dev 0 run1 --backend dp --amp bf16 "${amp_common[@]}" --out "$a"
  step amp-fp16-overflow-ddp-ws1 0 torchrun_n 1 --backend ddp --model mlp --amp fp16 --loss-scale 16777216 \
    --steps 8 --measure-steps 0 --out "$a/overflow"
  if has horovod; then
    step amp-fp16-horovod-ws2 0 horovod_n 2 --backend horovod --amp fp16 "${amp_common[@]}" --out "$a"
  fi
  if has deepspeed; then
    step amp-bf16-deepspeed-ws2 0 torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --amp bf16 "${amp_common[@]}" --out "$a"
    step amp-bf16-deepspeed-engine-ws2 0 torchrun_n 2 --backend deepspeed "${ws2_args[@]}" --amp bf16 \
      --opt amp_recipe=engine "${amp_common[@]}" --out "$a"
    step amp-fp16-deepspeed-engine-ws1 0 torchrun_n 1 --backend deepspeed --amp fp16 --opt amp_recipe=engine \
      "${amp_common[@]}" --out "$a"
    step amp-fp16-overflow-deepspeed-engine-ws1 0 torchrun_n 1 --backend deepspeed --model mlp --amp fp16 \
      --opt amp_recipe=engine --loss-scale 16777216 --steps 8 --measure-steps 0 --out "$a/overflow"
  fi
fi

# --- sharded data parallelism ------------------------------------------------------------------------------------
# ZeRO-2, ZeRO-3 and FSDP2 over NCCL (world size 1: NCCL's collectives on one rank) and at world size 2; AdamW, so
# the optimizer state is the largest component, measured on the device beside the ZeRO paper's formula.
z="$out/sharding"
if want sharding; then
  shard_common=(--model gpt-tiny --optimizer adamw --steps 2 --measure-steps "$steps")
  for ws in 1 2; do
    extra=(); [ "$ws" = 2 ] && extra=("${ws2_args[@]}")
    if has deepspeed; then
      for stage in 2 3; do
        step "sharding-zero$stage-ws$ws" 0 torchrun_n "$ws" --backend deepspeed "${extra[@]}" --opt zero_stage=$stage \
          "${shard_common[@]}" --out "$z"
      done
    fi
    step "sharding-fsdp-ws$ws" 0 torchrun_n "$ws" --backend fsdp "${extra[@]}" "${shard_common[@]}" --out "$z"
  done
  step sharding-zero3-bf16-ws1 0 torchrun_n 1 --backend deepspeed --opt zero_stage=3 --amp bf16 "${shard_common[@]}" \
    --out "$z"
fi

# --- throughput on the real models --------------------------------------------------------------------------
# (model, global batch): ResNet-50 at 64 images of 224x224 (32 per rank at world size 2), GPT-2 small at 8
# sequences of 1024 tokens. One checked step each (the float64 oracle runs on the GPU), then the timed steps.
for spec in resnet50:64 gpt2-small:8; do
  model=${spec%%:*} batch=${spec##*:}
  want "$model" || continue
  d="$out/$model"
  common=(--model "$model" --global-batch "$batch" --steps 1 --warmup-steps 5 --measure-steps "$steps" --out "$d")
  step "$model-reference" 0 run1 --backend reference "${common[@]}"
  step "$model-dp" 0 run1 --backend dp "${common[@]}"
  step "$model-ddp-ws1" 0 torchrun_n 1 --backend ddp "${common[@]}"
  step "$model-ddp-ws2" 0 torchrun_n 2 --backend ddp "${ws2_args[@]}" "${common[@]}"
  if has deepspeed; then
    step "$model-deepspeed-ws2" 0 torchrun_n 2 --backend deepspeed "${ws2_args[@]}" "${common[@]}"
  fi
  if has horovod; then
    step "$model-horovod-ws2" 0 horovod_n 2 --backend horovod "${common[@]}"
  fi
done

# --- reports --------------------------------------------------------------------------------------------------
for d in "$out/functional" "$out/amp" "$out/sharding" "$out/gpt2-small-dropout" "$out/gpt2-small-no-dropout" "$out/resnet50" "$out/gpt2-small"; do
  [ -d "$d" ] && step "report-$(basename "$d")" 0 bound "$py" -m dpcompare report "$d"
done
"$py" "$root/experiments/gpu_summary.py" "$out" >"$out/gpu_check.md" 2>"$out/logs/summary.log" || failed=1
cat "$out/gpu_check.md"
exit "$failed"
