"""Import an object named `module:attribute`, with errors a user can act on."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from types import ModuleType

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import describe_exception

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_SPEC = re.compile(rf"(?P<module>{_DOTTED}):(?P<attribute>{_DOTTED})")


def add_plugin_dirs(folders: list[str]) -> None:
    """Search `folders` first for plugin modules, in this process and in the processes it
    starts (OCR or plugin workers), as PYTHONPATH would."""
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*folders, *(p for p in inherited if p not in folders)]
    )


def import_object(spec: str, what: str) -> object:
    """The object `spec` names; `what` starts every error message (e.g. `reward "x:y"`)."""
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise FlowGrpoError(f"{what}: expected `module:function`, e.g. `mypkg.rewards:score`")
    module_name, attribute = match["module"], match["attribute"]
    module = _import_module(module_name, what)
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise FlowGrpoError(
                f"{what}: module {module_name!r} ({module.__file__}) has no attribute "
                f"{attribute!r}; its functions: {', '.join(_functions(module)) or 'none'}"
            )
        target = getattr(target, part)
    return target


def _import_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        # The plugin's own module (or a package above it) is missing, rather than
        # something the plugin imports.
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise FlowGrpoError(
                f"{what}: no module named {err.name!r} (is it installed, or is its folder "
                "on PYTHONPATH?)"
            ) from None
        raise FlowGrpoError(f"{what}: importing {name!r} failed: {err}") from err
    except SystemExit as err:  # would end the command without a word
        raise FlowGrpoError(f"{what}: importing {name!r} called sys.exit({err.code!r})") from None
    except Exception as err:
        raise FlowGrpoError(
            f"{what}: importing {name!r} failed: {describe_exception(err)}"
        ) from err


def _functions(module: ModuleType) -> list[str]:
    return sorted(
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and not name.startswith("_")
    )
