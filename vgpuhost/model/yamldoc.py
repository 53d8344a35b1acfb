"""Strict YAML parsing that remembers where each value came from.

Owns: turning the text of a YAML document into plain Python data plus the
line of every mapping key and sequence item (:class:`Located`), so validators
can say ``file:line: what is wrong``, and :func:`shown`, the rule for quoting
a value of an untrusted file.  Pure: the text comes from the caller
(:func:`vgpuhost.io.yamlutil.read_text_file` reads a file).  Must not: know
any schema, read files, or be imported on the qemu hook's path (PyYAML).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
import re
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import yaml

from .errors import InputError

PathKey = Tuple[Any, ...]


@dataclass
class Located:
    """Parsed data, a map ``path tuple -> 1-based line`` and, for every scalar value, the text
    it was written as (``scalars``: ``path -> (text, style)``; see :meth:`scalar`)."""

    data: Any
    source: str
    lines: Dict[PathKey, int] = field(default_factory=dict)
    scalars: Dict[PathKey, Tuple[str, str]] = field(default_factory=dict)

    def scalar(self, path: Iterable[Any]) -> Optional[Tuple[str, str]]:
        """``(text, style)`` of the scalar value at ``path`` as the document wrote it, before YAML
        read it as a number, a boolean or a date: ``text`` is the scalar's content (a quoted one
        without its quotes), ``style`` ``""`` for a plain scalar, else its indicator (``'``,
        ``"``, ``|``, ``>``).  None where ``path`` is not a scalar of the document (a default)."""
        return self.scalars.get(tuple(path))

    def line(self, path: Iterable[Any]) -> Optional[int]:
        """The line of ``path`` or of its nearest ancestor that has one."""
        p = tuple(path)
        while True:
            if p in self.lines:
                return self.lines[p]
            if not p:
                return None
            p = p[:-1]

    def error(self, path: Iterable[Any], message: str, hint: Optional[str] = None) -> InputError:
        """An InputError ``<source>:<line>: <message>`` for the value at ``path``."""
        line = self.line(path)
        where = f"{self.source}:{line}" if line else self.source
        return InputError(f"{where}: {message}", hint=hint)


_PLAIN = re.compile(r"[A-Za-z0-9_.:+-]{1,64}\Z")


def shown(value: Any) -> str:
    """``value`` as an error message may quote it: ``repr`` for a number, a boolean, an empty
    container or a plain token (letters, digits and ``_.:+-``, at most 64), else only its kind
    and size.  A file that is not what it should be (a config symlinked to /etc/shadow) never has
    a line of it echoed."""
    if value is None or isinstance(value, (bool, int, float)) or value in ({}, []):
        return repr(value)
    if isinstance(value, str) and _PLAIN.match(value):
        return repr(value)
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(value)} entries" \
        if isinstance(value, (dict, list)) else type(value).__name__
    return f"(not shown: {size})"


def kind_of(value: Any) -> str:
    """What a YAML value is, in a refusal's words: ``nothing``, ``a boolean``, ``a string``, ``a number``,
    ``a mapping``, ``a list`` (else the Python type's name)."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "a number", float: "a number", dict: "a mapping",
            list: "a list"}.get(type(value), type(value).__name__)


def checked_mapping(err: "Callable[..., InputError]", value: Any, path: tuple, allowed: "Iterable[str]",
                    what: str, hint: Optional[str] = None) -> Dict[Any, Any]:
    """``value`` when it is a mapping whose keys are all in ``allowed``; else raises what ``err(path, message,
    hint)`` makes (a ``FILE:LINE:`` InputError): "WHAT must be a mapping" (with ``hint``), or "unknown key K in
    WHAT" at that key's line, with the nearest allowed key."""
    if not isinstance(value, dict):
        raise err(path, f"{what} must be a mapping, found {kind_of(value)}", hint)
    for key in value:
        if key not in allowed:
            names = sorted(allowed)
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            raise err(path + (key,), f"unknown key {shown(key)} in {what}",
                      (f"did you mean {near[0]!r}? " if near else "") + "allowed: " + ", ".join(names))
    return value


