"""Make .venv-vllm run vllm-omni on a CPU-only machine, for tests/vllm. Idempotent.

Run with the environment's own python: `.venv-vllm/bin/python tests/vllm/fix_packages.py`.
`just test-vllm` runs it. Nothing here is needed, or wanted, on a GPU machine.

1. vllm 0.30 pulls CUDA builds of torchaudio 2.11 and torchcodec 0.17, which do not load
   beside CPU torch 2.13; vllm and vllm-omni's image path run without them: uninstall both.
2. Its torchvision 0.28 is a CUDA build too: its C++ ops fail to load (they link
   libtorch_cuda), and `import torchvision` then dies registering a fake kernel for
   `torchvision::nms`, an op that does not exist. vllm-omni's Qwen2-VL import path needs
   torchvision, whose Python parts work; patch those two registrations to be skipped when
   the ops are absent (torchvision's own `register_meta` already checks that).
3. Install the test-only CPU platform plugin (tests/vllm/cpu_plugin), which registers itself
   under vllm-omni's `vllm_omni.platform_plugins` entry point and is inert unless
   FLOWGRPO_VLLM_CPU_PLATFORM=1.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "# flowgrpo tests/vllm: skipped when the ops are absent"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def remove_cuda_audio_packages() -> None:
    present = [name for name in ("torchaudio", "torchcodec") if installed(name)]
    if present:
        pip("uninstall", "--yes", "--quiet", *present)
        print(f"removed {', '.join(present)} (CUDA builds that do not load beside CPU torch)")


def patch_torchvision() -> None:
    path = Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
    if not path.is_file():
        return
    text = path.read_text()
    if MARKER in text:
        return
    pattern = re.compile(r'^@torch\.library\.register_fake\("(torchvision::q?nms)"\)$', re.M)
    patched, count = pattern.subn(
        r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() '
        r"else (lambda fn: fn))  " + MARKER,
        text,
    )
    if count == 0:
        print(f"{path}: no torchvision::nms registration found; left as is")
        return
    path.write_text(patched)
    print(f"patched {path}: {count} fake registrations skipped without torchvision's ops")


def install_plugin() -> None:
    pip("install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(HERE / "cpu_plugin"))
    print("installed the test CPU platform plugin for vllm-omni (tests/vllm/cpu_plugin)")


def main() -> None:
    remove_cuda_audio_packages()
    patch_torchvision()
    install_plugin()
    if not installed("pytest"):
        pip("install", "--quiet", "pytest>=8")


if __name__ == "__main__":
    main()
