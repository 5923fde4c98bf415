"""Which extra of the ``kvferry`` distribution each program needs, and the check.

One distribution ships both roles; each role's libraries are an extra
(``pip install 'kvferry[operator]'``, ``'kvferry[sidecar]'``) so that each image
carries only its own. A program started without its extra would die on an import
deep inside; :func:`missing` lets its entry point say instead which command fixes it.
The requirement lists are read from the installed distribution's metadata, so
pyproject.toml stays their only source.
"""

from __future__ import annotations

import importlib.metadata as md
import re

DISTRIBUTION = "kvferry"
OPERATOR = "operator"
SIDECAR = "sidecar"

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([\w.-]+)["']""")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirements(extra: str, dist: str = DISTRIBUTION) -> list[str]:
    """Names of the distributions ``extra`` adds; [] when ``dist`` is not installed
    (running from a source tree: nothing to check against)."""
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return []
    out = []
    for req in reqs:
        marker = _EXTRA_MARKER.search(req)
        name = _NAME.match(req)
        if marker and marker.group(1) == extra and name:
            out.append(name.group(1))
    return out


def missing(extra: str, dist: str = DISTRIBUTION) -> list[str]:
    """The distributions of ``extra`` that are not installed."""
    out = []
    for name in requirements(extra, dist):
        try:
            md.version(name)
        except md.PackageNotFoundError:
            out.append(name)
    return out


def message(extra: str, absent: list[str]) -> str:
    return (
        f"this command needs the '{extra}' extra of {DISTRIBUTION} ({', '.join(absent)} "
        f"not installed): pip install '{DISTRIBUTION}[{extra}]'"
    )
