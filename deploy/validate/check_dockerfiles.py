#!/usr/bin/env python3
"""Static checks of every deploy/Dockerfile* (no Docker engine needed).

Usage: check_dockerfiles.py ROOT [--cargo-metadata META.json]

For each deploy/Dockerfile* (not the .dockerignore files):
  * it has its BuildKit context filter <Dockerfile>.dockerignore;
  * every `FROM ${VAR}` names a global ARG with a default; every `--from=`/`from=` names an
    earlier stage;
  * every COPY/ADD source from the build context exists in the repository and is not
    excluded by the context filter;
  * the final stage runs as a non-root USER;
  * with --cargo-metadata: the packages (`-p`) and binaries (`--bin`) that `cargo build`
    names, and the manifests maturin builds (`-m`/`--manifest-path`), are in the Cargo
    workspace;
  * maturin builds: the pinned MATURIN_VERSION satisfies the build-system requirement of the
    pyproject.toml next to the manifest, and the wheel installed (`NAME-*.whl`) is that
    project's.

Prints one line per problem and what was checked; exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

from dockerfile import Dockerfile, ignore_patterns, ignored


def version_tuple(v: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)*)", v.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def satisfies(version: str, spec: str) -> bool | None:
    """`1.16.0` against `>=1.7,<2` (numeric versions; None when the spec is beyond that)."""
    have = version_tuple(version)
    if have is None:
        return None
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*([0-9.]+)", clause)
        if not m:
            return None
        want = version_tuple(m.group(2))
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}[m.group(1)]
        if not ok:
            return False
    return True


def check(root: Path, path: Path, meta: dict | None) -> tuple[list[str], list[str]]:
    rel = path.relative_to(root)
    problems: list[str] = []
    done: list[str] = []
    df = Dockerfile.read(path)
    if not df.stages:
        return [f"{rel}: no FROM"], done

    ignore_file = df.dockerignore()
    if not ignore_file.is_file():
        problems.append(f"{rel}: no context filter {ignore_file.relative_to(root)} (the whole repository, target/ included, would be sent)")
    patterns = ignore_patterns(ignore_file)

    # Stages and ARGs.
    names: set[str] = set()
    for st in df.stages:
        for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", st.image):
            if df.global_args.get(var) in (None, ""):
                problems.append(f"{rel}:{st.line}: FROM uses ${var}, which no global ARG gives a default")
        stage_refs = re.findall(r"(?:--from=|\bfrom=)([^,\s]+)", " ".join(i.rest for i in st.instructions))
        for ref in stage_refs:
            if ref not in names and not re.search(r"[/:.]", ref) and not ref.isdigit():
                problems.append(f"{rel}: stage {st.name or st.index} uses from={ref}, which is no earlier stage")
        if st.name:
            names.add(st.name)

    # COPY sources from the build context.
    n_copies = 0
    for cp in df.copies():
        if "from" in cp.flags:
            continue
        for src in cp.sources:
            n_copies += 1
            src_rel = src.removeprefix("./").strip("/") or "."
            if src_rel == ".":
                continue
            matches = list(root.glob(src_rel)) if re.search(r"[*?\[]", src_rel) else [root / src_rel]
            if not any(m.exists() for m in matches):
                problems.append(f"{rel}:{cp.instruction.line}: COPY source {src} does not exist in the repository")
            elif ignored(src_rel, patterns):
                problems.append(f"{rel}:{cp.instruction.line}: COPY source {src} is excluded by {ignore_file.name}")

    # Non-root final stage.
    final = df.stages[-1]
    users = [i for i in final.instructions if i.keyword == "USER"]
    if not users:
        problems.append(f"{rel}: the final stage sets no USER (it would run as root)")
    else:
        user = users[-1].rest.split(":")[0].strip()
        if user in ("0", "root"):
            problems.append(f"{rel}:{users[-1].line}: the final stage runs as root")

    runs = [i for i in df.instructions if i.keyword == "RUN"]
    if meta is not None:
        pkgs = {p["name"]: p for p in meta["packages"]}
        members = set(meta.get("workspace_members", []))
        bins = {t["name"] for p in meta["packages"] for t in p["targets"] if "bin" in t["kind"]}
        for ins in runs:
            if re.search(r"\bcargo\s+(build|install|rustc)\b", ins.rest):
                for p in re.findall(r"(?<![\w-])-p\s+([A-Za-z0-9_-]+)", ins.rest):
                    if p not in pkgs:
                        problems.append(f"{rel}:{ins.line}: builds package {p}, which is not in the Cargo workspace")
                for b in re.findall(r"--bin\s+([A-Za-z0-9_-]+)", ins.rest):
                    if b not in bins:
                        problems.append(f"{rel}:{ins.line}: builds binary {b}, which is not in the Cargo workspace")
            if re.search(r"\bmaturin\s+(build|develop)\b", ins.rest):
                for manifest in re.findall(r"(?:\s-m|--manifest-path)[\s=]+(\S+)", ins.rest):
                    target = (root / manifest).resolve()
                    pkg = next((p for p in pkgs.values() if Path(p["manifest_path"]).resolve() == target), None)
                    if pkg is None:
                        problems.append(f"{rel}:{ins.line}: maturin builds {manifest}, which is not a package of the Cargo workspace")
                        continue
                    if members and pkg["id"] not in members:
                        problems.append(f"{rel}:{ins.line}: {manifest} is not a workspace member")
                    problems += check_maturin(root, rel, df, target.parent / "pyproject.toml")
        done.append("cargo packages, binaries and maturin manifests are in the workspace")
    elif any(re.search(r"\b(cargo|maturin)\b", i.rest) for i in runs):
        done.append("cargo targets not checked (no cargo metadata)")
    done.append(f"checked {len(df.stages)} stages, {n_copies} COPY sources against the context filter, the final USER")
    return problems, done


def check_maturin(root: Path, rel: Path, df: Dockerfile, pyproject: Path) -> list[str]:
    problems: list[str] = []
    if not pyproject.is_file():
        return [f"{rel}: maturin builds {pyproject.parent.relative_to(root)}, which has no pyproject.toml"]
    project = tomllib.loads(pyproject.read_text())
    requires = project.get("build-system", {}).get("requires", [])
    spec = next((r[len("maturin"):] for r in requires if re.match(r"maturin\b", r)), None)
    pin = df.global_args.get("MATURIN_VERSION")
    if spec is not None and pin:
        ok = satisfies(pin, spec)
        if ok is False:
            problems.append(f"{rel}: MATURIN_VERSION {pin} does not satisfy {pyproject.relative_to(root)}'s maturin{spec}")
        elif ok is None:
            problems.append(f"{rel}: cannot compare MATURIN_VERSION {pin} with maturin{spec}")
    name = project.get("project", {}).get("name")
    if name:
        wheel_prefix = re.sub(r"[-_.]+", "_", name)
        installed = re.findall(r"([A-Za-z0-9_.-]+)-\*\.whl", " ".join(i.rest for i in df.instructions if i.keyword == "RUN"))
        if not installed:
            problems.append(f"{rel}: builds the wheel of {name} but installs no {wheel_prefix}-*.whl")
        for w in installed:
            if w != wheel_prefix:
                problems.append(f"{rel}: installs {w}-*.whl, but the project builds {wheel_prefix}-*.whl")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--cargo-metadata", type=Path, help="`cargo metadata --format-version 1` output")
    args = parser.parse_args()
    root = args.root.resolve()
    meta = json.loads(args.cargo_metadata.read_text()) if args.cargo_metadata else None
    files = sorted(p for p in (root / "deploy").glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
    if not files:
        print("deploy/: no Dockerfile")
        return 1
    failed = False
    for path in files:
        problems, done = check(root, path, meta)
        print(f"   {path.relative_to(root)}: " + "; ".join(done))
        for p in problems:
            print(p)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
