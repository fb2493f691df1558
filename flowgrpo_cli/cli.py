"""The `flowgrpo` command line: parse, resolve the run's config, call a stage, render.

Kept thin and light: heavy libraries (torch, diffusers, pyarrow) are imported inside the
commands, so `flowgrpo --help` answers at once. A FlowGrpoError becomes a one-line message
and exit code 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from flowgrpo_cli.errors import FlowGrpoError

app = typer.Typer(
    name="flowgrpo",
    help="Flow-GRPO reinforcement learning for flow-matching text-to-image models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Run config (TOML); default: the run's own config.toml, else built-in defaults.",
    ),
]
RunOpt = Annotated[
    Path | None, typer.Option("--run", "-r", help="Run directory (overrides run.dir).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a config key: --set sampler.noise_level=0.8 (repeatable)."
    ),
]
AllowChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-config-change", help="Replace the run's stored config when this one differs."
    ),
]


def user_errors(fn: F) -> F:
    """Turn FlowGrpoError into a clean message and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FlowGrpoError as err:
            err_console.print(
                f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@user_errors
def prepare(
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    allow_config_change: AllowChangeOpt = False,
    train: Annotated[Path | None, typer.Option(help="Training prompts (sets data.train).")] = None,
    test: Annotated[Path | None, typer.Option(help="Test prompts (sets data.test).")] = None,
    test_fraction: Annotated[
        float | None,
        typer.Option(help="Share held out when no test file is given (sets data.test_fraction)."),
    ] = None,
    negative_prompt: Annotated[
        str | None,
        typer.Option(help="Negative prompt for rows lacking one (sets data.negative_prompt)."),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help="System prompt, Qwen-Image (sets data.system_prompt).")
    ] = None,
    skip_invalid: Annotated[
        bool, typer.Option("--skip-invalid", help="Skip invalid rows and report how many.")
    ] = False,
) -> None:
    """Prompt files (txt / jsonl / csv / parquet) -> RUN/data/{train,test}.parquet."""
    from flowgrpo_cli.render import render_prepare_summary
    from flowgrpo_cli.runconfig import resolve_run
    from flowgrpo_cli.rundir import RunLock
    from flowgrpo_cli.stages import prepare as stage

    options = {
        "data.train": train,
        "data.test": test,
        "data.test_fraction": test_fraction,
        "data.negative_prompt": negative_prompt,
        "data.system_prompt": system_prompt,
        "data.skip_invalid": True if skip_invalid else None,
    }
    overrides = [*(set_ or []), *_as_overrides(options)]
    resolved = resolve_run(config, overrides, run, allow_change=allow_config_change)
    with RunLock(resolved.run.root):
        manifest = stage.run(resolved.config, resolved.run)
    render_prepare_summary(console, resolved.run, manifest)


@app.command("config")
@user_errors
def show_config(
    config: ConfigOpt = None,
    run: RunOpt = None,
    set_: SetOpt = None,
    reference: Annotated[
        bool, typer.Option("--reference", help="List every key with its default and meaning.")
    ] = False,
) -> None:
    """Print the resolved config (validated), or the reference of every key."""
    from flowgrpo_cli.config import dumps_config, iter_reference
    from flowgrpo_cli.runconfig import resolve_run

    if reference:
        for key, default, meaning in iter_reference():
            console.print(f"[bold]{key}[/] = {default}\n    {meaning}", highlight=False)
        return
    resolved = resolve_run(config, set_ or [], run, write=False)
    console.print(dumps_config(resolved.config), highlight=False, markup=False)


def _as_overrides(options: dict[str, Any]) -> list[str]:
    """Dedicated CLI options become `--set` overrides, quoted as TOML values."""
    import json

    out = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        out.append(f"{key}={text}")
    return out


def main() -> None:
    app()
