"""`python -m flowgrpo_cli` runs the CLI (also how distributed launchers start ranks)."""

from flowgrpo_cli.cli import main

main()
