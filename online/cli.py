"""Subcommands of the online step."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add this step's subcommands to ``genrec``."""
