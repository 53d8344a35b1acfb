"""Value types parsed once: PCI addresses, vGPU profile names, MIG profiles.

Owns: parsing and printing the identifiers of the field — frozen records
with ``parse()`` and ``__str__``; parsing raises :class:`InputError` with a
hint — and :func:`record`, the light stand-in for ``@dataclass`` that the
modules on the qemu hook's path use.  Must not: touch files.
"""

from __future__ import annotations

from _operator import attrgetter     # the C module itself: operator.py adds 0.2 ms to each hook start

from .errors import InputError

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only: importing typing costs the qemu hook milliseconds
    from typing import Dict, Optional


# ---------------------------------------------------------------------------
# records: dataclass semantics without the import-time cost

class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


class Field:
    """A field's default, as ``dataclasses.field(default=..., default_factory=...)`` gives it."""

    __slots__ = ("default", "default_factory")

    def __init__(self, default=MISSING, default_factory=MISSING):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.default, self.default_factory = default, default_factory


def field(*, default=MISSING, default_factory=MISSING) -> Field:
    """Like :func:`dataclasses.field` (``default`` / ``default_factory`` only), for :func:`record` classes."""
    return Field(default, default_factory)


class _DataclassFields:
    """A record class's ``__dataclass_fields__``, built on first use: :func:`dataclasses.replace`,
    ``asdict``, ``fields`` and ``is_dataclass`` then work on records (and only they import dataclasses)."""

    def __get__(self, obj, owner):
        import dataclasses
        ns: dict = {"__annotations__": {}}
        for name, (default, factory) in owner.__record_fields__.items():
            ns["__annotations__"][name] = "object"
            if factory is not MISSING:
                ns[name] = dataclasses.field(default_factory=factory)
            elif default is not MISSING:
                ns[name] = dataclasses.field(default=default)
        fields = dataclasses.dataclass(type(owner.__name__, (), ns)).__dataclass_fields__
        type.__setattr__(owner, "__dataclass_fields__", fields)
        return fields


def replace(obj, **changes):
    """A copy of record ``obj`` with ``changes`` (field name -> value), as :func:`dataclasses.replace`."""
    values = {n: getattr(obj, n) for n in obj.__record_fields__}
    unknown = set(changes) - set(values)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values.update(changes)
    return obj.__class__(**values)


def _frozen_error(name: str) -> Exception:
    from dataclasses import FrozenInstanceError
    return FrozenInstanceError(f"cannot assign to field {name!r}")


def record(cls=None, *, frozen: bool = False, order: bool = False):
    """Class decorator: what ``@dataclass(frozen=..., order=...)`` makes, without importing :mod:`dataclasses`.

    Generates ``__init__`` (fields in declaration order, plain defaults and
    :func:`field` defaults / default factories), ``__repr__``
    (``Name(a=1, b='x')``), ``__eq__`` (same class, field by field),
    ``__hash__`` (frozen: of the fields; otherwise unhashable), with
    ``order`` the comparisons, and with ``frozen`` assignment and deletion
    raising :class:`dataclasses.FrozenInstanceError`.  Methods the class
    defines itself are kept; fields of record base classes come first.
    Instances keep a ``__dict__`` in field order.  :func:`dataclasses.replace`,
    ``asdict``, ``fields`` and ``is_dataclass`` accept records.  Raises
    TypeError for ``ClassVar`` / ``InitVar`` fields (not supported) and for a
    field without a default after one with a default.  ``__init__`` is
    compiled when the first instance is made (until then its signature reads
    ``(*args, **kwargs)``), so a process pays only for the records it uses.

    Why: ``import dataclasses`` pulls in :mod:`inspect`, and each
    ``@dataclass`` compiles its methods one by one; the qemu hook (a new
    process per domain start and stop) paid tens of milliseconds for that.
    """
    def wrap(c):
        return _make_record(c, frozen, order)
    return wrap if cls is None else wrap(cls)


class _NoFields:
    """The comparison key of a record without fields (``attrgetter`` needs a name)."""

    __slots__ = ()

    def __call__(self, obj) -> tuple:
        return ()


