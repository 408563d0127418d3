#!/usr/bin/env python3
"""Draws the plots of docs/benchmarks.md from the figures in docs/benchmarks-data/.

    python3 scripts/plot-benchmarks.py                 # writes docs/images/bench-*.svg
    python3 scripts/plot-benchmarks.py --out DIR       # writes them into DIR instead

Python 3's standard library only: each SVG is written by hand, so that the plots can be
redrawn anywhere and compared byte for byte (python/tests/test_benchmark_plots.py checks that
the committed SVGs are what this script makes of the committed data). Every data file is a
CSV with a header comment naming the command, date and conditions of the figures, its
journal section (docs/benchmarks-journal.md), and a ``# caption:`` line drawn under the
plot's title; then ``series,x,y`` rows. A series may repeat an x (several runs): every point
is drawn, and the line becomes a band from the lowest to the highest figure at each x.

Two kinds of chart: ``line`` (numeric x, optionally logarithmic, as message sizes and member
counts are) and ``dots`` (x is a category, ``|`` breaks its label into lines; each run a dot).
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

REPO = Path(__file__).resolve().parents[1]

# Colours that read on a light and on a dark page; the text and axes follow the reader's
# colour scheme through the style sheet below.
BLUE = "#2f7ed8"
ORANGE = "#e8871e"
GREEN = "#2a9d6f"
PURPLE = "#9b59b6"
RED = "#d1495b"
GREY = "#8a8f98"


@dataclass(frozen=True)
class Style:
    colour: str
    dash: str = ""  # an SVG stroke-dasharray; empty: solid
    marker: str = "circle"  # circle, square, triangle, cross
    line: bool = True  # False: points only (targets)


@dataclass
class Chart:
    data: str  # file under docs/benchmarks-data/
    out: str  # file written under docs/images/
    kind: str  # line or dots
    title: str
    xlabel: str
    ylabel: str
    styles: dict[str, Style]
    xlog: bool = False
    ylog: bool = False
    xfmt: str = "number"  # number or bytes
    ref_y: float | None = None  # a labelled horizontal line (parity)
    ref_label: str = ""
    height: int = 430
    legend_columns: int = 2


CHARTS = [
    Chart(
        data="allreduce-vs-peers.csv",
        out="bench-allreduce-vs-peers.svg",
        kind="line",
        title="cohort's allreduce speed-up over Gloo and Open MPI",
        xlabel="message size",
        ylabel="peer's time / cohort's time",
        xlog=True,
        ylog=True,
        xfmt="bytes",
        ref_y=1.0,
        ref_label="parity",
        styles={
            "shared memory vs Open MPI (vader)": Style(ORANGE),
            "shared memory vs Gloo": Style(GREEN),
            "TCP vs Open MPI (TCP)": Style(ORANGE, dash="6 4", marker="square"),
            "TCP vs Gloo": Style(GREEN, dash="6 4", marker="square"),
        },
    ),
    Chart(
        data="allreduce-tcp.csv",
        out="bench-allreduce-tcp.svg",
        kind="line",
        title="Allreduce over loopback TCP",
        xlabel="message size",
        ylabel="time per allreduce, us (lower is better)",
        xlog=True,
        ylog=True,
        xfmt="bytes",
        legend_columns=3,
        styles={
            "cohort, 2 ranks": Style(BLUE),
            "Open MPI, 2 ranks": Style(ORANGE),
            "Gloo, 2 ranks": Style(GREEN),
            "cohort, 4 ranks": Style(BLUE, dash="6 4", marker="square"),
            "Open MPI, 4 ranks": Style(ORANGE, dash="6 4", marker="square"),
            "Gloo, 4 ranks": Style(GREEN, dash="6 4", marker="square"),
        },
    ),
    Chart(
        data="allreduce-shm.csv",
        out="bench-allreduce-shm.svg",
        kind="line",
        title="Allreduce on one host: shared memory",
        xlabel="message size",
        ylabel="time per allreduce, us (lower is better)",
        xlog=True,
        ylog=True,
        xfmt="bytes",
        styles={
            "cohort, 2 ranks": Style(BLUE),
            "Open MPI vader, 2 ranks": Style(ORANGE),
            "cohort, 4 ranks": Style(BLUE, dash="6 4", marker="square"),
            "Open MPI vader, 4 ranks": Style(ORANGE, dash="6 4", marker="square"),
        },
    ),
    Chart(
        data="under-load.csv",
        out="bench-under-load.svg",
        kind="dots",
        title="Allreduce beside two CPU-bound processes",
        xlabel="transport and message size",
        ylabel="time per allreduce, us (lower is better)",
        ylog=True,
        styles={"cohort": Style(BLUE), "Open MPI": Style(ORANGE, marker="square")},
    ),
    Chart(
        data="recovery.csv",
        out="bench-recovery.svg",
        kind="dots",
        title="Recovery from kill -9 mid-allreduce",
        xlabel="from the kill to",
        ylabel="milliseconds",
        ylog=True,
        styles={"p50": Style(BLUE), "p99": Style(PURPLE, marker="square")},
    ),
    Chart(
        data="detection.csv",
        out="bench-detection.svg",
        kind="dots",
        title="Detection of a hung rank: learned against fixed deadlines",
        xlabel="message size x ranks, step interval, transport",
        ylabel="SIGSTOP to a survivor's error, ms",
        styles={"learned": Style(BLUE), "fixed 10 s": Style(GREY, marker="square")},
    ),
    Chart(
        data="scale.csv",
        out="bench-scale.svg",
        kind="line",
        title="Formation, revocation and re-formation by job size",
        xlabel="members",
        ylabel="milliseconds (lower is better)",
        xlog=True,
        ylog=True,
        height=460,
        legend_columns=3,
        styles={
            "formed, etcd": Style(BLUE),
            "formed, memory": Style(BLUE, marker="square", line=False),
            "re-formed, etcd": Style(GREEN),
            "re-formed, memory": Style(GREEN, marker="square", line=False),
            "revoked p99, etcd": Style(RED),
            "revoked p99, memory": Style(RED, marker="square", line=False),
            "targets": Style(GREY, marker="cross", line=False),
        },
    ),
    Chart(
        data="python-steps.csv",
        out="bench-python-steps.svg",
        kind="dots",
        title="Training step from Python: cohort beside gloo",
        xlabel="parallelism and world",
        ylabel="median step, ms (lower is better)",
        styles={"gloo": Style(GREEN, marker="square"), "cohort": Style(BLUE)},
    ),
]

WIDTH = 700
LEFT, RIGHT, TOP = 78, 24, 62
FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
STYLE_SHEET = (
    "text{fill:#24292f;font-family:%s}.axis{stroke:#57606a}.grid{stroke:#d0d7de}"
    "@media (prefers-color-scheme: dark){text{fill:#e6edf3}.axis{stroke:#9198a1}.grid{stroke:#3d444d}}" % FONT
)


def read_data(path: Path) -> tuple[str, list[tuple[str, str, float]]]:
    """The caption and the (series, x, y) rows of one data file."""
    caption = ""
    body = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = line[1:].strip()
            if text.startswith("caption:"):
                caption = text[len("caption:") :].strip()
        elif line.strip():
            body.append(line)
    reader = csv.reader(body)
    header = next(reader)
    if header != ["series", "x", "y"]:
        raise SystemExit(f"{path}: the header must be series,x,y (found {header})")
    rows = [(series, x, float(y)) for series, x, y in reader]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return caption, rows


def num(v: float) -> str:
    """A coordinate: two decimals, no trailing zeros, so that the output is stable."""
    text = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def fmt_bytes(v: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= size:
            return f"{v / size:g} {unit}"
    return f"{v:g} B"


def fmt_number(v: float) -> str:
    if v >= 1000 and v == int(v):
        return f"{int(v):,}"
    return f"{v:g}"


def nice_log_bounds(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Bounds on the 1-2-5 sequence around [lo, hi], and the ticks between them: every 1-2-5
    value when that makes at most 10, else the powers of ten."""
    steps = [m * 10**e for e in range(-3, 9) for m in (1, 2, 5)]
    lower = max(s for s in steps if s <= lo / 1.15)  # a margin, so that no point sits on the axis
    upper = min(s for s in steps if s >= hi * 1.05)
    ticks = [s for s in steps if lower <= s <= upper]
    if len(ticks) > 10:
        lower, upper = 10 ** math.floor(math.log10(lower) + 1e-9), 10 ** math.ceil(math.log10(upper) - 1e-9)
        ticks = [s for s in steps if lower <= s <= upper and s == 10 ** round(math.log10(s))]
    return lower, upper, ticks


