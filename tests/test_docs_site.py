"""The documentation site builds, with warnings as errors, and covers the public API: every
public callable of ``horovod_ext.torch`` has a docstring and a place in docs/reference.md, and
every link in README.md leads to a file of the repository."""
import inspect
import os
import re
import subprocess
import sys

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.timeout(180)


def _public_api():
    import horovod_ext.torch as hvd
    return {name: getattr(hvd, name) for name in dir(hvd)
            if not name.startswith("_") and not inspect.ismodule(getattr(hvd, name))}


def _doc(obj) -> str:
    # an op such as hvd.Adasum is an instance: its class says what it is
    own = obj.__doc__ if (inspect.isroutine(obj) or inspect.isclass(obj)) else type(obj).__doc__
    return (own or "").strip()


def test_every_public_callable_has_a_docstring():
    missing = sorted(name for name, obj in _public_api().items() if not _doc(obj))
    assert not missing, f"public names of horovod_ext.torch without a docstring: {missing}"


def test_every_public_name_is_in_the_reference():
    with open(os.path.join(REPO, "docs", "reference.md")) as f:
        text = f.read()
    listed = set(re.findall(r"^::: horovod_ext\.torch\.(\w+)$", text, re.M))
    mentioned = set(re.findall(r"`hvd\.(\w+)", text))
    missing = sorted(set(_public_api()) - listed - mentioned)
    assert not missing, f"public names of horovod_ext.torch missing from docs/reference.md: {missing}"


def test_readme_links_lead_to_files():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links to no page"
    broken = [t for t in local if not os.path.exists(os.path.join(REPO, t))]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_site_builds_strictly(tmp_path):
    """mkdocs.yml sets strict mode and turns a page missing from the navigation, a broken link
    or anchor and an unrecognised link into warnings, so any of them fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    reference = (tmp_path / "site" / "reference.html").read_text()
    # the API reference was generated from the docstrings, not left as directives
    assert "::: horovod_ext" not in reference
    assert "This process's rank in the job" in reference
