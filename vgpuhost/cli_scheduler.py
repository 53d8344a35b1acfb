"""`vgpuhost scheduler ...` commands (click); registered on the main group in cli.py."""

from __future__ import annotations

import click


@click.group(name="scheduler")
def scheduler() -> None:
    """(in progress)"""
