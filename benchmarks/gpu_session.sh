#!/usr/bin/env bash
# The GPU checks and full-size benchmarks, in parts that each fit one device
# call (10 minutes) on a single H100/H200. A session has 15 device-minutes:
# carry the wheels (.whl) and combine two or three parts per call.
#
#   bash benchmarks/gpu_wheels.sh              # first, here: the wheels to carry (.whl)
#   bash benchmarks/gpu_session.sh tests       # the tests marked gpu             (~1 min)
#   bash benchmarks/gpu_session.sh throughput  # link bandwidth; 1.7B, sequence 2048,
#                                              # 4 strategies (~7 min; STRATEGIES="a b" picks;
#                                              # "roundpipe roundpipe_one_copy": the two
#                                              # master copies against one, ~2.5 min)
#   bash benchmarks/gpu_session.sh profile     # a torch.profiler trace of two steady 1.7B
#                                              # RoundPipe steps: summary and timeline (~2 min)
#   bash benchmarks/gpu_session.sh lora        # Llama-3.1-8B LoRA r=32 throughput (~6 min;
#                                              # STRATEGIES picks, as for throughput)
#   bash benchmarks/gpu_session.sh seqlen      # longest sequence, 1.7B, micro-batch 1 (~9 min)
#   bash benchmarks/gpu_session.sh engine      # engine throughput, protocol ablation, overheads (~5 min)
#   bash benchmarks/gpu_session.sh longctx-memory      # Llama-3.1-8B LoRA blocks at 64K-1M tokens:
#                                                      # predicted vs measured peak (~9 min)
#   bash benchmarks/gpu_session.sh longctx-throughput  # Qwen3-1.7B at 8K/32K/128K tokens (~5 min)
#   bash benchmarks/gpu_session.sh longctx-rewalk      # 1M tokens, 2 Llama-3.1-8B LoRA blocks,
#                                                      # 10 GiB for boundary values, stages of
#                                                      # 71 GiB: 2|2|2|rewalk (~5 min)
#
# Done on H200s on 2026-11-26 (docs/benchmarks.md): tests, throughput
# (DeepSpeed not installed then), three long-sequence probes; later that day
# tests, throughput of roundpipe / roundpipe_one_copy / auto, the profile
# (twice) and longctx-memory at 64K and 256K tokens. On 2026-11-27: tests
# (all 27 pass), roundpipe throughput at 1.7B (the courier fix holds); the
# 8B LoRA trials timed out while building the model on the CPU (now drawn on
# the GPU); DeepSpeed's CPU Adam compiles there from the carried wheels.
#
# New since 2026-11-27's run, untested on a GPU (the `tests` part runs their
# gpu tests): classifiers' scores downloaded with the loss (with_outputs),
# batch norm in fp32 on CUDA replicas under bf16-mixed, the steps' host code
# under autocast for the devices' type too, several outputs of a last layer,
# question-answering models' start/end scores (test_classifier.py's qa case),
# gradient checkpointing that replays the device generator itself
# (test_strategy.py's ..._on_gpu_workers_replays_the_masks).
#
# Next session (15 device-minutes), after `bash benchmarks/gpu_wheels.sh` here:
#   call 1 (~9 min): lora (roundpipe, fsdp_offload, deepspeed_offload; check
#                    the "built ... in" lines of trials.log first), then
#                    STRATEGIES="roundpipe auto deepspeed_offload" throughput
#   call 2 (~3 min, same warm machine): profile, or longctx-rewalk
# then, with what is left: seqlen, engine, longctx-memory at 1M,
# longctx-throughput. The profile's trace comes back in 15 MB pieces.
#
# Markdown tables (ready for docs/benchmarks.md), raw JSON and logs go to $OUT
# (set by the device tool) or runs/gpu. Every trial runs in its own process
# with a time limit ($ROUNDPIPE_TRIAL_TIMEOUT seconds), so one slow or stuck
# strategy is reported in its table row instead of eating the call.
#
# SMOKE=1 runs the same commands at tiny sizes, so the wiring can be checked on
# a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:?give a part: tests, throughput, profile, lora, seqlen, engine, longctx-memory, longctx-rewalk or longctx-throughput}"
case "$part" in
tests | throughput | profile | lora | seqlen | engine | longctx-memory | longctx-rewalk | longctx-throughput) ;;
*)
    echo "unknown part '$part': give tests, throughput, profile, lora, seqlen, engine," \
        "longctx-memory, longctx-rewalk or longctx-throughput" >&2
    exit 2
    ;;
esac

# wheels the GPU machine lacks (benchmarks/gpu_wheels.sh, carried as .whl)
if command -v nvidia-smi >/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

out="${OUT:-runs/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, no install
smoke="${SMOKE:-0}"

# (Lightning's version from its metadata: importing it costs seconds)
python - <<'EOF' | tee "$out/machine.txt"
import platform, torch
from importlib.metadata import version
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"{gpu}; {platform.machine()}; torch {torch.__version__}; lightning {version('lightning')}")
EOF

case "$part" in
tests)
    # the CUDA variants (engine on a GPU, pinned/device memory leak check),
    # then the strategy tests again with a GPU present
    # no -x: one failure must not hide the tests after it; a hang is cut per test
    timeout=()
    if python -c "import pytest_timeout" 2>/dev/null; then timeout=(--timeout 150); fi
    python -m pytest -q -rA -p no:cacheprovider -n 0 -m gpu ${timeout[@]+"${timeout[@]}"} 2>&1 |
        tee "$out/tests-gpu.log" || true
    if [ "$smoke" != 1 ]; then
        timeout 420 python -m pytest -q -p no:cacheprovider -n 0 tests/strategy 2>&1 |
            tee "$out/tests-strategy.log"
    fi
    ;;
