# flowgrpo tasks. Every recipe sets up what it needs first (see `setup`).

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv"
python := venv / "bin/python"
venv_vllm := justfile_directory() / ".venv-vllm"
# The recipes that need no Hub (tests, the demo, the toy experiments, benchmarks) run offline,
# and say so in any Hub error; `just flowgrpo` and your own commands keep the Hub reachable.
offline := "HF_HUB_OFFLINE=1 FLOWGRPO_OFFLINE_SOURCE='the Justfile recipe'"

# List the recipes.
default:
    @just --list

# Create .venv and install flowgrpo with its test, OCR and Ray extras (idempotent, fast when done).
setup:
    #!/usr/bin/env bash
    set -euo pipefail
    # --system-site-packages: a torch you installed yourself (CUDA, ROCm) stays visible and is
    # kept; torch==2.13.0 is installed only when no torch can be imported at all.
    [ -x "{{python}}" ] || python3 -m venv --system-site-packages "{{venv}}"
    if ! "{{python}}" -c "import torch" 2>/dev/null; then
        "{{python}}" -m pip install --quiet torch==2.13.0
    fi
    stamp="{{venv}}/.flowgrpo-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        "{{python}}" -m pip install --quiet -e '.[ocr,dev,ray]'
        touch "$stamp"
    fi

# Any flowgrpo command, in the venv `setup` made: `just flowgrpo loop -n 40 --run runs/tiny`.
[positional-arguments]
flowgrpo *ARGS: setup
    "{{venv}}/bin/flowgrpo" "$@"

# The main job on the built-in tiny model: a tiny SD3 pipeline, 30 iterations, a report.
demo: setup
    #!/usr/bin/env bash
    set -euo pipefail
    export {{offline}}
    # One intra-op thread unless you say otherwise: the demo's bytes (and its table in the
    # README) depend on the thread count, and on a busy machine more threads only wait.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    flowgrpo="{{venv}}/bin/flowgrpo"
    # Rebuilt every time (a second; seeded, so the same bytes): a folder left by an older
    # version of the tiny model is replaced rather than trained on.
    "$flowgrpo" tiny-model --family sd3 runs/models/tiny-sd3
    "$flowgrpo" loop --config examples/tiny.toml --iterations 30
    "$flowgrpo" report runs/tiny

# Held-out evaluation every 10 iterations, a report, then base and trained scored with and
# without CFG (docs/experiments.md). About 25 minutes on one core (14 of them RL).
# Flow-GRPO with the OCR reward on the committed 3.7M-parameter toy base, 70 iterations.
toy-ocr iterations="70": setup
    #!/usr/bin/env bash
    set -euo pipefail
    export {{offline}}
    flowgrpo="{{venv}}/bin/flowgrpo"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    "$flowgrpo" prepare --config examples/toy_ocr/rl.toml
    "$flowgrpo" loop --config examples/toy_ocr/rl.toml --iterations {{iterations}}
    "$flowgrpo" report runs/toy-ocr
    last=$(printf 'runs/toy-ocr/checkpoints/iter-%06d' $(( {{iterations}} - 1 )))
    for lora in "" "$last"; do
        {{python}} examples/toy_ocr/evaluate.py examples/toy_ocr/base ${lora:+--lora "$lora"}
    done

# As it was made: 3,500 steps from scratch, exported (float16), then 2,000 more steps from that
# export with a fresh optimizer, exported, then 750 more the same way. The run folders keep
# every checkpoint and its held-out scores (examples/toy_ocr/PRETRAINING.md).
# Pre-train the toy OCR base from scratch into examples/toy_ocr/base (2.8 hours on 2 cores).
toy-ocr-pretrain: setup
    {{offline}} {{python}} examples/toy_ocr/pretrain.py --out runs/toy-ocr-pretrain --max-steps 3500 --minutes 1000 --threads 2
    {{offline}} {{python}} examples/toy_ocr/export_base.py runs/toy-ocr-pretrain/checkpoints/step-03500 examples/toy_ocr/base
    {{offline}} {{python}} examples/toy_ocr/pretrain.py --out runs/toy-ocr-continue --init-from examples/toy_ocr/base --max-steps 2000 --minutes 1000 --threads 2
    {{offline}} {{python}} examples/toy_ocr/export_base.py runs/toy-ocr-continue/checkpoints/step-02000 examples/toy_ocr/base
    {{offline}} {{python}} examples/toy_ocr/pretrain.py --out runs/toy-ocr-stage3 --init-from examples/toy_ocr/base --max-steps 750 --minutes 1000 --threads 2
    {{offline}} {{python}} examples/toy_ocr/export_base.py runs/toy-ocr-stage3/checkpoints/step-00750 examples/toy_ocr/base

# RL algorithms and continued pre-training of the toy OCR base, each for the same training
# time, as held-out OCR accuracy against training minutes (docs/experiments.md).
# The learning benchmark: `just learn --minutes 10 --arms awm,pretrain` (options pass through).
learn *ARGS: setup
    {{offline}} {{python}} examples/toy_ocr/learn.py {{ARGS}}

