"""The door to libvirt: the only module that imports libvirt-python.

Owns: opening a connection by URI with errors an operator can act on,
looking a domain up by name or UUID, reading its persistent (inactive) and
live XML, defining a new persistent definition, live device attach and
live metadata, and listing every domain's persistent XML (VF reservations).
Every ``libvirtError`` becomes one :class:`~vgpuhost.errors.VgpuhostError`
line.  Must not: decide anything, or be imported by the qemu hook (a hook
must never call back into libvirt: deadlock, docs/reference/libvirt.md).

libvirt prints its errors to stderr by default; :func:`_libvirt` registers
a handler that silences that (vgpuhost reports the error itself).
libvirt-python is imported lazily, so ``vgpuhost render`` and the rest of
the CLI work where it is not installed.
"""

from __future__ import annotations

import os
from typing import List, Optional

from ..model.errors import HostEnvironmentError, InputError, RefusedError, VgpuhostError
from ..model.values import parse_uuid

DEFAULT_URI = "qemu:///system"
ENV_URI = "LIBVIRT_DEFAULT_URI"

_module = None


def default_uri(explicit: Optional[str] = None) -> str:
    """``--connect``, else ``$LIBVIRT_DEFAULT_URI``, else ``qemu:///system`` (as virsh does)."""
    return explicit or os.environ.get(ENV_URI) or DEFAULT_URI


def _libvirt():
    """The libvirt module with a silent error handler; HostEnvironmentError when missing."""
    global _module
    if _module is None:
        try:
            import libvirt  # noqa: PLC0415 - the one place
        except ImportError as e:
            raise HostEnvironmentError(f"libvirt-python is not installed ({e})",
                                       hint="pip install libvirt-python (needs libvirt-dev, pkg-config, gcc)"
                                       ) from None
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        _module = libvirt
    return _module


def _message(e) -> str:
    msg = (e.get_error_message() if hasattr(e, "get_error_message") else None) or str(e)
    return " ".join(msg.split())


def _mapped(e, what: str) -> VgpuhostError:
    """A libvirtError as one vgpuhost error (the class picks the exit code)."""
    lv = _libvirt()
    code = e.get_error_code() if hasattr(e, "get_error_code") else None
    msg = _message(e)
    if code in (lv.VIR_ERR_NO_DOMAIN,):
        return InputError(f"{what}: {msg}", hint="'virsh list --all' lists the domains")
    if code in (lv.VIR_ERR_XML_ERROR, lv.VIR_ERR_CONFIG_UNSUPPORTED, lv.VIR_ERR_XML_DETAIL,
                lv.VIR_ERR_OPERATION_INVALID, lv.VIR_ERR_OPERATION_UNSUPPORTED, lv.VIR_ERR_NO_SUPPORT,
                lv.VIR_ERR_INVALID_ARG):
        return RefusedError(f"{what}: libvirt refused: {msg}", hint="nothing was changed")
    if code in (lv.VIR_ERR_AUTH_FAILED, lv.VIR_ERR_AUTH_CANCELLED, lv.VIR_ERR_ACCESS_DENIED):
        return HostEnvironmentError(f"{what}: {msg}", hint="run as root or as a member of the libvirt group")
    return HostEnvironmentError(f"{what}: {msg}", hint="check the libvirt daemon's log")


class Domain:
    """One libvirt domain.  ``name`` and ``uuid`` are read once."""

    def __init__(self, conn: "Connection", dom):
        self._conn = conn
        self._dom = dom
        self.name: str = dom.name()
        self.uuid: str = dom.UUIDString()

    def _call(self, what: str, fn, *args):
        lv = _libvirt()
        try:
            return fn(*args)
        except lv.libvirtError as e:
            raise _mapped(e, f"{what} {self.name}") from None

    def is_active(self) -> bool:
        return bool(self._call("checking state of", self._dom.isActive))

    def is_persistent(self) -> bool:
        return bool(self._call("checking", self._dom.isPersistent))

    def inactive_xml(self) -> str:
        """The persistent definition (``virsh dumpxml --inactive``)."""
        lv = _libvirt()
        return self._call("reading the definition of", self._dom.XMLDesc, lv.VIR_DOMAIN_XML_INACTIVE)

    def live_xml(self) -> str:
        """The running state when active, else the definition (``virsh dumpxml``)."""
        return self._call("reading", self._dom.XMLDesc, 0)

    def attach_live(self, xml: str, *, what: str = "a device") -> None:
        """Hot-plug one device into the running domain only (the definition is defined separately).

        ``what`` names the device in the error ("hot-plugging WHAT into DOMAIN: ...").
        """
        lv = _libvirt()
        self._call(f"hot-plugging {what} into", self._dom.attachDeviceFlags, xml, lv.VIR_DOMAIN_AFFECT_LIVE)

    def set_live_metadata(self, xml: Optional[str], prefix: str, ns: str) -> None:
        """Replace the running domain's element in namespace ``ns`` (None: remove it)."""
        lv = _libvirt()
        self._call("setting live metadata of", self._dom.setMetadata, lv.VIR_DOMAIN_METADATA_ELEMENT, xml,
                   prefix if xml else None, ns, lv.VIR_DOMAIN_AFFECT_LIVE)

    def metadata(self, ns: str, *, live: bool = False) -> Optional[str]:
        """The element in namespace ``ns`` (libvirt's copy, unprefixed), or None."""
        lv = _libvirt()
        flags = lv.VIR_DOMAIN_AFFECT_LIVE if live else lv.VIR_DOMAIN_AFFECT_CONFIG
        try:
            return self._dom.metadata(lv.VIR_DOMAIN_METADATA_ELEMENT, ns, flags)
        except lv.libvirtError as e:
            if e.get_error_code() == lv.VIR_ERR_NO_DOMAIN_METADATA:
                return None
            raise _mapped(e, f"reading metadata of {self.name}") from None


