"""Value types parsed once: PCI addresses, vGPU profile names, MIG profiles.

Owns: parsing and printing the identifiers of the field.  Frozen
dataclasses with ``parse()`` and ``__str__``; parsing raises
:class:`InputError` with a hint.  Must not: touch files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional

from .errors import InputError

_BDF_RE = re.compile(
    r"^(?P<domain>[0-9a-fA-F]{4}):(?P<bus>[0-9a-fA-F]{2}):(?P<slot>[0-9a-fA-F]{2})\.(?P<func>[0-7])$")


@dataclass(frozen=True, order=True)
class PciAddress:
    """A PCI address (BDF) ``dddd:bb:ss.f`` (REFERENCE.md §1), e.g. ``0000:41:00.0``.

    Only the full form with the domain is accepted: sysfs names devices that
    way, and a short ``41:00.0`` is refused so no device is guessed.
    """

    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> "PciAddress":
        """Parse ``dddd:bb:ss.f``; raises InputError naming the bad value."""
        m = _BDF_RE.match(text.strip()) if isinstance(text, str) else None
        if not m:
            hint = "expected the full form dddd:bb:ss.f, e.g. 0000:41:00.0"
            if isinstance(text, str) and re.match(r"^[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$", text.strip()):
                hint += f" (did you mean 0000:{text.strip().lower()}?)"
            shown = text if not isinstance(text, str) or len(text) <= 64 else text[:64] + "..."
            raise InputError(f"invalid PCI address {shown!r}", hint=hint)
        return cls(int(m["domain"], 16), int(m["bus"], 16), int(m["slot"], 16), int(m["func"], 16))

    @classmethod
    def is_valid(cls, text: str) -> bool:
        return bool(_BDF_RE.match(text))

    @property
    def devfn(self) -> int:
        return (self.slot << 3) | self.function

    def with_devfn(self, devfn: int) -> "PciAddress":
        """The address on the same bus with another devfn (SR-IOV VF layout)."""
        if not 0 <= devfn <= 0xFF:
            raise InputError(f"devfn {devfn:#x} out of range on bus {self.bus:02x}")
        return PciAddress(self.domain, self.bus, devfn >> 3, devfn & 7)

    @property
    def slot_address(self) -> str:
        """``dddd:bb:ss`` (all functions of one slot)."""
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}"

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"


_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def parse_uuid(text: str) -> str:
    """A lower-case 8-4-4-4-12 UUID (the form mdev ``create`` takes, REFERENCE.md §2).

    Checked with a regular expression, not :mod:`uuid` (whose import costs
    the qemu hook milliseconds); upper-case hex is accepted and lowered.
    """
    t = text.strip().lower() if isinstance(text, str) else None
    if t is None or not _UUID_RE.match(t):
        raise InputError(f"invalid UUID {text!r}",
                         hint="expected 8-4-4-4-12 hex digits with dashes, e.g. 2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a")
    return t


# ---------------------------------------------------------------------------
# vGPU type names (REFERENCE.md §4)

SERIES = {
    "Q": "virtual workstation (vWS)",
    "B": "virtual desktop (vPC)",
    "A": "virtual application (vApps)",
    "C": "compute (vCS / AI Enterprise)",
}

_PROFILE_RE = re.compile(
    r"^(?:(?:GRID|NVIDIA)\s+)?"
    r"(?P<board>[A-Za-z0-9_]+?)-"
    r"(?:(?P<slices>\d+)-)?"
    r"(?P<fb>\d+)(?P<series>[QBACqbac])(?P<me>ME|me)?$")


@dataclass(frozen=True)
class VgpuProfile:
    """A vGPU type name parsed: ``A40-8Q``, ``A100-1-5CME``, ``H200X-1-18C``.

    ``framebuffer_gb`` is in GB as the name spells it; ``gi_slices`` is the
    GPU-instance slice count of a MIG-backed type (None when time-sliced);
    ``media_extensions`` is the ``ME`` suffix.  ``vendor_prefix`` keeps
    ``GRID``/``NVIDIA`` from the raw sysfs/NVML name.
    """

    board: str
    framebuffer_gb: int
    series: str
    gi_slices: Optional[int] = None
    media_extensions: bool = False

    @classmethod
    def parse(cls, text: str) -> "VgpuProfile":
        """Parse a name; raises InputError when it is not a vGPU type name."""
        p = cls.try_parse(text)
        if p is None:
            raise InputError(f"invalid vGPU profile name {text!r}",
                             hint="expected <board>-<GB><Q|B|A|C> or <board>-<slices>-<GB>C[ME], "
                                  "e.g. A40-8Q or A100-1-5C; 'vgpuhost types' lists them")
        return p

    @classmethod
    def try_parse(cls, text: str) -> Optional["VgpuProfile"]:
        m = _PROFILE_RE.match(text.strip()) if isinstance(text, str) else None
        if not m:
            return None
        slices = int(m["slices"]) if m["slices"] else None
        me = bool(m["me"])
        series = m["series"].upper()
        if (slices is not None or me) and series != "C":
            return None
        return cls(m["board"].upper(), int(m["fb"]), series, slices, me)

    @property
    def mig_backed(self) -> bool:
        return self.gi_slices is not None

    def __str__(self) -> str:
        mid = f"{self.gi_slices}-" if self.gi_slices is not None else ""
        return f"{self.board}-{mid}{self.framebuffer_gb}{self.series}{'ME' if self.media_extensions else ''}"


def strip_vendor_prefix(name: str) -> str:
    """``GRID A100-4C`` / ``NVIDIA A40-8Q`` -> ``A100-4C`` / ``A40-8Q``."""
    for prefix in ("GRID ", "NVIDIA "):
        if name.startswith(prefix):
            return name[len(prefix):].strip()
    return name.strip()


def parse_description(text: str) -> Dict[str, str]:
    """An mdev type ``description`` as key=value pairs (REFERENCE.md §2).

    ``num_heads=4, frl_config=60, framebuffer=2048M`` ->
    ``{'num_heads': '4', 'frl_config': '60', 'framebuffer': '2048M'}``.
    Items without ``=`` are ignored.
    """
    out: Dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_size_mib(text: str) -> Optional[int]:
    """``2048M`` -> 2048, ``4G`` -> 4096, ``1024`` -> 1024 (MiB); None if unparsable."""
    m = re.match(r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$", text or "", re.IGNORECASE)
    if not m:
        return None
    n = int(m[1])
    unit = m[2].upper()
    return {"K": n // 1024, "": n, "M": n, "G": n * 1024, "T": n * 1024 * 1024}[unit]


_MIG_RE = re.compile(r"^(?:(?P<ci>\d+)c\.)?(?P<g>\d+)g\.(?P<mem>\d+)gb(?P<me>\+me)?$", re.IGNORECASE)


@dataclass(frozen=True)
class MigProfile:
    """A MIG GPU-instance profile name (REFERENCE.md §5): ``3g.40gb``, ``1g.10gb+me``."""

    slices: int
    memory_gb: int
    media_extensions: bool = False

    @classmethod
    def parse(cls, text: str) -> "MigProfile":
        m = _MIG_RE.match(text.strip()) if isinstance(text, str) else None
        if not m or m["ci"]:
            raise InputError(f"invalid MIG profile name {text!r}",
                             hint="expected <N>g.<GB>gb[+me], e.g. 1g.10gb or 3g.40gb")
        return cls(int(m["g"]), int(m["mem"]), bool(m["me"]))

    def __str__(self) -> str:
        return f"{self.slices}g.{self.memory_gb}gb{'+me' if self.media_extensions else ''}"