throughput)
    if [ "$smoke" = 1 ]; then
        args=(--sizes tiny --seq 64 --batch 8 --micro 2 --steps 3)
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-120}"
    else
        # tokens/s from the median step after the first: 8 steps, so that the
        # median of 7 is a steady step (with 5, a warm-up step counted)
        args=(--sizes 1.7b --seq 2048 --batch 64 --micro 4 --steps 8)
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-240}"
    fi
    if [ -n "${STRATEGIES:-}" ]; then
        read -r -a names <<<"$STRATEGIES"
        args+=(--strategies "${names[@]}")
    fi
    python benchmarks/link.py --json "$out/link.json" || true
    ROUNDPIPE_TRIAL_LOG="$out/trials.log" python benchmarks/throughput.py "${args[@]}" \
        --json "$out/throughput.json" --append "$out/throughput.md"
    ;;
profile)
    if [ "$smoke" = 1 ]; then
        args=(--size tiny --seq 64 --batch 8 --micro 2)
    else
        args=(--size 1.7b --seq 2048 --batch 64 --micro 4)
    fi
    timeout 300 python benchmarks/lm_runner.py --strategy roundpipe "${args[@]}" --steps 6 \
        --profile "$out/profile" | tee "$out/profile.json"
    # the device tool brings back files of up to 16 MiB (the 1.7B trace is
    # about 30 MB): pieces, joined with `cat trace.json.gz.* > trace.json.gz`
    trace="$out/profile/trace.json.gz"
    if [ -f "$trace" ] && [ "$(stat -c %s "$trace")" -gt 15000000 ]; then
        split -b 15M "$trace" "$trace." && rm "$trace"
    fi
    ;;
lora)
    if [ "$smoke" = 1 ]; then
        args=(--sizes llama-tiny --lora 4 --seq 64 --batch 8 --micro 2 --steps 3)
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-120}"
    else
        args=(--sizes llama-8b --lora 32 --seq 2048 --batch 32 --micro 4 --steps 4)
        # FSDP offload moves the fp32 base three times per micro-batch: minutes
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-240}"
    fi
    names=(roundpipe auto fsdp_offload deepspeed_offload)
    if [ -n "${STRATEGIES:-}" ]; then read -r -a names <<<"$STRATEGIES"; fi
    ROUNDPIPE_TRIAL_LOG="$out/trials.log" python benchmarks/throughput.py "${args[@]}" \
        --strategies "${names[@]}" \
        --json "$out/throughput-lora.json" --append "$out/throughput-lora.md"
    ;;
seqlen)
    # RoundPipe from 64K up; the others from 8K (no-offload ran out at 64K on an H200)
    if [ "$smoke" = 1 ]; then
        runs=("--size tiny --low 128 --high 128 --strategies roundpipe")  # one trial
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-120}"
    else
        runs=("--size 1.7b --low 65536 --high 524288 --step 16384 --strategies roundpipe"
            "--size 1.7b --low 8192 --high 65536 --step 4096 --strategies auto fsdp_offload")
        export ROUNDPIPE_TRIAL_TIMEOUT="${ROUNDPIPE_TRIAL_TIMEOUT:-120}"
    fi
    for run in "${runs[@]}"; do
        read -r -a args <<<"$run"
        ROUNDPIPE_TRIAL_LOG="$out/trials.log" python benchmarks/max_seqlen.py "${args[@]}" \
            --append "$out/max_seqlen.md"
    done
    ;;
engine)
    if [ "$smoke" = 1 ]; then
        python benchmarks/engine.py overhead --append "$out/engine.md"
        python benchmarks/consistency.py --iters 2 --append "$out/consistency.md"
    else
        timeout 240 python benchmarks/engine.py throughput --append "$out/engine.md" ||
            echo "engine throughput: exit $?" | tee -a "$out/engine.md"
        timeout 150 python benchmarks/consistency.py --device cuda --width 4096 --batch 256 1024 4096 \
            --append "$out/consistency.md" ||
            echo "consistency: exit $?" | tee -a "$out/consistency.md"
        timeout 120 python benchmarks/overhead.py --append "$out/overhead.md" ||
            echo "overhead: exit $?" | tee -a "$out/overhead.md"
    fi
    ;;
longctx-memory | longctx-throughput)
    which="${part#longctx-}"
    extra=()
    if [ "$smoke" = 1 ]; then
        extra=(--smoke --budget 240 --trial-timeout 120)
    fi
    python benchmarks/long_context_gpu.py "$which" ${extra[@]+"${extra[@]}"} \
        --json "$out/long-context-$which.json" --append "$out/long-context-$which.md"
    ;;
longctx-rewalk)
    # one micro-batch's boundary values get room for one; stages of 71 GiB
    # hold one layer's backward at 1M tokens but not a layer input more:
    # 2|2|2|rewalk on any card
    extra=(--seqs 1048576 --activation-memory 10 --device-memory-limit 71)
    if [ "$smoke" = 1 ]; then
        extra=(--smoke --seqs 256 --activation-memory 0.0003 --budget 240 --trial-timeout 120)
    fi
    python benchmarks/long_context_gpu.py memory "${extra[@]}" \
        --json "$out/long-context-rewalk.json" --append "$out/long-context-rewalk.md"
    ;;
esac
echo "results in $out: $(ls "$out" | tr '\n' ' ')"
