"""The published figures come from data: every ratio and percentage in docs/choosing_an_op.md's
table against the papers is a value (as printed, rounded) of a JSON file that its row names, the
page's time-to-target tables are what benchmarks/choosing.py prints from the head-to-head data,
and docs/scale.md's tables are what the scale benchmarks print from the JSON files the page
names."""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.timeout(60)

DOCS = os.path.join(REPO, "docs")
# "5.7x", "1.10-1.25x", "88.71%", "+1.72": a figure is a number with a unit, or a range of them
FIGURE = re.compile(r"(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?\s*(x|%)")


def _numbers(node, out):
    if isinstance(node, bool):
        return
    if isinstance(node, (int, float)):
        out.append(float(node))
    elif isinstance(node, dict):
        for value in node.values():
            _numbers(value, out)
    elif isinstance(node, list):
        for value in node:
            _numbers(value, out)


def _data_values(paths):
    values = []
    for path in paths:
        with open(os.path.join(REPO, path)) as f:
            _numbers(json.load(f), values)
    return values


def _headline_figures():
    with open(os.path.join(DOCS, "choosing_an_op.md")) as f:
        text = f.read()
    table = text.split("## Against the papers")[1].split("\n\n")[2]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert rows, "no headline table found"
    figures = []
    for row in rows:
        cells = row.split("|")
        claim, measured, where = cells[1].strip(), cells[2], cells[3]
        sources = ["docs/" + path for path in re.findall(r"\]\(([\w/.-]+\.json)\)", where)]
        assert sources, f"the headline row {claim!r} names no data file"
        for low, high, unit in FIGURE.findall(measured):
            for number in (low, high):
                if number:
                    figures.append((number, unit, claim, tuple(sources)))
    return figures


def _matches(number: str, unit: str, value: float) -> bool:
    decimals = len(number.split(".")[1]) if "." in number else 0
    target = float(number)
    candidates = [value, 100 * value] if unit == "%" else [value]
    # ratios may be printed from either side (fewer bytes: baseline / method)
    if unit == "x" and value:
        candidates.append(1 / value)
    return any(abs(round(c, decimals) - target) < 10 ** -decimals / 2 + 1e-9 for c in candidates)


def test_every_headline_figure_is_in_the_data():
    figures = _headline_figures()
    assert len(figures) >= 10
    missing = [(number + unit, claim, sources) for number, unit, claim, sources in figures
               if not any(_matches(number, unit, v) for v in _data_values(sources))]
    assert not missing, f"headline figures with no value behind them in their data: {missing}"


def test_the_choosing_page_shows_what_its_script_prints():
    with open(os.path.join(DOCS, "choosing_an_op.md")) as f:
        page = f.read()
    printed = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "choosing.py")],
                             capture_output=True, text=True, check=True, timeout=50).stdout
    lines = [line for line in printed.splitlines() if line.strip()]
    assert len(lines) > 30
    missing = [line for line in lines if line not in page]
    assert not missing, f"docs/choosing_an_op.md lacks what choosing.py prints: {missing[:3]}"


@pytest.mark.parametrize("script,data", [("scale_validation.py", "docs/scale/validation.json"),
                                         ("scale_curves.py", "docs/scale/curves.json")])
def test_the_scale_page_shows_its_data(script, data):
    with open(os.path.join(DOCS, "scale.md")) as f:
        page = f.read()
    assert data in page or data.replace("docs/", "") in page
    printed = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script),
                              "--markdown", os.path.join(REPO, data)],
                             capture_output=True, text=True, check=True, timeout=50).stdout
    lines = [line for line in printed.splitlines() if line.strip()]
    assert len(lines) > 10
    missing = [line for line in lines if line not in page]
    assert not missing, f"docs/scale.md lacks what {script} prints from {data}: {missing[:3]}"


def test_the_scale_validation_meets_its_bar():
    """At least 30 lab points, the median absolute error at most 15%, as docs/scale.md says."""
    with open(os.path.join(DOCS, "scale", "validation.json")) as f:
        report = json.load(f)
    summary = report["summary"]["all"]
    assert summary["points"] == len(report["rows"]) >= 30
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in report["rows"]]
    assert summary["median_abs_error"] == pytest.approx(statistics.median(errors), abs=1e-12)
    assert summary["median_abs_error"] <= 0.15
