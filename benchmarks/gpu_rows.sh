#!/usr/bin/env bash
# The GPU rows of the benchmarks and the CUDA tests in one prepared run, for a lent GPU machine (issues 35, 38).
#
# Usage, from the repository root on the GPU machine (torch with CUDA installed there):
#   OUT=/some/folder bash benchmarks/gpu_rows.sh [CARD]        # CARD names the records, e.g. h200 (default: gpu)
# Optional, prepared beside the repository before the run (both ignored by git, carried to the machine):
#   .whl/     wheels of the lock's versions missing there (transformers, peft), installed with --no-deps into /tmp/site
#   .before/  an older `ief` package (`git archive REV ief | tar -x -C .before`): its rows are measured in the same run
#             as "before", from .before as the working folder so that its `ief` is the one imported
# Each part has its own time limit and appends its log to $OUT/all.log (its JSON record beside it) as it goes, so a
# part that fails or runs out of time costs only itself; the parts run in order of importance, within BUDGET seconds
# (default 480).
# SIZE=tiny DEVICE=cpu runs the same on a CPU.
set -u
OUT=${OUT:?set OUT to the folder for the logs and records}
CARD=${1:-gpu}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-full}
ROOT=$(pwd)
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/all.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/all.log"; }
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$PY - <<'EOF' | tee -a "$OUT/all.log"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", "transformers", transformers.__version__)
EOF

BUDGET=${BUDGET:-480}  # seconds for all parts together: a part gets at most what is left of it
part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS)) t0=$SECONDS
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, $left s of the budget left"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
  local rc=$?
  { echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)"; cat "/tmp/$name.log"; } >>"$OUT/all.log"
  echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)"
  grep -v "^\[transformers\]\|USDT\|Warning" "/tmp/$name.log" | tail -n "${TAIL:-14}"
}

if [ "$SIZE" = tiny ]; then
  G="--size tiny --batch 2 --tokens 8 --repeats 2"; M="--batch 8 --repeats 2"; T="--models t5-lora --repeats 2"
  L="--size tiny --repeats 2"
else
  G="--repeats 7"; M="--repeats 15"; T="--t5-size t5-base-config --models t5-lora --repeats 9"; L="--repeats 7"
fi

# 1. the CUDA tests (skipped on a machine without a GPU)
part tests 150 $PY -m pytest -q -p no:cacheprovider -x tests/ief/test_gpu.py \
  $(ls tests/ief/test_precision.py tests/companion/test_host_syncs.py 2>/dev/null) -k "cuda or gpu"
# 2. GPT-2 full fine-tuning (issue 38's largest gap), now and before
part gpt2_full 240 $PY -m benchmarks gpt2_full --device "$DEVICE" $G --json "$OUT/gpt2_full-$CARD.json"
if [ -d .before/ief ]; then
  part gpt2_full_before 200 bash -c \
    "cd .before && PYTHONPATH=.:$PYTHONPATH $PY -m benchmarks gpt2_full --device $DEVICE $G --heads untied"
fi
# 3. Llama-style decoder + LoRA under bf16 autocast against AdamW under bf16 autocast (issue 35), if present
if [ -f benchmarks/llama_lora.py ]; then
  part llama_lora 200 $PY -m benchmarks.llama_lora --device "$DEVICE" $L --json "$OUT/llama_lora-$CARD.json"
fi
# 4. the paper's MLP and T5 + LoRA steps (issue 38's first two rows), now and before
part paper_mlp 150 $PY -m benchmarks paper_mlp --device "$DEVICE" $M --json "$OUT/paper_mlp-$CARD.json"
part step_t5 180 $PY -m benchmarks step --device "$DEVICE" $T --json "$OUT/step-$CARD.json"
if [ -d .before/ief ]; then
  part paper_mlp_before 150 bash -c \
    "cd .before && PYTHONPATH=.:$PYTHONPATH $PY -m benchmarks paper_mlp --device $DEVICE $M"
  part step_t5_before 180 bash -c "cd .before && PYTHONPATH=.:$PYTHONPATH $PY -m benchmarks step --device $DEVICE $T"
fi
ls -la "$OUT"