def nice_linear_bounds(hi: float) -> tuple[float, float, list[float]]:
    """0 to a rounded maximum, in 4 to 8 steps of 1, 2 or 5 times a power of ten."""
    for e in range(-3, 9):
        for m in (1, 2, 5):
            step = m * 10**e
            if hi / step <= 8:
                upper = math.ceil(hi / step - 1e-9) * step
                count = round(upper / step)
                return 0.0, upper, [i * step for i in range(count + 1)]
    raise ValueError(hi)


class Axis:
    def __init__(self, lo: float, hi: float, log: bool, start: float, end: float):
        self.lo, self.hi, self.log, self.start, self.end = lo, hi, log, start, end

    def __call__(self, v: float) -> float:
        if self.log:
            t = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            t = (v - self.lo) / (self.hi - self.lo)
        return self.start + t * (self.end - self.start)


def marker(shape: str, x: float, y: float, colour: str, hollow: bool = False) -> str:
    fill = "none" if hollow else colour
    common = f'fill="{fill}" stroke="{colour}" stroke-width="1.5"'
    if shape == "square":
        return f'<rect x="{num(x - 4)}" y="{num(y - 4)}" width="8" height="8" {common}/>'
    if shape == "triangle":
        pts = f"{num(x)},{num(y - 5)} {num(x + 5)},{num(y + 4)} {num(x - 5)},{num(y + 4)}"
        return f'<polygon points="{pts}" {common}/>'
    if shape == "cross":
        d = f"M{num(x - 5)} {num(y - 5)}L{num(x + 5)} {num(y + 5)}M{num(x - 5)} {num(y + 5)}L{num(x + 5)} {num(y - 5)}"
        return f'<path d="{d}" stroke="{colour}" stroke-width="2.5" fill="none"/>'
    return f'<circle cx="{num(x)}" cy="{num(y)}" r="4" {common}/>'


