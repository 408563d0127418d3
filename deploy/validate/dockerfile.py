"""A small Dockerfile reader for the deploy checks (check_dockerfiles.py, check_manifests.py).

It understands what deploy/Dockerfile* use: line continuations, comments, parser directives,
stages (`FROM image [AS name]`), global ARGs, and the shell and JSON forms of COPY. It is not
a full BuildKit front end (no heredocs, no `# escape=` other than the backslash).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    rest: str  # everything after the keyword, continuation lines joined
    line: int  # 1-based line of the keyword
    stage: int  # index of the stage it belongs to (-1: before the first FROM)


@dataclass
class Stage:
    index: int
    image: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Copy:
    """A COPY/ADD: its flags (`--from` etc.), sources and destination."""

    instruction: Instruction
    flags: dict[str, str]
    sources: list[str]
    dest: str


@dataclass
class Dockerfile:
    path: Path
    instructions: list[Instruction]
    stages: list[Stage]
    global_args: dict[str, str | None]  # ARGs before the first FROM -> default (None: none)

    @classmethod
    def read(cls, path: Path) -> "Dockerfile":
        instructions = parse(path.read_text())
        stages: list[Stage] = []
        global_args: dict[str, str | None] = {}
        for ins in instructions:
            if ins.keyword == "FROM":
                words = ins.rest.split()
                words = [w for w in words if not w.startswith("--platform")]
                name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
                stages.append(Stage(len(stages), words[0] if words else "", name, ins.line))
            elif stages:
                stages[-1].instructions.append(ins)
            elif ins.keyword == "ARG":
                key, eq, value = ins.rest.strip().partition("=")
                global_args[key.strip()] = value.strip().strip('"') if eq else None
        for ins in instructions:
            ins.stage = -1
        for st in stages:
            for ins in st.instructions:
                ins.stage = st.index
        return cls(path, instructions, stages, global_args)

    def copies(self) -> list[Copy]:
        out = []
        for ins in self.instructions:
            if ins.keyword not in ("COPY", "ADD"):
                continue
            words = copy_words(ins.rest)
            flags = {}
            while words and words[0].startswith("--"):
                key, _, value = words.pop(0)[2:].partition("=")
                flags[key] = value
            if len(words) >= 2:
                out.append(Copy(ins, flags, words[:-1], words[-1]))
        return out

    def dockerignore(self) -> Path:
        """BuildKit's per-Dockerfile context filter: <Dockerfile>.dockerignore."""
        return self.path.with_name(self.path.name + ".dockerignore")


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    directives_done = False
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            if stripped and not directives_done and re.match(r"#\s*[a-zA-Z]+\s*=", stripped):
                pass  # parser directive (syntax=, escape=)
            else:
                directives_done = True
            i += 1
            continue
        directives_done = True
        start = i
        parts = []
        line = raw
        while True:
            body = line.rstrip()
            if body.endswith("\\"):
                parts.append(body[:-1])
                i += 1
                # Comment lines inside a continued instruction are removed by Docker.
                while i < len(lines) and lines[i].strip().startswith("#"):
                    i += 1
                if i >= len(lines):
                    break
                line = lines[i]
            else:
                parts.append(body)
                i += 1
                break
        joined = " ".join(p.strip() for p in parts)
        keyword, _, rest = joined.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip(), start + 1, -1))
    return out


def copy_words(rest: str) -> list[str]:
    """COPY's words, flags first, for the shell form and the JSON form."""
    flags = []
    words = rest.split()
    while words and words[0].startswith("--"):
        flags.append(words.pop(0))
    body = " ".join(words)
    if body.startswith("["):
        try:
            return flags + [str(w) for w in json.loads(body)]
        except json.JSONDecodeError:
            pass
    return flags + shlex.split(body)


def ignore_patterns(path: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per line of a .dockerignore, in order."""
    out = []
    if not path.is_file():
        return out
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        if exception:
            line = line[1:].strip()
        line = line.strip("/")
        out.append((exception, re.compile(glob_regex(line))))
    return out


def glob_regex(pattern: str) -> str:
    """Go filepath.Match plus `**` (any number of directories), as Docker matches patterns."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out) + r"\Z"


def ignored(rel: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether a context path (or a directory holding it) is excluded; the last match wins."""
    parts = rel.strip("/").split("/")
    result = False
    for exception, rx in patterns:
        for n in range(1, len(parts) + 1):
            if rx.match("/".join(parts[:n])):
                result = not exception
                break
    return result
