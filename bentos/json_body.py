"""What the guard checks of a JSON body before pydantic parses it: a lone UTF-16 surrogate escape.

``"\\ud800"`` is valid JSON syntax but no Unicode text; pydantic's parser refuses the whole body in
its own words, naming no field. The guard finds the string that holds one and names its field.
"""

from __future__ import annotations

import json
import re

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate_field(body: bytes) -> tuple[str, ...] | None:
    """The location (keys and list indices) of the first string or key of ``body`` holding a lone
    surrogate; None when there is none (or the body is not JSON: pydantic says so itself)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _lone_surrogate_location(document, ())


def _lone_surrogate_location(value, location: tuple) -> tuple | None:
    if isinstance(value, str):
        return location if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_lone_surrogate(key):
                return (*location, key.encode("utf-8", "backslashreplace").decode())
            if (found := _lone_surrogate_location(item, (*location, key))) is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _lone_surrogate_location(item, (*location, index))) is not None:
                return found
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
