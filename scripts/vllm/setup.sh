#!/usr/bin/env bash
# Create .venv-vllm: the environment of flowgrpo's vllm-omni rollout engine (`just setup-vllm`).
#
# vllm-omni 0.30 pins diffusers==0.40.0 (and transformers<5.15), vllm 0.30 pins torch==2.13.0:
# the engine gets an environment of its own, next to the main .venv. flowgrpo goes into it in
# editable mode without its own pins (pyproject asks for diffusers 0.42 and transformers 5.20,
# which those pins exclude), plus every other dependency of flowgrpo and its OCR extra, which
# all install beside vllm-omni's. About 1.7 GB downloaded, 6.6 GB on disk. Idempotent: a stamp
# file records the install, redone when pyproject.toml changes.
#
#   scripts/vllm/setup.sh                 # the engine's environment
#   scripts/vllm/setup.sh --cpu-test      # plus the CPU scaffolding of tests/vllm (no GPU)
#
# FLOWGRPO_VLLM_VENV overrides the environment's folder.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${FLOWGRPO_VLLM_VENV:-$root/.venv-vllm}"
python="$venv/bin/python"
cpu_test=0
for arg in "$@"; do
    case "$arg" in
        --cpu-test) cpu_test=1 ;;
        *) echo "usage: $0 [--cpu-test]" >&2; exit 2 ;;
    esac
done

# From pyproject: the `vllm` extra (the engine's pins; these if it is absent), and flowgrpo's
# own dependencies plus its OCR extra, less the packages vllm-omni and vllm pin themselves.
read_requirements='
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
if sys.argv[2] == "engine":
    print(" ".join(extras.get("vllm", ["torch==2.13.0", "vllm==0.30.0", "vllm-omni==0.30.0"])))
else:
    pinned = {"torch", "diffusers", "transformers"}
    own = project["dependencies"] + extras.get("ocr", [])
    print(" ".join(r for r in own if re.split(r"[<>=!~\[; ]", r)[0].lower() not in pinned))
'
read -ra engine_requirements <<<"$(python3 -c "$read_requirements" "$root/pyproject.toml" engine)"
read -ra own_requirements <<<"$(python3 -c "$read_requirements" "$root/pyproject.toml" own)"

[ -x "$python" ] || python3 -m venv "$venv"
stamp="$venv/.flowgrpo-vllm-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    echo "installing ${engine_requirements[*]} into $venv (minutes: about 1.7 GB)"
    "$python" -m pip install --quiet "${engine_requirements[@]}"
    # flowgrpo's diffusers / transformers pins are overridden here on purpose: no conflict
    # warnings (its code works with vllm-omni's versions; its test suite passes with them).
    "$python" -m pip install --quiet --no-warn-conflicts --no-deps -e "$root"
    "$python" -m pip install --quiet --no-warn-conflicts "${own_requirements[@]}"
    touch "$stamp"
fi

if [ "$cpu_test" = 1 ]; then
    "$python" "$root/tests/vllm/fix_packages.py"
fi

"$python" -c '
from importlib.metadata import version
names = ("torch", "vllm", "vllm-omni", "diffusers", "transformers", "peft", "flowgrpo")
print("  ".join(f"{name} {version(name)}" for name in names))
'
