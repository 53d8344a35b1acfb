"""Rendering for the CLI: aligned tables and the stable JSON documents.

Owns: turning inventory values and findings into human tables and into
the documented ``--json`` shapes (docs/reference/json.md).  Must not: read
the host or decide anything.
"""

from __future__ import annotations

from ..observe.inventory import Inventory
from ..present.inventory import SCHEMA_GPUS, SCHEMA_TYPES, aggregate_types, gpu_doc, gpus_doc, types_doc  # noqa: F401 (the CLI's names)

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only: `vgpuhost types` does not import typing
    from typing import Any, Dict, Iterable, List, Optional, Sequence
    from ..policy.checks import Finding, ModeVerdict

SCHEMA_HOST_CHECK = "vgpuhost.host-check/v1"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; None prints as '-'."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else _cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """A table cell: control characters (a newline in a sysfs name) escaped."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def dumps(doc: Dict[str, Any]) -> str:
    """``doc`` as the documented ``--json`` text: exactly ``json.dumps(doc, indent=2)``.

    The standard library serves ``indent`` only with its Python encoder (a generator per
    container); this one appends to one list and encodes every string with json's C
    function, and gives up to ``json.dumps`` itself on anything but ``dict`` with ``str``
    keys, ``list``, ``tuple``, ``str``, ``int``, a finite ``float``, ``True``, ``False`` and
    ``None`` (tests/test_cli_lean.py checks the two agree on generated documents).  Measured
    2026-12-07 on the 8 x 32 A100 tree of bench/inventory.py (340 kB ``types`` document):
    16 ms with ``json.dumps``, about a third of that here; on small hosts the gain is a
    millisecond or two.  Raises TypeError for a value json cannot encode, ValueError for a
    circular one.
    """
    return indented(doc)


def indented(value: Any) -> str:
    """``json.dumps(value, indent=2)``, as :func:`dumps` writes it (any JSON value)."""
    out: List[str] = []
    try:
        _encode(value, out, "\n")
    except (_Unusual, RecursionError):
        import json             # here only: json imports re (a lean read command's start does not)
        return json.dumps(value, indent=2)
    return "".join(out)


class _Unusual(Exception):
    """A value :func:`dumps` leaves to ``json.dumps``."""


try:
    from _json import encode_basestring_ascii as _quote     # json's C function
except ImportError:                                          # pragma: no cover (CPython has it)
    from json.encoder import encode_basestring_ascii as _quote


#: a line break with its indent -> the separators of a dict at that depth; a key -> its quoted text and ": "
#: (a document's keys repeat thousands of times: a type's 32 parents each name "parent" and
#: "available_instances"); both bounded
_SEPS: Dict[str, tuple] = {}
_KEYS: Dict[str, str] = {}


def _encode(o: Any, out: List[str], nl: str) -> None:
    t = type(o)
    if t is str:
        out.append(_quote(o))
    elif t is dict:
        if not o:
            out.append("{}")
            return
        seps = _SEPS.get(nl)
        if seps is None:
            seps = _SEPS[nl] = ("{" + nl + "  ", "," + nl + "  ", nl + "}")
        sep, sep_next, close = seps
        inner = sep_next[1:]
        keys = _KEYS
        for k, v in o.items():
            if type(k) is not str:
                raise _Unusual
            qk = keys.get(k)
            if qk is None:
                qk = _quote(k) + ": "
                if len(keys) < 256:
                    keys[k] = qk
            tv = type(v)
            # a text or whole-number value in the same append (most values are: no call per value)
            if tv is str:
                out.append(sep + qk + _quote(v))
            elif tv is int:
                out.append(sep + qk + int.__repr__(v))
            else:
                out.append(sep + qk)
                _encode(v, out, inner)
            sep = sep_next
        out.append(close)
    elif t is list or t is tuple:
        if not o:
            out.append("[]")
            return
        inner = nl + "  "
        if all(type(x) is str for x in o):
            out.append("[" + inner + ("," + inner).join(map(_quote, o)) + nl + "]")
            return
        sep = "[" + inner
        for v in o:
            out.append(sep)
            sep = "," + inner
            _encode(v, out, inner)
        out.append(nl + "]")
    elif o is None:
        out.append("null")
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif t is int:
        out.append(int.__repr__(o))
    elif t is float and o == o and o not in (float("inf"), float("-inf")):
        out.append(float.__repr__(o))
    else:
        raise _Unusual


