"""Errors every layer may raise to end a command with a clear message (core services).

The entry point (``genrec.app.cli``) prints a ``UserFacingError`` as one log
line and exits with code 2; anything else is a bug and keeps its traceback.

Example::

    >>> from genrec.infra.errors import UserFacingError
    >>> try:
    ...     raise UserFacingError("give --dataset or --events")
    ... except UserFacingError as exc:
    ...     print(exc)
    give --dataset or --events
"""

from __future__ import annotations


class UserFacingError(Exception):
    """An error whose message is the whole story (bad input, missing prerequisite)."""
