"""Operational subcommands: the local Kafka broker and topic creation."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec kafka`` and ``genrec topics``."""