def gpus_table(inv: Inventory) -> str:
    """The ``gpus`` table; a GPU whose PCI device id vgpuhost does not know is marked so in MODEL."""
    rows = []
    for g in inv.gpus:
        doc = gpu_doc(inv, g)
        model = g.model if g.model_known else f"{g.model} (unknown device id)"
        rows.append([g.address, model, g.pci.driver, g.pci.numa_node, g.pci.iommu_group,
                     ",".join(g.backends) or None, len(g.vfs) or None, len(doc["vgpus"]),
                     ",".join(str(c) for c in g.companions) or None])
    text = table(["BDF", "MODEL", "DRIVER", "NUMA", "GROUP", "BACKENDS", "VFS", "VGPUS", "COMPANIONS"], rows)
    notes = [f"{g.address}: behind Intel VMD {g.vmd}: passthrough and vendor-VFIO vGPUs are refused "
             "('vgpuhost host check' says why)" for g in inv.gpus if g.vmd is not None]
    notes += [f"{g.address}: unreadable {u.describe()}" for g in inv.gpus for u in g.unreadable]
    return "\n".join([text] + notes)


# --- types ---------------------------------------------------------------

#: the NAME of a type the driver lists without one (a blank after ``1145  :`` in ``creatable_vgpu_types``)
NO_NAME = "(no name)"


def types_table(entries: List[Dict[str, Any]]) -> str:
    """The ``types`` table; a type listed without a name shows :data:`NO_NAME`, explained below the table."""
    rows = [[e["gpu"], e["type_id"], e["name"] or NO_NAME, e["series"], e["framebuffer_mib"],
             e["max_instances"], e["available_instances"], e["backend"]] for e in entries]
    text = table(["GPU", "TYPE", "NAME", "SERIES", "FB_MIB", "MAX", "AVAIL", "BACKEND"], rows)
    nameless = sorted({e["type_id"] for e in entries if not e["name"]}, key=lambda t: (len(t), t))
    if nameless:
        text += (f"\n{NO_NAME}: the driver lists type {', '.join(nameless)} without a name, so its board, series "
                 "and framebuffer are unknown and no profile name selects it "
                 "('nvidia-smi vgpu -s' lists the types the driver supports)")
    return text


# --- host check ----------------------------------------------------------

def check_doc(findings: List[Finding], verdicts: Sequence[ModeVerdict] = ()) -> Dict[str, Any]:
    """``vgpuhost.host-check/v1``: ``ready`` (no error and every GPU can serve some mode now), the
    counts, the findings, and ``modes``: per mode its host verdict and each GPU's."""
    from ..policy.checks import MODES, host_ready, host_verdicts
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info", "ok")}
    verdicts = list(verdicts)
    per_host = host_verdicts(verdicts)
    modes = [{"mode": m, "verdict": per_host[m],
              "gpus": [{k: v for k, v in x.as_dict().items() if k != "mode"} for x in verdicts if x.mode == m]}
             for m in MODES]
    return {"schema": SCHEMA_HOST_CHECK, "ready": host_ready(findings, verdicts), "counts": counts,
            "findings": [f.as_dict() for f in findings], "modes": modes}


def check_text(findings: List[Finding], verdicts: Sequence[ModeVerdict] = (), root: Optional[str] = None) -> str:
    from ..policy.checks import MODE_NAMES, MODES, host_verdicts, idle_gpus, is_ready
    rows = [[f.severity, f.subject, f.code, f.message] for f in findings]
    lines = table(["SEVERITY", "SUBJECT", "CODE", "FINDING"], rows).splitlines()
    out = [lines[0]]
    fix_col = lines[0].index("FINDING")
    for f, line in zip(findings, lines[1:]):
        out.append(line)
        if f.fix:
            out.append(" " * fix_col + "fix: " + f.fix)
    verdicts = list(verdicts)
    if verdicts:
        out.append("")
        rows = [[MODE_NAMES[v.mode], v.gpu, v.verdict, v.reason] for v in verdicts]
        lines = table(["MODE", "GPU", "VERDICT", "WHY"], rows).splitlines()
        out.append(lines[0])
        fix_col = lines[0].index("WHY")
        for v, line in zip(verdicts, lines[1:]):
            out.append(line)
            if v.fix and v.verdict != "ready":
                out.append(" " * fix_col + "fix: " + v.fix)
    doc = check_doc(findings, verdicts)
    c = doc["counts"]
    tally = f"{c['error']} errors, {c['warning']} warnings"
    per_host = host_verdicts(verdicts)
    ready = [MODE_NAMES[m] for m in MODES if per_host[m] == "ready"]
    others = ", ".join(f"{MODE_NAMES[m]} {per_host[m]}" for m in MODES if per_host[m] != "ready")
    out.append("")
    if doc["ready"]:
        what = f" for {', '.join(ready)}" if verdicts else ""
        out.append(f"host is ready{what}{f' ({others})' if ready and others else ''}: {tally}")
    else:
        idle = idle_gpus(verdicts)
        why = (f": {', '.join(idle)} can serve no mode now" if idle and is_ready(findings) else "")
        out.append(f"host is NOT ready{why}{f' ({others})' if why and others else ''}: {tally}")
    return "\n".join(out)
