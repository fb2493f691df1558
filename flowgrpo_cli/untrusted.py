"""JSON from outside (prompt files, metrics logs, reward servers' replies and requests), parsed
so that a hostile text is a clear error, never a traceback.

Python's json module recurses once per nesting level (100,000 `[` are a RecursionError), turns
a number of more than 4300 digits into a ValueError about `sys.set_int_max_str_digits`, and
accepts escaped lone surrogates (`"\\ud800"`), strings that cannot be encoded as UTF-8 again
(writing them to parquet or Arrow fails much later, far from the line that held them).
`loads` checks the nesting before parsing and turns each of these into `BadJSON`, whose
message says what is wrong in a few words; the caller adds where (file and line, URL).
"""

from __future__ import annotations

import json
import re
from typing import Any

DEFAULT_MAX_DEPTH = 64

# A string (its escapes included) or a bracket: what the nesting check looks at.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class BadJSON(ValueError):
    """Why a JSON text was refused, in a few words (no location: the caller knows it);
    `column`: where the parser stopped, for a text that is not JSON."""

    def __init__(self, message: str, column: int | None = None) -> None:
        super().__init__(message)
        self.column = column


def nesting_depth_over(text: str, limit: int) -> bool:
    """Whether arrays and objects in `text` nest deeper than `limit`; stops reading as soon
    as they do."""
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth -= 1
    return False


def loads(text: str | bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """json.loads, with BadJSON for anything it would refuse or fail on.

    Any, as json.loads returns: the value is whatever the text holds, and each caller checks
    the shape it expects."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadJSON(f"not UTF-8 (byte {err.start})") from None
    if nesting_depth_over(text, max_depth):
        raise BadJSON(f"arrays or objects nested deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadJSON(f"not JSON: {err.msg}", column=err.colno) from None
    except RecursionError:  # a limit above what the interpreter's stack allows
        raise BadJSON("arrays or objects nested too deep") from None
    except ValueError as err:  # int() of a number with too many digits
        if "digits" in str(err):
            raise BadJSON("a number with more than 4300 digits") from None
        raise BadJSON(f"not JSON: {err}") from None
    surrogate = find_surrogate(value)
    if surrogate is not None:
        raise BadJSON(
            f"a lone surrogate \\u{ord(surrogate):04x} in a string (not a character; "
            "write the character itself, or both halves of its pair)"
        )
    return value


def find_surrogate(value: object) -> str | None:
    """The first lone surrogate in any string inside `value`, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            match = _SURROGATE.search(item)
            if match is not None:
                return match.group()
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
