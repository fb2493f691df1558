"""The command line stays light: help must not import the heavy libraries."""

import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "pyarrow", "pandas", "peft")


def test_help_imports_no_heavy_library():
    code = (
        "import sys\n"
        "from flowgrpo_cli.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('heavy:', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "heavy: []"


def test_console_script_answers_help():
    out = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "prepare", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--skip-invalid" in out.stdout
