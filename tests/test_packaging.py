"""The package stands alone: the wheel builds from pyproject.toml, README.md, LICENSE and mhla_cli/ only,
holds the license, `py.typed` and every module and nothing else (no tests, experiments, benchmarks or
sample data), pins no dependency exactly, and (slow) installs into a fresh virtual environment where
`mhla` runs a generate / featurize / certify / fit / export-heads / compare pipeline away from the source
tree.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "mhla_cli")


def _setuptools_ok() -> bool:
    """Whether the installed setuptools builds this project without build isolation (PEP 639: >= 77)."""
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit()) >= (77, 0)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of only the files a build needs (pip builds in place; not in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheelhouse")
    # Without build isolation (fast, offline) when the installed setuptools is new enough; else pip
    # fetches the build requirements from the package index, as `pip install .` does.
    no_isolation = ["--no-build-isolation"] if _setuptools_ok() else []
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--quiet", "-w", str(out), *no_isolation]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("mhla-*.whl")
    return whl


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(name).decode())


def test_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        assert z.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert "mhla_cli/py.typed" in names
    assert {n.split("/")[0] for n in names} == {"mhla_cli", dist_info}  # no tests/, experiments/, ...
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mhla_cli").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules == {n for n in names if n.endswith(".py")}  # every module (subpackages too), no other
    assert "mhla = mhla_cli.cli:main" in entry_points


def test_wheel_metadata(wheel: Path) -> None:
    meta = _metadata(wheel)
    from mhla_cli import __version__

    assert meta["Name"] == "mhla" and meta["Version"] == __version__
    assert meta["License-Expression"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and not [c for c in classifiers if c.startswith("License ::")]
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("numpy") for r in requires)
    pinned = [r for r in requires if any(op in r.split(";")[0] for op in ("==", "<", "~="))]
    assert not pinned, f"exact or capped pins would downgrade users' packages: {pinned}"
    extras = set(meta.get_all("Provides-Extra"))
    assert {"test", "safetensors", "torch", "dask", "plot", "bench"} <= extras


@pytest.mark.slow
def test_wheel_installs_and_runs_without_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    """A clean venv (no system site-packages): the wheel and its dependencies from the package index."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = tmp_path / "work"
    work.mkdir()

    def mhla(*args: str, code: int = 0) -> str:
        proc = subprocess.run([str(bindir / "mhla"), *args], capture_output=True, text=True, cwd=work, env=env,
                              timeout=300)
        assert proc.returncode == code, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    from mhla_cli import __version__

    assert mhla("--version").strip() == f"mhla {__version__}"
    mhla("generate", "teacher", "-o", "data.h5", "--dim", "3", "--heads", "2", "--n-samples", "300",
         "--seq-len", "8", "--teacher-out", "teacher.h5", "-q")
    mhla("featurize", "data.h5", "-o", "feats.h5", "-q")
    assert "identifiable" in mhla("certify", "feats.h5")
    mhla("fit", "feats.h5", "-o", "model.h5", "-q")
    mhla("export-heads", "model.h5", "-o", "heads.h5", "-q")
    assert "same function" in mhla("compare", "heads.h5", "teacher.h5")
    # safetensors is an extra the plain install lacks: the hint names what to install.
    out = mhla("export-heads", "model.h5", "-o", "heads.safetensors", code=2)
    assert "pip install 'safetensors>=0.4'" in out and "mhla[" not in out
    check = ("import importlib.resources, pathlib, sys, mhla_cli\n"
             "f = pathlib.Path(mhla_cli.__file__).resolve()\n"
             f"assert {str(ROOT)!r} not in str(f), f\n"
             "assert pathlib.Path(sys.prefix).resolve() in f.parents, f\n"
             "assert importlib.resources.files('mhla_cli').joinpath('py.typed').is_file()\n")
    proc = subprocess.run([str(python), "-c", check], capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _readme_block(after: str) -> str:
    """The body of the first fenced block of README.md after the line that contains `after`."""
    text = (ROOT / "README.md").read_text()
    rest = text[text.index(after):]
    start = rest.index("```")
    body = rest[rest.index("\n", start) + 1:]
    return body[:body.index("```")]


def test_ci_runs_the_readme_commands_first() -> None:
    """.ci/run runs the README's install line and test command as written, before it adds torch."""
    install = _readme_block("## Quick start").strip()
    test = _readme_block("<!-- docs-test: skip the test suite itself").strip()
    assert install == 'pip install -e ".[test,dask,plot]"' and test == "python -m pytest -q"
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in lines and test in lines
    torch_line = next(i for i, ln in enumerate(lines) if "pip install" in ln and "torch" in ln)
    assert lines.index(install) < lines.index(test) < torch_line


@pytest.mark.slow
def test_readme_quick_start_on_a_fresh_clone_without_torch(tmp_path: Path) -> None:
    """A copy of the clone, a clean venv, the README's install line as written (no torch), its quick start,
    and the tests that used to fail without torch (convert's .pt refusal, docs/gpu.md's errors)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in (*SOURCES, "sample_data", "tests", "docs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, clone / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(env_dir))

    def sh(script: str, timeout: int = 900) -> str:
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], capture_output=True, text=True,
                              cwd=clone, env=env, timeout=timeout)
        assert proc.returncode == 0, f"{script}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout + proc.stderr

    install = _readme_block("## Quick start")
    assert "pip install" in install and "torch" not in install
    sh(install)
    sh("python -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"torch\") is not None)'")
    out = sh(_readme_block("<!-- docs-test: run id=quick-start"), timeout=300)
    assert "identifiable on the full domain" in out and "same function" in out
    sh('python -m pytest -q -p no:cacheprovider tests/test_convert.py "tests/test_docs.py::test_doc[docs/gpu.md]"',
       timeout=600)


def test_the_version_is_written_once() -> None:
    """mhla_cli/_version.py is the one place: pyproject.toml reads it (dynamic), `mhla --version` prints it,
    and it is the top release of CHANGELOG.md, under the `[Unreleased]` heading."""
    import re

    from mhla_cli import __version__

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mhla_cli._version.__version__"}
    written = [p for p in (ROOT / "mhla_cli").rglob("*.py") if re.search(r"^__version__ = ", p.read_text(), re.M)]
    assert written == [ROOT / "mhla_cli" / "_version.py"]
    proc = subprocess.run([sys.executable, "-m", "mhla_cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"mhla {__version__}\n"
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == ("Unreleased", "")
    version, date = headings[1]
    assert version == __version__ and re.fullmatch(r" - \d{4}-\d{2}-\d{2}", date), headings[1]


def _mypy_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_ci_runs_the_linter_and_the_type_checker() -> None:
    """.ci/run runs `ruff check .` then `mypy` (its settings from pyproject.toml), both from the lint extra."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert 'pip install --quiet -e ".[lint]"' in lines
    assert lines.index('pip install --quiet -e ".[lint]"') < lines.index("ruff check .") < lines.index("mypy")
    tomllib = pytest.importorskip("tomllib")
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lint"]
    assert any(req.startswith("ruff") for req in lint) and any(req.startswith("mypy") for req in lint)


def test_mypy_is_strict_on_the_public_api() -> None:
    """[tool.mypy] checks the package, and the modules that define mhla_cli's public names (and mhla_cli)
    get the strict flags: a new public name's module cannot be left out."""
    import mhla_cli

    config = _mypy_config()
    assert config["files"] == ["mhla_cli"] and config["check_untyped_defs"] and config["warn_unused_ignores"]
    strict = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1
    for flag in ("disallow_untyped_defs", "disallow_incomplete_defs", "warn_return_any", "no_implicit_optional",
                 "strict_equality"):
        assert strict[0][flag] is True, flag
    defining = {getattr(mhla_cli, name).__module__ for name in mhla_cli._EXPORTS}
    assert set(strict[0]["module"]) == defining | {"mhla_cli"}


@pytest.mark.slow
def test_mypy_passes() -> None:
    """`mypy` as .ci/run runs it (minutes: slow)."""
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:]