def _key_of(names: tuple):
    """What a record compares and hashes, as ``@dataclass`` compares: a tuple of its fields (a C
    callable, not a descriptor, so it is stored on the class as it is).  One field: ``attrgetter(n, n)``,
    a pair of the same value, which compares and hashes consistently and as a 1-tuple would
    (``attrgetter(n)`` gives the bare value, which compares otherwise for NaN)."""
    if not names:
        return _NoFields()
    return attrgetter(*names) if len(names) > 1 else attrgetter(names[0], names[0])


# The methods every record shares (they read the class's ``__record_names__`` / ``__record_key__``):
# defined once rather than as closures per class, which made each record class cost about 20 us
# more to create, paid by every qemu hook process for some 40 classes (measured 2026-12-01).

def _record_repr(self) -> str:
    return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__record_names__)})"


def _record_eq(self, other):
    if other is self:       # the same record (a parsed PciAddress is shared: PciAddress.parse): equal, no key built
        return True
    if other.__class__ is self.__class__:
        key = self.__record_key__
        return key(self) == key(other)
    return NotImplemented


def _record_lt(self, other):
    return self.__record_key__(self) < other.__record_key__(other) if other.__class__ is self.__class__ \
        else NotImplemented


def _record_le(self, other):
    return self.__record_key__(self) <= other.__record_key__(other) if other.__class__ is self.__class__ \
        else NotImplemented


def _record_gt(self, other):
    return self.__record_key__(self) > other.__record_key__(other) if other.__class__ is self.__class__ \
        else NotImplemented


def _record_ge(self, other):
    return self.__record_key__(self) >= other.__record_key__(other) if other.__class__ is self.__class__ \
        else NotImplemented


def _record_hash(self) -> int:
    return hash(self.__record_key__(self))


def _record_frozen_setattr(self, name, value):
    raise _frozen_error(name)


def _record_frozen_delattr(self, name):
    raise _frozen_error(name)


_SHARED = {"__repr__": _record_repr, "__eq__": _record_eq}
_FROZEN = {"__setattr__": _record_frozen_setattr, "__delattr__": _record_frozen_delattr}
_ORDER = {"__lt__": _record_lt, "__le__": _record_le, "__gt__": _record_gt, "__ge__": _record_ge}


def _make_record(cls, frozen: bool, order: bool):
    fields: dict = {}
    for base in reversed(cls.__mro__[1:]):
        fields.update(base.__dict__.get("__record_fields__", {}))
    for name, ann in cls.__dict__.get("__annotations__", {}).items():
        if "ClassVar" in str(ann) or "InitVar" in str(ann):
            raise TypeError(f"{cls.__name__}.{name}: record() does not support ClassVar or InitVar fields")
        value = cls.__dict__.get(name, MISSING)
        factory = MISSING
        if isinstance(value, Field):
            value, factory = value.default, value.default_factory
            if factory is not MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
        fields.pop(name, None)
        fields[name] = (value, factory)
    names = tuple(fields)
    defaulted = False
    for n in names:
        if fields[n] != (MISSING, MISSING):
            defaulted = True
        elif defaulted:
            raise TypeError(f"{cls.__name__}: non-default argument {n!r} follows default argument")
    own = cls.__dict__
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    setattr_ = type.__setattr__
    setattr_(cls, "__record_names__", names)
    setattr_(cls, "__record_key__", _key_of(names))
    if "__init__" not in own:
        setattr_(cls, "__init__", _interpreted_init(cls, fields))
    methods = _SHARED if not (frozen or order) else {**_SHARED, **(_FROZEN if frozen else {}),
                                                     **(_ORDER if order else {})}
    for name, fn in methods.items():
        if name not in own:
            setattr_(cls, name, fn)
    if not explicit_hash:
        setattr_(cls, "__hash__", _record_hash if frozen else None)
    setattr_(cls, "__record_fields__", fields)
    setattr_(cls, "__match_args__", names)
    setattr_(cls, "__dataclass_fields__", _DataclassFields())
    return cls


#: instances a record class makes with the interpreted ``__init__`` before it compiles its own
COMPILE_AFTER = 128


