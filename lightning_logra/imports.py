"""Objects named in configs by import path, ``"package.module:attribute"``."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(spec: str, kind: str) -> Any:
    """Import ``"package.module:attribute"``; errors name ``kind`` and the spec (``"reward spec
    'x:y': ..."``). The object must be callable."""
    module_name, separator, attribute = spec.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{kind} spec {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"{kind} spec {spec!r}: cannot import module {module_name!r}: {error}") from error
    found = getattr(module, attribute, None)
    if found is None:
        raise AttributeError(f"{kind} spec {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(found):
        raise TypeError(f"{kind} spec {spec!r}: {attribute!r} is not callable")
    return found
