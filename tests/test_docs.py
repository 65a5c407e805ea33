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


# --- every page's tables ---------------------------------------------------------------------
PRINTED = {  # pages whose tables a benchmark prints from their data: the page holds every line
    "benchmarks/head_to_head.md": [   # one process for all (each one imports torch)
        ["head_to_head.py", "--markdown"] + [
            f"docs/{name}.json"
            for name in ("head_to_head_cnn", "head_to_head_lm", "head_to_head_lm_2x2",
                         "head_to_head_cnn_powersgd_2x2", "benchmarks/head_to_head_lm_internet",
                         "benchmarks/head_to_head_lm_internet_6000",
                         "benchmarks/head_to_head_lm_internet_6000_2x2",
                         "benchmarks/head_to_head_lm_internet_10000")]],
    "benchmarks/ddp_parity.md": [
        ["ddp_parity.py", "--markdown", f"docs/benchmarks/{name}.json"]
        for name in ("ddp_parity",)],
    "benchmarks/adasum.md": [
        ["adasum.py", "--markdown"] + [f"docs/benchmarks/adasum_run{i}.json" for i in (1, 2, 3)],
        ["adasum.py", "--markdown"] + [f"docs/benchmarks/adasum_lab_1gbit_run{i}.json"
                                       for i in (1, 2)],
        ["adasum.py", "--markdown"] + [f"docs/benchmarks/adasum_grouped_run{i}.json"
                                       for i in (1, 2, 3)]],
    "benchmarks/end_to_end.md": [
        ["end_to_end.py", "--markdown"] + [f"docs/end_to_end_run{i}.json" for i in (1, 2, 3)]],
}
CELL_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?")
# units a page prints in: percent, ms and us of seconds, MB and MiB of bytes, and so on
UNIT_SCALES = (1.0, 100.0, 1e3, 1e6, 1e-3, 1e-6, 1e-9, 2.0 ** -20, 2.0 ** -30)


@pytest.mark.parametrize("page", sorted(PRINTED))
def test_printed_tables_are_on_their_page(page):
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    for script, *argv in PRINTED[page]:
        printed = subprocess.run(
            [sys.executable, os.path.join(REPO, "benchmarks", script)] +
            [os.path.join(REPO, a) if a.startswith("docs/") else a for a in argv],
            capture_output=True, text=True, check=True, timeout=50).stdout
        lines = [line for line in printed.splitlines() if line.strip()]
        assert len(lines) > 10
        missing = [line for line in lines if line not in text]
        assert not missing, f"docs/{page} lacks what {script} prints: {missing[:3]}"


def _page_data(page, text):
    """The JSON files a page names, by link or by path."""
    found = set()
    for name in set(re.findall(r"[\w/.-]+\.json", text)):
        for base in (os.path.dirname(os.path.join(DOCS, page)), DOCS, REPO):
            path = os.path.normpath(os.path.join(base, name.lstrip("/")))
            if os.path.exists(path):
                found.add(path)
                break
    return found


def _table_numbers(text):
    """Every number in a table's cells after the first column (the first names the row)."""
    rows = [line for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]
    out = []
    for line in rows:
        for cell in line.split("|")[2:]:
            out += [n.lstrip("+") for n in CELL_NUMBER.findall(cell)]
    return out


def _explained(number: str, values, pairs) -> bool:
    """``number`` as printed is a value of the data in some unit, or its inverse, or (``pairs``)
    the ratio or difference of two values (speedups, points against a baseline)."""
    import numpy as np
    decimals = len(number.split(".")[1]) if "." in number else 0
    target, tol = float(number), 10 ** -decimals / 2 + 1e-9
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for scale in UNIT_SCALES:
            for candidates in (values * scale, scale / values):
                if np.any(np.abs(np.round(candidates, decimals) - target) < tol):
                    return True
        if pairs:
            for scale in (1.0, 100.0):
                ratios = np.divide.outer(values, values) * scale
                diffs = np.subtract.outer(values, values) * scale
                if np.any(np.abs(np.round(ratios, decimals) - target) < tol) or np.any(
                        np.abs(np.round(diffs, decimals) - target) < tol):
                    return True
    return False


TABLE_PAGES = sorted(os.path.relpath(os.path.join(root, name), DOCS)
                     for root, _, names in os.walk(DOCS) for name in names
                     if name.endswith(".md")) + ["../README.md"]


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_every_table_figure_is_in_its_data(page):
    """Each number in a page's tables is a value of the data files the page names (in the unit
    printed), or a ratio or difference of two of them; pages whose tables a script prints are
    checked line by line above."""
    import numpy as np
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    data = _page_data(page, text)
    numbers = _table_numbers(text)
    if page in PRINTED or not data or not numbers:
        return   # checked line by line above, or no data named, or no table
    values = []
    for path in data:
        with open(path) as f:
            _numbers(json.load(f), values)
    values = np.array(sorted(set(v for v in values if v == v)), dtype=float)
    pairs = len(values) <= 3000
    unexplained = sorted({n for n in numbers if not _explained(n, values, pairs)})
    assert not unexplained, (f"docs/{page}: table figures found in none of "
                             f"{sorted(os.path.relpath(p, REPO) for p in data)}: {unexplained}")


def test_the_horovod_suite_counts_are_its_records():
    """docs/conformance.md's counts are what the records next to it hold."""
    with open(os.path.join(DOCS, "conformance.md")) as f:
        page = f.read()
    rows = [line.split("|")[1:-1] for line in page.splitlines()
            if line.startswith("| ") and ".log" in line]
    assert len(rows) >= 5
    for backend, ranks, passed, failed, skipped, not_run, record in rows:
        path = re.search(r"\]\(([^)]+\.log)\)", record).group(1)
        first = {}   # a test's result; an error at its teardown comes after it
        with open(os.path.join(DOCS, path)) as f:
            for line in f:
                if line.startswith("test_") and "::" in line:
                    name, result = line.split()[:2]
                    first.setdefault(name, result)
        results = list(first.values())
        counts = [results.count(k) for k in ("PASSED", "FAILED", "SKIPPED")]
        counts.append(119 - len(results))
        printed = [int(c) for c in (passed, failed, skipped, not_run)]
        assert printed == counts, f"{backend.strip()} {ranks.strip()}: page {printed}, record {counts}"
