"""The one exception family of vgpuhost.

Owns: the error types and the exit code each maps to.  Must not: print,
exit, or format tracebacks; the CLI and the hook turn these into one line.

Exit codes (DESIGN.md; the README's table): 0 ok, 1 check found problems /
drift, 2 usage, input or environment error, or a permanent refusal (nothing
changed; retrying cannot help), 3 a device operation failed (rolled back),
4 a bug, 5 a transient condition (nothing changed; the same command can
succeed later: a lock another operation holds, the NVIDIA driver not loaded
yet; the boot units retry it), 130 interrupted (SIGINT, SIGTERM).
"""

from __future__ import annotations

import errno as _errno
import os

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Optional

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_INPUT = 2
EXIT_DEVICE = 3
EXIT_INTERNAL = 4
EXIT_TRANSIENT = 5
EXIT_INTERRUPTED = 130


class VgpuhostError(Exception):
    """Base of every anticipated failure.

    ``message`` says what is wrong, ``hint`` what the operator can do.
    """

    exit_code = EXIT_INPUT
    #: True once an audit row says this refusal (a hook start's refusal gets one row, not two)
    audited = False

    def __init__(self, message: str, *, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        """The error as the single line the CLI and hook print."""
        if self.hint:
            return f"{self.message}; {self.hint}"
        return self.message


class InputError(VgpuhostError):
    """Malformed input from the operator: a BDF, a spec file, a profile name."""


class HostEnvironmentError(VgpuhostError):
    """The host lacks something vgpuhost needs (a root, a library, a module)."""


class TransientError(HostEnvironmentError):
    """Nothing was changed, and the condition can clear by itself (exit 5): another
    operation holds a lock, the NVIDIA driver or vGPU manager is not up yet.  The boot
    units retry exit 5; they do not retry exit 2 (a permanent refusal)."""

    exit_code = EXIT_TRANSIENT


class SysfsError(VgpuhostError):
    """A kernel file under the host root could not be read or written.

    Keeps ``errno`` (int), ``path`` (absolute path under the root) and, for
    writes, the ``value`` written.  Reads map to exit 2, writes to exit 3.
    """

    def __init__(self, op: str, path: str, err: int, *, value: Optional[str] = None,
                 hint: Optional[str] = None):
        self.op = op
        self.path = str(path)
        self.errno = err
        self.value = value
        name = _errno.errorcode.get(err, str(err))
        what = f"{op} {self.path}"
        if value is not None:
            what = f"writing {value!r} to {self.path}"
        elif op == "read":
            what = f"reading {self.path}"
        super().__init__(f"{what} failed: {name} ({os.strerror(err)})", hint=hint)

    @property
    def errno_name(self) -> str:
        return _errno.errorcode.get(self.errno, str(self.errno))

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_DEVICE if self.value is not None else EXIT_INPUT


class RefusedError(VgpuhostError):
    """An operation was refused before anything was touched (group not viable,
    boot VGA, a blocker such as nvidia-persistenced).  Exit 2."""


class DeviceError(VgpuhostError):
    """A device operation failed; state was rolled back where possible."""

    exit_code = EXIT_DEVICE


class GpuFailedError(DeviceError):
    """A device write or read on a GPU failed in a way that means the GPU itself failed (EIO, ENODEV:
    :data:`vgpuhost.policy.health.UNHEALTHY_ERRNOS`); ``gpu`` the GPU's address (text), ``errno`` the errno.
    What was half made was removed again; the GPU is then recorded unhealthy (:mod:`vgpuhost.ops.health`)."""

    def __init__(self, message: str, *, gpu: str, errno: int, hint: Optional[str] = None):
        super().__init__(message, hint=hint)
        self.gpu = gpu
        self.errno = errno


class SimulatorError(VgpuhostError):
    """A simulated host spec or tree is malformed."""
