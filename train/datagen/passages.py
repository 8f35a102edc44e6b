"""Passages for summarization, extraction and RAG prompts, from text already on the machine.

Nothing is downloaded: the sources are Python's own documentation (``pydoc_data.topics``) and
the standard library's module docstrings (read with ``ast``, never imported), the licence
texts in ``/usr/share/common-licenses`` and the packages' ``*.dist-info`` folders, and the
DESCRIPTION sections of installed man pages (roff markup stripped). Each source is cut into
paragraphs of 200-900 characters; the set is sorted, so a seed picks the same passages on any
machine with the same files (the plan records the passages it used, so a resumed run never
depends on the files again).
"""

from __future__ import annotations

import ast
import gzip
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_CHARS, MAX_CHARS = 200, 900
_ROFF_LINE = re.compile(r"^\.(\S+)\s*(.*)$")
_ROFF_ESCAPES = re.compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\[&e-]|\\s[+-]?\d")


def installed_passages(man_pages: int = 4000) -> list[str]:
    """Every paragraph of the sources above within the length bounds, deduplicated, sorted.
    ``man_pages``: at most this many man pages are read (sorted by name)."""
    texts: list[str] = []
    texts += _python_docs()
    texts += _licences()
    texts += _man_descriptions(man_pages)
    paragraphs = {
        " ".join(p.split())
        for text in texts
        for p in re.split(r"\n\s*\n", text)
        if MIN_CHARS <= len(" ".join(p.split())) <= MAX_CHARS
        and not p.lstrip().startswith((">>>", "*", "|", "+", "-", "$", "#"))
    }
    return sorted(paragraphs)


def _python_docs() -> Iterator[str]:
    import pydoc_data.topics

    yield from pydoc_data.topics.topics.values()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if doc:
            yield doc


def _licences() -> Iterator[str]:
    roots = [Path("/usr/share/common-licenses"), Path(sysconfig.get_paths()["purelib"])]
    files = sorted(p for p in roots[0].glob("*") if p.is_file()) if roots[0].is_dir() else []
    files += sorted(roots[1].glob("*.dist-info/LICEN[SC]E*"))
    files += sorted(roots[1].glob("*.dist-info/licenses/*"))
    for path in files:
        try:
            if path.is_file() and path.stat().st_size < 200_000:
                yield path.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue


def _man_descriptions(limit: int) -> Iterator[str]:
    root = Path("/usr/share/man/man1")
    if not root.is_dir():
        return
    for path in sorted(root.glob("*.1.gz"))[:limit]:
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="ignore")
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        description = _roff_section(text, "DESCRIPTION")
        if description:
            yield description


def _roff_section(text: str, name: str) -> str:
    """The plain text of section ``name`` of a roff man page; paragraphs split by blank lines."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        match = _ROFF_LINE.match(line)
        if match:
            macro, rest = match.groups()
            if macro in ("SH", "Sh"):
                if inside:
                    break
                inside = rest.strip().strip('"').upper() == name
            elif inside and macro in ("PP", "P", "LP", "Pp", "TP", "IP", "sp", "br"):
                out.append("")
            elif inside and macro in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "Nm", "Ar"):
                out.append(rest.replace('"', ""))
            continue
        if inside:
            out.append(line)
    return _ROFF_ESCAPES.sub("", "\n".join(out)).replace("\\-", "-").replace("\\\\", "\\")
