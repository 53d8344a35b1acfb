"""hook/: libvirt's qemu hook.

Owns: the hook process (runtime: argv, stdin, timeout, signals, exit codes)
and installing its dispatcher (install).  The work is ops/devices.py's.
Must not: call libvirt, import click, lxml, yaml or jinja2 on the hook path,
or print more than one line.
"""
