"""Strict YAML loading that remembers where each value came from.

Owns: turning a YAML document into plain Python data plus the line of every
mapping key and sequence item, so validators can say ``file:line: what is
wrong``.  Must not: know any schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple

import yaml

from .errors import InputError

PathKey = Tuple[Any, ...]


@dataclass
class Located:
    """Parsed data and a map ``path tuple -> 1-based line``."""

    data: Any
    source: str
    lines: Dict[PathKey, int] = field(default_factory=dict)

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


class _Loader(yaml.SafeLoader):
    """SafeLoader without aliases to arbitrary depth surprises; keeps duplicates out."""


def load_located(text: str, source: str) -> Located:
    """Parse one YAML document; raise InputError with the line on syntax errors
    and on duplicate keys."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(f"{source}{line}: malformed YAML: {problem}",
                         hint="fix the syntax (indentation, quoting, colons)") from None
    out = Located(None, source)
    if node is None:
        return out
    constructor = _Loader(text)

    def walk(n: yaml.Node, path: PathKey) -> Any:
        out.lines.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            result: Dict[Any, Any] = {}
            for knode, vnode in n.value:
                key = constructor.construct_object(knode, deep=True)
                if isinstance(key, (list, dict)):
                    raise InputError(f"{source}:{knode.start_mark.line + 1}: a mapping key must be a scalar")
                if key in result:
                    raise InputError(f"{source}:{knode.start_mark.line + 1}: duplicate key {key!r}",
                                     hint="each key may appear once")
                out.lines[path + (key,)] = knode.start_mark.line + 1
                result[key] = walk(vnode, path + (key,))
            return result
        if isinstance(n, yaml.SequenceNode):
            return [walk(item, path + (i,)) for i, item in enumerate(n.value)]
        return constructor.construct_object(n, deep=True)

    try:
        out.data = walk(node, ())
    except yaml.YAMLError as e:
        raise InputError(f"{source}: malformed YAML: {e}") from None
    return out
