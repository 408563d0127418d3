"""The plots of docs/benchmarks.md are what scripts/plot-benchmarks.py makes of the figures in
docs/benchmarks-data/: redrawn into a temporary directory, every committed SVG must come out
byte for byte, none may be missing or left over, and each must parse as XML. Needs neither
the extension nor torch: the script is Python's standard library only."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "plot-benchmarks.py"
IMAGES = REPO / "docs" / "images"


def test_committed_plots_are_what_the_data_draws(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True, capture_output=True, timeout=60)
    drawn = sorted(p.name for p in tmp_path.glob("bench-*.svg"))
    committed = sorted(p.name for p in IMAGES.glob("bench-*.svg"))
    assert drawn, "the script drew nothing"
    assert drawn == committed, "run `python3 scripts/plot-benchmarks.py` and commit docs/images/bench-*.svg"
    for name in drawn:
        assert (tmp_path / name).read_bytes() == (IMAGES / name).read_bytes(), (
            f"docs/images/{name} is not what docs/benchmarks-data/ draws: run `python3 scripts/plot-benchmarks.py`"
        )


def test_every_plot_parses_and_is_embedded():
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for path in sorted(IMAGES.glob("bench-*.svg")):
        root = ET.parse(path).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg", path
        assert root.get("viewBox"), path
        assert f"(images/{path.name})" in page, f"docs/benchmarks.md does not show {path.name}"