def require_versioned(loc: "Located", what: str) -> Dict[Any, Any]:
    """The top level of ``loc``: a mapping holding a ``version`` key, else InputError naming the
    position only.  Checked before any other message could quote the file: a document without
    it is not a vgpuhost file at all (a symlink to another file, the wrong path)."""
    data = loc.data
    if data is None:
        raise InputError(f"{loc.source}: the {what} is empty", hint="start with 'version: 1'")
    if not isinstance(data, dict) or "version" not in data:
        found = "a mapping without a 'version' key" if isinstance(data, dict) else \
            {str: "a string", list: "a list"}.get(type(data), "a scalar")
        raise InputError(f"{loc.source}:1: not a vgpuhost {what}: the top level is {found} (its content is not "
                         "shown)", hint=f"a {what} is a mapping that starts with 'version: 1'; check the path")
    return data
MAX_DEPTH = 32


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader (no Python objects); aliases and depth are checked in the walk."""


def load_located(text: str, source: str) -> Located:
    """Parse one YAML document; raise InputError with the line on syntax errors,
    duplicate keys, aliases (``&``/``*``: refused, so no alias bomb expands) and
    nesting deeper than MAX_DEPTH."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except RecursionError:
        raise InputError(f"{source}: nested too deeply", hint=f"at most {MAX_DEPTH} levels") from None
    except yaml.YAMLError as e:
        raise _malformed(e, source) from None
    out = Located(None, source)
    if node is None:
        return out
    constructor = _Loader(text)
    seen: set = set()

    def walk(n: yaml.Node, path: PathKey) -> Any:
        line = n.start_mark.line + 1
        if len(path) > MAX_DEPTH:
            raise InputError(f"{source}:{line}: nested too deeply", hint=f"at most {MAX_DEPTH} levels")
        if isinstance(n, (yaml.MappingNode, yaml.SequenceNode)):
            if id(n) in seen:
                raise InputError(f"{source}:{line}: YAML aliases (*name) are not allowed",
                                 hint="write the value out where it is needed")
            seen.add(id(n))
        out.lines.setdefault(path, line)
        if isinstance(n, yaml.MappingNode):
            result: Dict[Any, Any] = {}
            for knode, vnode in n.value:
                key = constructor.construct_object(knode, deep=True)
                if isinstance(key, (list, dict)):
                    raise InputError(f"{source}:{knode.start_mark.line + 1}: a mapping key must be a scalar")
                if key in result:
                    raise InputError(f"{source}:{knode.start_mark.line + 1}: duplicate key {shown(key)}",
                                     hint="each key may appear once")
                out.lines[path + (key,)] = knode.start_mark.line + 1
                result[key] = walk(vnode, path + (key,))
            return result
        if isinstance(n, yaml.SequenceNode):
            return [walk(item, path + (i,)) for i, item in enumerate(n.value)]
        out.scalars[path] = (n.value, n.style or "")
        return constructor.construct_object(n, deep=True)

    try:
        out.data = walk(node, ())
    except yaml.YAMLError as e:
        raise _malformed(e, source) from None
    return out


def _malformed(e: "yaml.YAMLError", source: str) -> InputError:
    """``FILE:LINE: malformed YAML: <problem>``: never PyYAML's full text, which quotes the line.

    PyYAML quotes what it found (``'%s'``): a character or an escape is kept,
    anything longer (a tag, a token) only by :func:`shown`'s rule, so a file
    that is not YAML never has a piece of it echoed.
    """
    mark = getattr(e, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    problem = re.sub(r"'([^']*)'", lambda m: m.group(0) if len(m.group(1)) <= 2 else shown(m.group(1)), problem)
    return InputError(f"{source}{line}: malformed YAML: {problem}", hint="fix the syntax (indentation, quoting, colons)")