class Connection:
    """An open libvirt connection; use as a context manager (closes on exit)."""

    def __init__(self, uri: str, conn):
        self.uri = uri
        self._conn = conn

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except _libvirt().libvirtError:      # pragma: no cover - closing a dead connection
                pass
            self._conn = None

    def lookup(self, ref: str) -> Domain:
        """A domain by UUID or name; InputError naming the URI when there is none."""
        lv = _libvirt()
        if not isinstance(ref, str) or not ref.strip() or len(ref) > 256 or not ref.isprintable():
            raise InputError(f"invalid domain name {ref[:64]!r}" if isinstance(ref, str) else "no domain given",
                             hint="give the domain's name or UUID ('virsh list --all')")
        try:
            try:
                uuid = parse_uuid(ref)
            except InputError:
                uuid = None
            if uuid is not None:
                try:
                    return Domain(self, self._conn.lookupByUUIDString(uuid))
                except lv.libvirtError as e:
                    if e.get_error_code() != lv.VIR_ERR_NO_DOMAIN:
                        raise
            return Domain(self, self._conn.lookupByName(ref))
        except lv.libvirtError as e:
            if e.get_error_code() == lv.VIR_ERR_NO_DOMAIN:
                raise InputError(f"no domain {ref!r} on {self.uri}",
                                 hint="'virsh -c URI list --all' lists the domains; --connect picks the URI"
                                 ) from None
            raise _mapped(e, f"looking up domain {ref!r}") from None

    def domains(self) -> List[Domain]:
        """Every domain, running or defined."""
        lv = _libvirt()
        try:
            return [Domain(self, d) for d in self._conn.listAllDomains(0)]
        except lv.libvirtError as e:
            raise _mapped(e, f"listing domains on {self.uri}") from None

    def define(self, xml: str) -> Domain:
        """Define (or redefine) a persistent domain from ``xml`` in one call."""
        lv = _libvirt()
        try:
            return Domain(self, self._conn.defineXML(xml))
        except lv.libvirtError as e:
            raise _mapped(e, "defining the domain") from None


_TEST_FILE_HINT = "test:///PATH names a libvirt node description (XML) file: check the path and the file"


def open_connection(uri: Optional[str] = None) -> Connection:
    """Connect to ``uri`` (default: :func:`default_uri`).

    Raises HostEnvironmentError naming the URI, with a hint, when the
    daemon cannot be reached or refuses; InputError for a malformed URI.
    """
    lv = _libvirt()
    uri = default_uri(uri)
    if len(uri) > 1024 or not uri.isprintable():
        raise InputError(f"invalid libvirt URI {uri[:64]!r}", hint="e.g. qemu:///system or test:///default")
    try:
        conn = lv.open(uri)
    except SystemError:     # the binding's own failure: libvirt's test driver on a file that is not UTF-8
        raise HostEnvironmentError(f"cannot connect to libvirt at {uri}: not a test driver node description",
                                   hint=_TEST_FILE_HINT) from None
    except lv.libvirtError as e:
        test_file = uri.startswith("test:///") and uri != "test:///default"
        if test_file:       # libvirt's message quotes the file it failed to parse: never echo its content
            raise HostEnvironmentError(f"cannot connect to libvirt at {uri}: not a test driver node description",
                                       hint=_TEST_FILE_HINT) from None
        msg = _message(e)
        code = e.get_error_code()
        if code in (lv.VIR_ERR_INVALID_ARG, lv.VIR_ERR_NO_CONNECT) and "://" not in uri:
            raise InputError(f"invalid libvirt URI {uri!r}: {msg}",
                             hint="e.g. qemu:///system, qemu+ssh://host/system or test:///default") from None
        if code in (lv.VIR_ERR_AUTH_FAILED, lv.VIR_ERR_AUTH_CANCELLED, lv.VIR_ERR_ACCESS_DENIED):
            hint = "run as root or as a member of the libvirt group"
        else:
            hint = ("is libvirtd (or virtqemud) running there? pick the URI with --connect or "
                    f"${ENV_URI}")
        raise HostEnvironmentError(f"cannot connect to libvirt at {uri}: {msg}", hint=hint) from None
    if conn is None:                                   # pragma: no cover - old bindings
        raise HostEnvironmentError(f"cannot connect to libvirt at {uri}")
    return Connection(uri, conn)
