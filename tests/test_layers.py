"""The package's layers (docs/architecture.md), checked by import-linter from pyproject.toml:
backends < algorithms < ops < engine < torch API, planning < launch, each importing only the
layers below it, and the launcher importing no torch when it loads."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def _lint(cwd, config=None):
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    cmd = [exe, "--no-cache"] + (["--config", config] if config else [])
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, PYTHONPATH=cwd))


def test_no_module_imports_a_layer_above_its_own():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout and "broken" not in out.stdout.replace("0 broken", "")


def test_an_upward_import_fails_the_check(tmp_path):
    """The same contract over a copy of the package with one upward import added (an op that
    imports the engine) is reported broken, naming the import."""
    import shutil
    root = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "horovod_ext"), root / "horovod_ext",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), root / "pyproject.toml")
    with open(root / "horovod_ext" / "ops" / "adasum.py", "a") as f:
        f.write("\nfrom horovod_ext.engine import runtime  # noqa\n")
    out = _lint(str(root))
    assert out.returncode != 0
    assert "horovod_ext.ops.adasum -> horovod_ext.engine" in out.stdout, out.stdout


def test_the_launcher_loads_without_torch():
    probe = ("import sys, horovod_ext.launch.run, horovod_ext.launch.elastic, "
             "horovod_ext.launch.api, horovod_ext.launch.supervise; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


MODULE_LINES, FUNCTION_LINES = 400, 60


def _long_ok(lines, lineno) -> bool:
    """A ``# long:`` comment on the definition's line or the line above states why it is long."""
    return any("# long:" in lines[i] for i in (lineno - 2, lineno - 1) if 0 <= i < len(lines))


def test_modules_and_functions_stay_short():
    """Every module of the package under 400 lines and every function under 60, unless a
    ``# long:`` comment beside it (on the module's first statement for a module) says why."""
    import ast
    too_long = []
    for folder, _, files in os.walk(os.path.join(REPO, "horovod_ext")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                source = f.read()
            lines = source.split("\n")
            rel = os.path.relpath(path, REPO)
            if source.count("\n") > MODULE_LINES and "\n# long:" not in source:
                too_long.append(f"{rel}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > FUNCTION_LINES and not _long_ok(lines, node.lineno):
                        too_long.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "over the limit with no '# long:' reason: " + "; ".join(too_long)
