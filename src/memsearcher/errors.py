"""Errors the user can act on. The CLI prints their message, without a traceback."""

from __future__ import annotations


class MemSearcherError(Exception):
    """Base class: bad input, a missing file, an unreachable server, a wrong setting."""