def text(x: float, y: float, content: str, size: int = 12, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{num(x)}" y="{num(y)}" font-size="{size}" text-anchor="{anchor}"{extra}>{escape(content)}</text>'


def legend(chart: Chart, names: list[str], top: float) -> tuple[list[str], float]:
    """The legend's elements below the plot, and the height it takes."""
    cols = chart.legend_columns
    col_width = (WIDTH - LEFT - RIGHT) / cols
    out = []
    for i, name in enumerate(names):
        style = chart.styles[name]
        x = LEFT + (i % cols) * col_width
        y = top + (i // cols) * 20
        if style.line and chart.kind == "line":
            dash = f' stroke-dasharray="{style.dash}"' if style.dash else ""
            out.append(
                f'<line x1="{num(x)}" y1="{num(y)}" x2="{num(x + 28)}" y2="{num(y)}" stroke="{style.colour}"'
                f' stroke-width="2"{dash}/>'
            )
        out.append(marker(style.marker, x + 14, y, style.colour, hollow=chart.kind == "dots"))
        out.append(text(x + 36, y + 4, name, 12, "start"))
    rows = math.ceil(len(names) / cols)
    return out, rows * 20


def series_names(chart: Chart, rows) -> list[str]:
    names = []
    for series, _, _ in rows:
        if series not in chart.styles:
            raise SystemExit(f"{chart.data}: series {series!r} has no style in scripts/plot-benchmarks.py")
        if series not in names:
            names.append(series)
    return names


def draw(chart: Chart, data_dir: Path) -> str:
    caption, rows = read_data(data_dir / chart.data)
    names = series_names(chart, rows)
    legend_top = chart.height + 14
    legend_parts, legend_height = legend(chart, names, legend_top)
    height = legend_top + legend_height + 4
    bottom_of_plot = chart.height - 70
    parts = []

    ys = [y for _, _, y in rows] + ([chart.ref_y] if chart.ref_y is not None else [])
    if chart.ylog:
        ylo, yhi, yticks = nice_log_bounds(min(ys), max(ys))
    else:
        ylo, yhi, yticks = nice_linear_bounds(max(ys))
    yaxis = Axis(ylo, yhi, chart.ylog, bottom_of_plot, TOP)

    if chart.kind == "line":
        xs = sorted({float(x) for _, x, _ in rows})
        if chart.xlog:
            pad = (math.log10(xs[-1]) - math.log10(xs[0])) * 0.06 or 0.3
            xlo, xhi = 10 ** (math.log10(xs[0]) - pad), 10 ** (math.log10(xs[-1]) + pad)
        else:
            pad = (xs[-1] - xs[0]) * 0.06 or 1
            xlo, xhi = xs[0] - pad, xs[-1] + pad
        xaxis = Axis(xlo, xhi, chart.xlog, LEFT, WIDTH - RIGHT)
        xticks = [(xaxis(x), fmt_bytes(x) if chart.xfmt == "bytes" else fmt_number(x)) for x in xs]
        categories = []
    else:
        categories = []
        for _, x, _ in rows:
            if x not in categories:
                categories.append(x)
        span = (WIDTH - LEFT - RIGHT) / len(categories)
        xticks = [(LEFT + span * (i + 0.5), c) for i, c in enumerate(categories)]

    # Grid and axes.
    for v in yticks:
        y = yaxis(v)
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{num(y)}" x2="{WIDTH - RIGHT}" y2="{num(y)}"/>')
        parts.append(text(LEFT - 8, y + 4, fmt_number(v), 11, "end"))
    for x, label in xticks:
        if chart.kind == "line":
            parts.append(f'<line class="grid" x1="{num(x)}" y1="{TOP}" x2="{num(x)}" y2="{num(bottom_of_plot)}"/>')
        for i, piece in enumerate(label.split("|")):
            parts.append(text(x, bottom_of_plot + 18 + 14 * i, piece, 11))
    parts.append(
        f'<path class="axis" d="M{LEFT} {TOP}V{num(bottom_of_plot)}H{WIDTH - RIGHT}" fill="none" stroke-width="1"/>'
    )
    if chart.ref_y is not None:
        y = yaxis(chart.ref_y)
        parts.append(
            f'<line class="axis" x1="{LEFT}" y1="{num(y)}" x2="{WIDTH - RIGHT}" y2="{num(y)}"'
            ' stroke-width="1.5" stroke-dasharray="2 3"/>'
        )
        parts.append(text(LEFT + 6, y + 14, chart.ref_label, 11, "start"))

    # The figures.
    if chart.kind == "line":
        for name in names:
            style = chart.styles[name]
            points: dict[float, list[float]] = {}
            for series, x, y in rows:
                if series == name:
                    points.setdefault(float(x), []).append(y)
            order = sorted(points)
            if style.line and len(order) > 1:
                low = [(xaxis(x), yaxis(min(points[x]))) for x in order]
                high = [(xaxis(x), yaxis(max(points[x]))) for x in order]
                dash = f' stroke-dasharray="{style.dash}"' if style.dash else ""
                if low != high:
                    band = " ".join(f"{num(px)},{num(py)}" for px, py in high + low[::-1])
                    parts.append(f'<polygon points="{band}" fill="{style.colour}" fill-opacity="0.15" stroke="none"/>')
                for edge in (low, high) if low != high else (low,):
                    pts = " ".join(f"{num(px)},{num(py)}" for px, py in edge)
                    parts.append(
                        f'<polyline points="{pts}" fill="none" stroke="{style.colour}" stroke-width="2"{dash}/>'
                    )
            for x in order:
                for y in points[x]:
                    parts.append(marker(style.marker, xaxis(x), yaxis(y), style.colour))
    else:
        span = (WIDTH - LEFT - RIGHT) / len(categories)
        group = min(span * 0.7, 28.0 * len(names))
        for s, name in enumerate(names):
            style = chart.styles[name]
            offset = (s + 0.5) / len(names) * group - group / 2
            for c, category in enumerate(categories):
                values = [y for series, x, y in rows if series == name and x == category]
                centre = LEFT + span * (c + 0.5) + offset
                for i, y in enumerate(values):
                    spread = (i - (len(values) - 1) / 2) * 3
                    parts.append(marker(style.marker, centre + spread, yaxis(y), style.colour, hollow=True))

    # Titles and legend.
    middle = (TOP + bottom_of_plot) / 2
    head = [
        text(LEFT, 24, chart.title, 16, "start", ' font-weight="600"'),
        text(LEFT, 44, caption, 11, "start"),
        text(18, middle, chart.ylabel, 12, "middle", f' transform="rotate(-90 18 {num(middle)})"'),
        text((LEFT + WIDTH - RIGHT) / 2, bottom_of_plot + 56, chart.xlabel, 12),
    ]
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}"'
        f' role="img" aria-label={quoteattr(chart.title)}>',
        f"<title>{escape(chart.title)}</title>",
        f"<style>{STYLE_SHEET}</style>",
        *head,
        *parts,
        *legend_parts,
        "</svg>",
    ]
    return "\n".join(svg) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "docs" / "benchmarks-data", help="the CSV files")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="where the SVGs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for chart in CHARTS:
        path = args.out / chart.out
        path.write_text(draw(chart, args.data), encoding="utf-8", newline="\n")
        print(path)


if __name__ == "__main__":
    main()