# To choose the CFG scale an RL arm is scored at on the validation prompts (docs/experiments.md).
# An arm's checkpoints scored at other CFG scales: `just rescore runs/learn/awm --guidance 1,2,4`.
rescore *ARGS: setup
    {{offline}} {{python}} examples/toy_ocr/rescore.py {{ARGS}}

# ALGORITHM on 4 training prompts of the toy OCR base, 16 images each, with its committed toy
# config (examples/toy_ocr/rl_ALGORITHM.toml; flow_grpo: rl.toml): the rollout reward, printed
# per iteration, must reach 0.85 within 30 iterations (docs/experiments.md has each
# algorithm's row). On your own run: the same --set options on its config
# (docs/troubleshooting.md, "When a run is flat").
# The overfit check, the first thing to try when a run is flat: `just overfit flow_grpo`.
overfit algorithm="awm" iterations="30": setup
    #!/usr/bin/env bash
    set -euo pipefail
    export {{offline}}
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    config=examples/toy_ocr/rl_{{algorithm}}.toml
    [ "{{algorithm}}" = flow_grpo ] && config=examples/toy_ocr/rl.toml
    [ -f "$config" ] || { echo "no toy config for {{algorithm}}: $config" >&2; exit 1; }
    "{{venv}}/bin/flowgrpo" loop --config "$config" \
        --run runs/toy-ocr-overfit-{{algorithm}} --iterations {{iterations}} \
        --set data.train_prompts=4 --set algorithm.prompts_per_iteration=4 \
        --set algorithm.group_size=16 --set eval.every=0

# Options pass through: `just geneval-train --seed 1 --per-tag 2000` (examples/geneval/README.md).
# GenEval training prompts by GenEval's rules, none a test prompt: examples/geneval/train_metadata.jsonl.
geneval-train *ARGS: setup
    {{offline}} {{python}} examples/geneval/make_train_metadata.py {{ARGS}}

# Measured on the tiny model and scaled to SD3.5-M's shapes (docs/run-directory.md).
# Disk of a 1,000-iteration run of examples/sd35m_ocr.toml, with and without retention.
disk-projection: setup
    {{offline}} {{python}} -m benchmarks.disk_projection

# Counted from their released architectures on the meta device (docs/rewards.md).
# Weights memory of the model rewards (pickscore, clipscore, aesthetic, hpsv2).
reward-memory: setup
    {{offline}} {{python}} -m benchmarks.reward_memory

# Memory per GPU of each stage, disk per iteration and for the whole run, and the passes per
# iteration, printed before anything is loaded or downloaded.
# Plan a config's memory, disk and passes: `just plan -c examples/sd35m_ocr.toml`.
[positional-arguments]
plan *ARGS: setup
    "{{venv}}/bin/flowgrpo" plan "$@"

# One GPU, a few minutes, no Hub: `flowgrpo loop` on an SD3.5-Medium-sized model with random
# weights (bfloat16, LoRA r 32, 512 px, 10 SDE steps, CFG 4.5): rollout and update images/s,
# peak GPU memory against `flowgrpo plan`, the rollout/update log-prob gap; one JSON.
# The prepared GPU check: `just gpu-check --out gpu.json` (`--smoke`: the same code on the CPU).
gpu-check *ARGS: setup
    {{offline}} {{python}} -m benchmarks.gpu_check {{ARGS}}

# The same check from the vllm-omni environment, which adds that engine's images/s.
gpu-check-vllm *ARGS: setup-vllm
    {{offline}} {{venv_vllm}}/bin/python -m benchmarks.gpu_check {{ARGS}}

# Options pass through: `just bench --only rollout,update --reps 4`.
# Every benchmark, side by side, one table (also written to benchmarks/results.md).
bench *ARGS: setup
    {{offline}} OMP_NUM_THREADS=1 {{python}} -m benchmarks {{ARGS}}

# Lint, format check, the docs' strict build and every test (files over up to 4 processes).
test: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/mypy
    {{offline}} {{python}} -m pytest --numprocesses auto --maxprocesses 4 --dist loadfile

# vllm-omni 0.30 pins diffusers 0.40, so it gets its own environment. 1.7 GB download, 6.6 GB.
# The vllm-omni engine's environment, .venv-vllm: torch 2.13, vllm 0.30, vllm-omni, flowgrpo.
setup-vllm:
    bash scripts/vllm/setup.sh

# The vllm-omni engine against the diffusers engine, on CPU (minutes; not part of `test`).
test-vllm:
    bash scripts/vllm/setup.sh --cpu-test
    {{offline}} {{venv_vllm}}/bin/python -m pytest tests/vllm -s

# Strict: a broken link, anchor or nav entry fails (tests/test_docs.py builds it the same way).
# Build the documentation site into site/.
docs: setup
    NO_MKDOCS_2_WARNING=1 {{venv}}/bin/mkdocs build --strict

# Serve the documentation site at http://127.0.0.1:8000, rebuilt as you edit.
docs-serve: setup
    NO_MKDOCS_2_WARNING=1 {{venv}}/bin/mkdocs serve

# Apply the formatter and the linter's safe fixes.
fmt: setup
    {{venv}}/bin/ruff format .
    {{venv}}/bin/ruff check --fix .