def _interpreted_init(cls, fields: dict):
    """A record's first ``__init__``: stores the fields by looping over them, and compiles the
    class's real ``__init__`` (:func:`_compile_init`, which then replaces it) only once the class
    has made :data:`COMPILE_AFTER` instances, or at once for a call it cannot bind (which the real
    one then refuses with Python's own message).

    Why: compiling costs about 180 us a class (measured 2026-12-01), and a qemu hook process makes
    a handful of instances each of some 20 record classes; a long-running process compiles the
    classes it uses often.
    """
    names = tuple(fields)
    n = len(names)
    spec = tuple((name, default, factory) for name, (default, factory) in fields.items())
    made = [0]

    def compiled(self, args, kwargs):
        real = _compile_init(cls, fields)
        type.__setattr__(cls, "__init__", real)
        real(self, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        made[0] += 1
        if made[0] > COMPILE_AFTER or len(args) > n:
            return compiled(self, args, kwargs)
        d = self.__dict__
        used = 0
        i = len(args)
        for k, (name, default, factory) in enumerate(spec):
            if k < i:
                if kwargs and name in kwargs:
                    return compiled(self, args, kwargs)      # given twice
                d[name] = args[k]
            elif kwargs and name in kwargs:
                d[name] = kwargs[name]
                used += 1
            elif factory is not MISSING:
                d[name] = factory()
            elif default is not MISSING:
                d[name] = default
            else:
                return compiled(self, args, kwargs)          # missing
        if used != (len(kwargs) if kwargs else 0):
            return compiled(self, args, kwargs)              # an unknown keyword
    return __init__


def _compile_init(cls, fields: dict):
    """``__init__(self, a, b=<default>, c=<factory>)`` storing each field in ``self.__dict__``, in order."""
    env: dict = {"MISSING": MISSING}
    params, body = [], ["    __fields = self.__dict__"]      # not a field's name (a field may be called d)
    for n, (default, factory) in fields.items():
        if factory is not MISSING:
            env[f"_f_{n}"] = factory
            params.append(f"{n}=MISSING")
            body.append(f"    __fields[{n!r}] = _f_{n}() if {n} is MISSING else {n}")
            continue
        if default is not MISSING:
            env[f"_d_{n}"] = default
            params.append(f"{n}=_d_{n}")
        else:
            params.append(n)
        body.append(f"    __fields[{n!r}] = {n}")
    exec("\n".join([f"def __init__(self, {', '.join(params)}):"] + body), env)    # noqa: S102 - field names only
    fn = env["__init__"]
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    return fn


# ---------------------------------------------------------------------------
# Hand-written parsers, not regular expressions: the qemu hook parses PCI
# addresses, UUIDs and vGPU type names in a new process on every domain start
# and stop, and ``import re`` (with enum, functools, collections) was about
# 2 ms of that start (``python -X importtime``, measured 2026-12-01).  Each
# accepts exactly what the pattern in its comment accepts (tests/test_lean_parsers.py
# checks them against it).

_HEX = frozenset("0123456789abcdefABCDEF")


def _hex_run(text: str, start: int, n: int) -> bool:
    return all(c in _HEX for c in text[start:start + n])


def _bdf_fields(text: str):
    r"""``(domain, bus, slot, function)`` of ``dddd:bb:ss.f``, else None.

    Pattern: ``^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$`` (``$``: a final newline allowed).
    The domain is 4 to 8 hex digits: the kernel names a device ``"%04x:%02x:%02x.%d"`` with the
    domain an ``int``, so a domain that a host bridge driver allocates past 0xffff (Intel VMD's
    start at 0x10000) prints as 5 or more digits (docs/reference/hardware.md#pci-and-iommu).
    """
    if text.endswith("\n"):
        text = text[:-1]
    d = len(text) - 8           # the domain's digits: the rest is ":bb:ss.f"
    if (not 4 <= d <= 8 or text[d] != ":" or text[d + 3] != ":" or text[d + 6] != "." or text[d + 7] not in "01234567"
            or not (_hex_run(text, 0, d) and _hex_run(text, d + 1, 2) and _hex_run(text, d + 4, 2))):
        return None
    return int(text[0:d], 16), int(text[d + 1:d + 3], 16), int(text[d + 4:d + 6], 16), int(text[d + 7])


def _is_short_bdf(text: str) -> bool:
    r"""``bb:ss.f`` without the domain (``^[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$``)."""
    if text.endswith("\n"):
        text = text[:-1]
    return (len(text) == 7 and text[2] == ":" and text[5] == "." and text[6] in "01234567"
            and _hex_run(text, 0, 2) and _hex_run(text, 3, 2))


@record(frozen=True, order=True)
class PciAddress:
    """A PCI address (BDF) ``dddd:bb:ss.f`` (docs/reference/hardware.md#pci-and-iommu), e.g. ``0000:41:00.0``.

    Only the full form with the domain is accepted: sysfs names devices that
    way, and a short ``41:00.0`` is refused so no device is guessed.  The
    domain has 4 to 8 hex digits, as the kernel prints it: ``10000:01:00.0``
    is a device behind Intel VMD (docs/reference/hardware.md#intel-vmd).
    """

    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> "PciAddress":
        """Parse ``dddd:bb:ss.f``; raises InputError naming the bad value.

        The value of a text parsed before is the same (frozen) record, shared: a discovery parses
        each device's address many times (links, group members), and equal records that are one
        object compare without building their keys (measured 2026-12-07, an L40S host's agent)."""
        shared = cls is PciAddress and type(text) is str
        if shared:
            hit = _PARSED.get(text)
            if hit is not None:
                return hit
        f = _bdf_fields(text.strip()) if isinstance(text, str) else None
        if f is None:
            hint = "expected the full form dddd:bb:ss.f, e.g. 0000:41:00.0"
            if isinstance(text, str) and _is_short_bdf(text.strip()):
                hint += f" (did you mean 0000:{text.strip().lower()}?)"
            shown = clipped(text)
            raise InputError(f"invalid PCI address {shown!r}", hint=hint)
        got = cls(*f)
        if shared and text == text.strip():        # only a bare address: is_valid's memo too (it strips nothing)
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[text] = got
        return got

    @classmethod
    def is_valid(cls, text: str) -> bool:
        if not isinstance(text, str):
            raise TypeError(f"expected a string, got {type(text).__name__}")   # as re.match does
        return text in _PARSED or _bdf_fields(text) is not None

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

    def __hash__(self) -> int:
        # the record's hash (that of its fields' tuple), kept once made: addresses key most of a discovery's
        # indexes, and the generic record hash builds the tuple on every lookup
        d = self.__dict__
        h = d.get("_hash")
        if h is None:
            h = d["_hash"] = hash((self.domain, self.bus, self.slot, self.function))
        return h

    def __str__(self) -> str:
        # kept once made (not a field: no part of equality, hash, repr or the record's fields); an address
        # is formatted again and again (the path of each of its files, a key of every document row)
        d = self.__dict__
        text = d.get("_text")
        if text is None:
            text = d["_text"] = f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"
        return text


#: text -> the PciAddress :meth:`PciAddress.parse` made of it (bounded: cleared when full)
_PARSED: dict = {}
_PARSED_MAX = 8192


_LOWER_HEX = frozenset("0123456789abcdef")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


_DIGITS = frozenset("0123456789")


def is_digits(text: object) -> bool:
    """``text`` is one or more ASCII digits ``0-9``, nothing else.  ``str.isdigit`` also takes ``²``
    (which ``int`` refuses: a crash) and ``str.isdecimal`` takes ``٣`` (which ``int`` reads as 3): input
    parsed as a number checks this first."""
    return isinstance(text, str) and text != "" and all(c in _DIGITS for c in text)


def json_flag(key: str, value: object) -> bool:
    """A JSON body's boolean ``key``: ``true`` or ``false`` only (agent/openapi.yaml types them
    ``boolean``).  A string is refused, not read: ``"false"`` taken as true, or ``"no"`` taken as
    false by a client that meant something else, would turn a dry run into a real change.
    Raises InputError naming the key."""
    if isinstance(value, bool):
        return value
    raise InputError(f"{key!r} must be true or false (a JSON boolean, not a string or a number)")


def json_text(body: "Optional[Dict[str, object]]", key: str, limit: int, required: bool = False) -> Optional[str]:
    """A JSON body's string ``key`` of at most ``limit`` characters; None when absent (InputError when
    ``required``).  Raises InputError naming the key for any other type."""
    value = (body or {}).get(key)
    if value is None:
        if required:
            raise InputError(f"the request needs {key!r}", hint="see the API document (GET /v1/openapi)")
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise InputError(f"{key!r} must be a string of at most {limit} characters")
    return value


def json_small_int(body: "Optional[Dict[str, object]]", key: str) -> Optional[int]:
    """A JSON body's whole number ``key`` from 0 to 1023 (a NUMA node, a slot); None when absent.
    ``true`` is no number here.  Raises InputError naming the key."""
    value = (body or {}).get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1023:
        raise InputError(f"{key!r} must be a whole number from 0 to 1023")
    return value


def is_name(value: object, extra: frozenset, limit: int = 64) -> bool:
    r"""``value`` is a string of 1 to ``limit`` characters, the first an ASCII letter or digit, the
    others ASCII letters, digits or in ``extra``: ``^[A-Za-z0-9][A-Za-z0-9<extra>]{0,limit-1}\Z``
    checked by hand (tenant names, anti-affinity keys, vGPU type names; see :func:`_bdf_fields`)."""
    return (isinstance(value, str) and 0 < len(value) <= limit and value[0] in _ALNUM
            and all(c in _ALNUM or c in extra for c in value))


def _is_lower_uuid(t: str) -> bool:
    """``^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`` (``$``: a final newline allowed)."""
    if t.endswith("\n"):
        t = t[:-1]
    return (len(t) == 36 and t[8] == t[13] == t[18] == t[23] == "-"
            and all(c in _LOWER_HEX for c in t[:8] + t[9:13] + t[14:18] + t[19:23] + t[24:]))


def parse_uuid(text: str) -> str:
    """A lower-case 8-4-4-4-12 UUID (the form mdev ``create`` takes, docs/reference/hardware.md#mdev).

    Checked by hand, not with :mod:`uuid` or :mod:`re` (whose imports cost
    the qemu hook milliseconds); upper-case hex is accepted and lowered.
    """
    t = text.strip().lower() if isinstance(text, str) else None
    if t is None or not _is_lower_uuid(t):
        raise InputError(f"invalid UUID {text!r}",
                         hint="expected 8-4-4-4-12 hex digits with dashes, e.g. 2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a")
    return t


def validate_owner(owner: str) -> str:
    """An owner as vgpuhost records it: a domain UUID (lower case), ``manual`` or ``layout``
    (:class:`vgpuhost.model.kinds.Owner`).

    Raises InputError naming the bad value.
    """
    from .kinds import Owner
    if owner in Owner.POOL:
        return owner
    try:
        return parse_uuid(owner)
    except InputError:
        raise InputError(f"invalid owner {owner!r}",
                         hint="give the domain UUID (virsh domuuid NAME), 'manual' or 'layout'") from None


def parse_device_id(text: str, what: str = "device", hint: str = "an mdev UUID or a PCI address (dddd:bb:ss.f)") -> str:
    """A device as vgpuhost names it: a PCI address (``0000:21:00.4``) or an mdev UUID, normalised.

    Raises InputError ``invalid <what> '...'; <hint>``.
    """
    t = text.strip() if isinstance(text, str) else ""
    if PciAddress.is_valid(t):
        return str(PciAddress.parse(t))
    try:
        return parse_uuid(t)
    except InputError:
        raise InputError(f"invalid {what} {str(text)[:64]!r}", hint=hint) from None


# ---------------------------------------------------------------------------
# vGPU type names (docs/reference/hardware.md#vgpu-types)

SERIES = {
    "Q": "virtual workstation (vWS)",
    "B": "virtual desktop (vPC)",
    "A": "virtual application (vApps)",
    "C": "compute (vCS / AI Enterprise)",
}

_WORD_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ASCII_DIGITS = frozenset("0123456789")

#: the suffixes of a MIG-backed type name (NVIDIA/vgpu-device-manager ``pkg/types/vgpu_type.go``:
#: ``ME`` the GPU-instance profile with media engines, ``NOME`` without them, ``MEALL`` with all of
#: them, ``GFX`` with graphics), longest first, and the GPU-instance profile suffix each names
#: (``nvidia-smi mig -lgip`` on an RTX PRO 6000 Blackwell: ``1g.24gb-me``, ``2g.48gb+me.all``,
#: ``2g.48gb+gfx``; docs/reference/hardware.md#vgpu-types)
TYPE_ATTRIBUTES = ("MEALL", "NOME", "GFX", "ME")
GI_SUFFIX = {"ME": "+me", "NOME": "-me", "MEALL": "+me.all", "GFX": "+gfx", "": ""}


def _profile_fields(text: str):
    r"""``(board, slices or None, fb, series, attribute)`` of a vGPU type name, else None.

    Pattern (NVIDIA/vgpu-device-manager's two, widened to boards with spaces such as
    ``RTX Pro 6000 Blackwell DC``, and to lower-case series and suffixes)::

        ^(?:(?:GRID|NVIDIA)\s+)?
         (?P<board>[A-Za-z0-9]+(?: [A-Za-z0-9]+)*(?:-[A-Za-z]+)*)-
         (?:(?P<slices>[1-9])-)?
         (?P<fb>0|[1-9][0-9]*)(?P<series>[QBACqbac])
         (?P<attr>MEALL|NOME|GFX|ME|meall|nome|gfx|me)?$

    where a suffix needs ``slices`` and a MIG-backed board has no ``-<letters>`` part (``\s`` as
    Python's ``re`` reads it in a str pattern).
    """
    if text.endswith("\n"):
        text = text[:-1]
    for prefix in ("GRID", "NVIDIA"):
        if text.startswith(prefix):
            rest = text[len(prefix):]
            body = rest.lstrip()
            # the prefix counts only when whitespace follows it and the rest still parses
            if body != rest:
                got = _profile_body(body)
                if got is not None:
                    return got
    return _profile_body(text)


def _profile_body(text: str):
    for attr in TYPE_ATTRIBUTES:
        for spelt in (attr, attr.lower()):
            if text.endswith(spelt):
                got = _profile_core(text[:-len(spelt)])
                if got is not None and got[1] is not None:
                    return got[0], got[1], got[2], got[3], attr
    got = _profile_core(text)
    return None if got is None else (got[0], got[1], got[2], got[3], "")


def _profile_core(text: str):
    """``<board>-[<slices>-]<fb><series>`` -> ``(board, slices or None, fb, series)``, else None."""
    if len(text) < 4 or text[-1] not in "QBACqbac":
        return None
    series = text[-1]
    i = len(text) - 1
    while i > 0 and text[i - 1] in _ASCII_DIGITS:
        i -= 1
    fb = text[i:-1]
    if not fb or (fb[0] == "0" and len(fb) > 1) or i < 2 or text[i - 1] != "-":
        return None
    head = text[:i - 1]
    if len(head) >= 3 and head[-2] == "-" and head[-1] in "123456789":
        board = head[:-2]       # "-<digit>" can only be slices: a board's dash parts are letters
        return (board, int(head[-1]), int(fb), series) if _is_board(board, dashes=False) else None
    return (head, None, int(fb), series) if _is_board(head, dashes=True) else None


def _is_board(board: str, *, dashes: bool) -> bool:
    """Words of ASCII letters and digits joined by single spaces, then (time-sliced) ``-<letters>`` parts."""
    parts = board.split("-") if dashes else [board]
    words = parts[0].split(" ")
    return (all(w and all(c in _WORD_CHARS for c in w) for w in words)
            and all(p and all(c in _LETTERS for c in p) for p in parts[1:]))


@record(frozen=True)
class VgpuProfile:
    """A vGPU type name parsed: ``A40-8Q``, ``A100-1-5CME``, ``RTX6000-Ada-1Q``, ``DC-1-24CGFX``.

    ``board`` as NVIDIA spells it (``A40``, ``RTX6000-Ada``, ``RTX Pro 6000 Blackwell DC``; a board
    of one word is upper-cased, so ``a40-8q`` names ``A40-8Q``); ``framebuffer_gb`` is in GB as the
    name spells it; ``gi_slices`` is the GPU-instance slice count of a MIG-backed type (None when
    time-sliced; any series may be MIG-backed); ``media_extensions`` is the ``ME`` suffix;
    ``attribute`` holds the other suffixes, ``NOME``, ``MEALL`` or ``GFX`` ("" for none).  The
    grammar is NVIDIA/vgpu-device-manager's (``pkg/types/vgpu_type.go``) widened to boards with
    spaces; docs/reference/hardware.md#vgpu-types.  ``vendor_prefix`` ``GRID``/``NVIDIA`` of a raw
    sysfs/NVML name is dropped.
    """

    board: str
    framebuffer_gb: int
    series: str
    gi_slices: Optional[int] = None
    media_extensions: bool = False
    attribute: str = ""

    @classmethod
    def parse(cls, text: str) -> "VgpuProfile":
        """Parse a name; raises InputError (exit 3) when it is not a vGPU type name (the text is
        shown cut to 64 characters)."""
        p = cls.try_parse(text)
        if p is None:
            shown = clipped(text)
            raise InputError(f"invalid vGPU profile name {shown!r}",
                             hint="expected <board>-<GB><Q|B|A|C> or <board>-<slices>-<GB><series>"
                                  "[ME|NOME|MEALL|GFX], e.g. A40-8Q, RTX6000-Ada-1Q or A100-1-5C; "
                                  "'vgpuhost types' lists them")
        return p

    @classmethod
    def try_parse(cls, text: str) -> Optional["VgpuProfile"]:
        f = _profile_fields(text.strip()) if isinstance(text, str) else None
        if f is None:
            return None
        board, slices, fb, series, attr = f
        if " " not in board and "-" not in board:
            board = board.upper()
        return cls(board, fb, series.upper(), slices, attr == "ME", "" if attr == "ME" else attr)

    @property
    def mig_backed(self) -> bool:
        return self.gi_slices is not None

    @property
    def gi_suffix(self) -> str:
        """The GPU-instance profile suffix this type's suffix names: ``+me``, ``-me``, ``+me.all``, ``+gfx`` or ""."""
        return GI_SUFFIX["ME" if self.media_extensions else self.attribute]

    def __str__(self) -> str:
        mid = f"{self.gi_slices}-" if self.gi_slices is not None else ""
        return (f"{self.board}-{mid}{self.framebuffer_gb}{self.series}"
                f"{'ME' if self.media_extensions else ''}{self.attribute}")


def strip_vendor_prefix(name: str) -> str:
    """``GRID A100-4C`` / ``NVIDIA A40-8Q`` / ``nvidia a40-8q`` -> ``A100-4C`` / ``A40-8Q`` / ``a40-8q``
    (the prefix in any case)."""
    for prefix in ("GRID ", "NVIDIA "):
        if name[:len(prefix)].upper() == prefix:
            return name[len(prefix):].strip()
    return name.strip()


#: the most characters of a rejected input an error line shows (then ``...``)
SHOWN_MAX = 64


def clipped(text: object) -> object:
    """``text`` cut to :data:`SHOWN_MAX` characters plus ``...`` for an error line (a non-string as it is)."""
    return text if not isinstance(text, str) or len(text) <= SHOWN_MAX else text[:SHOWN_MAX] + "..."


def parse_description(text: str) -> Dict[str, str]:
    """An mdev type ``description`` as key=value pairs (docs/reference/hardware.md#mdev).

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
    r"""``2048M`` -> 2048, ``4G`` -> 4096, ``1024`` -> 1024 (MiB); None if unparsable.

    Accepts ``^\s*(\d+)\s*([KMGT]?)i?B?\s*$`` (case-insensitive, ASCII units), parsed by hand:
    the qemu hook reads every mdev type's framebuffer through here (see :func:`_bdf_fields`).
    """
    t = (text or "").strip()
    i = 0
    while i < len(t) and t[i].isdecimal():
        i += 1
    if i == 0:
        return None
    n = int(t[:i])
    rest = t[i:].lstrip().upper()
    unit = rest[:1] if rest[:1] in ("K", "M", "G", "T") else ""
    rest = rest[len(unit):]
    if rest.startswith("I"):
        rest = rest[1:]
    if rest.startswith("B"):
        rest = rest[1:]
    if rest:
        return None
    return {"K": n // 1024, "": n, "M": n, "G": n * 1024, "T": n * 1024 * 1024}[unit]


#: compiled on first use (re caches it): the qemu hook never parses MIG names
_MIG_PATTERN = r"^(?:(?P<ci>[0-9]+)c\.)?(?P<g>[0-9]+)g\.(?P<mem>[0-9]+)gb(?P<attr>\+me\.all|\+me|-me|\+gfx)?$"


@record(frozen=True)
class MigProfile:
    """A MIG GPU-instance profile name (docs/reference/hardware.md#mig-profiles): ``3g.40gb``, ``1g.10gb+me``.

    ``media_extensions`` is the ``+me`` suffix; ``attribute`` the others a Blackwell board reports
    (``-me`` without media engines, ``+me.all`` with all of them, ``+gfx`` with graphics;
    ``nvidia-smi mig -lgip`` on an RTX PRO 6000 Blackwell, bigstack-oss/cubecos issue 312), "" for none.
    """

    slices: int
    memory_gb: int
    media_extensions: bool = False
    attribute: str = ""

    @classmethod
    def parse(cls, text: str) -> "MigProfile":
        """Parse a name; raises InputError (exit 3) when it is not a GPU-instance profile name."""
        import re       # here: the qemu hook never parses MIG names
        m = re.match(_MIG_PATTERN, text.strip(), re.IGNORECASE) if isinstance(text, str) else None
        if not m or m["ci"]:
            shown = clipped(text)
            raise InputError(f"invalid MIG profile name {shown!r}",
                             hint="expected <N>g.<GB>gb[+me|-me|+me.all|+gfx], e.g. 1g.10gb or 3g.40gb")
        attr = (m["attr"] or "").lower()
        return cls(int(m["g"]), int(m["mem"]), attr == "+me", "" if attr == "+me" else attr)

    @property
    def suffix(self) -> str:
        """``+me``, ``-me``, ``+me.all``, ``+gfx`` or ""."""
        return "+me" if self.media_extensions else self.attribute

    def __str__(self) -> str:
        return f"{self.slices}g.{self.memory_gb}gb{self.suffix}"


def mig_memory_gb(memory_mib: int, device_memory_mib: int) -> int:
    """The ``<GB>`` of a GPU-instance profile's name from its memory and the whole GPU's (both MiB).

    NVIDIA names a profile by the board's memory times its share in eighths, not by the memory the
    instance gets: the share is ``memory_mib / device_memory_mib`` rounded up to an eighth, times
    the device memory in GiB rounded up, rounded half away from zero (NVIDIA/go-nvlib
    ``pkg/nvlib/device/mig_profile.go`` ``getMigMemorySizeGB``, which NVIDIA's device plugin and
    mig-parted use).  A real H200 (143771 MiB) reports 1g.18gb as 16.00 GiB, 1g.35gb as 32.25 GiB,
    3g.71gb as 69.50 GiB (NVIDIA/mig-parted issue 120): ``ceil(memory_mib / 1024)`` would say 16,
    33, 70.  Raises ValueError when ``device_memory_mib`` is not positive.
    """
    if device_memory_mib <= 0:
        raise ValueError(f"device memory must be positive, not {device_memory_mib} MiB")
    eighths = -(-memory_mib * 8 // device_memory_mib)        # ceil, in integers: no float drift
    total_gib = -(-device_memory_mib // 1024)
    # eighths * total_gib / 8, rounded half up (the values are positive)
    return (eighths * total_gib * 2 + 8) // 16
