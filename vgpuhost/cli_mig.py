"""`vgpuhost mig ...` commands (click); registered on the main group in cli.py."""

from __future__ import annotations

import click


@click.group(name="mig")
def mig() -> None:
    """(in progress)"""
