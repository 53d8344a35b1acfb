"""`vgpuhost` commands: hook install, uninstall and status (libvirt's qemu hook).

Registered on the main group by cli.py: every click command in
``COMMANDS`` becomes a top-level command.
"""

from __future__ import annotations

from typing import List

import click

COMMANDS: List[click.Command] = []
