"""The repository's layout rules, as tests.

1. No import cycles among the modules of `mhla_cli`, counting imports made inside functions (a lazy
   import still runs the imported module's top level, and one added later at the top turns the cycle
   into an ImportError). Graph: `import a.b` is an edge to the deepest of a, a.b that is a module of
   the package; `from X import n` to X.n when that is a module, else to X (a package's `__init__`
   is a module like any other, so importing a name re-exported by a package is an edge into it).
   Imports under `if TYPE_CHECKING:` count too. A module's parent packages, which Python imports
   first, are not edges.
2. One `tests/test_<module>.py` per library module, and it imports that module (directly, or a
   name the module defines through a re-export such as `from mhla_cli import fit`):
   - a library module is `mhla_cli/<name>.py` with `<name>` not starting with `_`;
   - a subpackage `mhla_cli/<pkg>/` (e.g. `lowrank`) is one library module: `tests/test_<pkg>.py`
     (its modules are one job split in files behind the package's `__init__`, which re-exports them);
     a subpackage whose `__init__` imports nothing (e.g. `statistics/storage`) is a folder: each of its
     public modules is a library module;
   - `mhla_cli/cli/` is the command layer, not a library module: it only parses options, calls the
     library and formats output, and is tested through `run([...])` by `tests/test_cli.py` and the
     library modules' test files; it needs `tests/test_cli.py` only;
   - private modules (`_version.py`, `_torch.py`, `lowrank/_*.py`) and `__init__.py` / `__main__.py`
     are parts of the module or package that imports them and are tested through it;
   - `TESTED_THROUGH_CLI` lists the modules whose test file exercises them through the commands only.
3. The README points at nothing outside the repository: relative links and paths stay inside it (no
   `../shared/...`); relative links of the README and docs/ resolve to files of the repository.
4. No install instruction (README, docs, error hints, scripts) tells users to `pip install mhla`
   from a package index while no release is published; the library's hints name the optional package
   itself, with the same requirement as pyproject's extra.
5. Every package's `__init__` docstring maps its modules: one line ``- `name`: what it does`` for each
   module and subpackage in its directory (private ones too; not `__init__` / `__main__`), and no line
   for a name that is not there.
6. No module over MAX_MODULE_LINES lines and no function (or method, or typer command with its option
   signature and help) over MAX_FUNCTION_LINES lines, from its `def` to its last line.
7. The library layers (every module outside `mhla_cli/cli/`) name no option of the command line in their
   string literals (docstrings apart): an error of the library says what is wrong and carries a
   machine-readable remedy (a rule, a cause, a subclass), and the CLI words it in its options.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mhla_cli"

# Library modules whose test file runs them through the CLI only, never importing them (none today:
# test_probes.py tests mhla_cli.solve.probes directly too).
TESTED_THROUGH_CLI: set[str] = set()


# ---------------------------------------------------------------------------------------------------
# 1. import cycles


def _module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under package_dir (a package's name for __init__)."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body, functions included)."""
    files = _module_files(package_dir)
    packages = {m for m, p in files.items() if p.name == "__init__.py"}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if mod in packages else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    stem = f"{base}.{node.module}" if node.module else base
                else:
                    stem = node.module or ""
                for alias in node.names:
                    sub = f"{stem}.{alias.name}"
                    targets.append(sub if sub in files else resolve(stem))
            for t in targets:
                if t is not None and t != mod:
                    edges[mod].add(t)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_no_import_cycles() -> None:
    edges = import_graph(PACKAGE)
    assert "mhla_cli.statistics.stream" in edges and "mhla_cli.solve.lowrank.fewest" in edges and "mhla_cli.cli.fit" in edges
    assert sum(map(len, edges.values())) > 50  # the graph is not vacuous
    cycles = import_cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from .a import f  # lazy: still a cycle\n    return f\n",
        "pkg/c.py": "import pkg.a\n",
    })
    edges = import_graph(pkg)
    assert edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert import_cycles(edges) == [["pkg.a", "pkg.b"]]
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert import_cycles(import_graph(pkg)) == []


def test_relative_imports_and_packages_resolve(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "from .sub import h\nfrom .a import f\n",
        "pkg/a.py": "from . import b\nimport numpy\nfrom .sub.deep import x\n\ndef f():\n    return b\n",
        "pkg/b.py": "from .sub.deep import *\nfrom pkg.sub import deep as d\n",
        "pkg/sub/__init__.py": "def h():\n    from ..a import f  # through the package's __init__\n    return f\n",
        "pkg/sub/deep.py": "from ..b import y\n",  # level 2 -> pkg.b
        "pkg/sub/leaf.py": "from .. import f\n",  # a name re-exported by pkg/__init__: an edge into it
    })
    edges = import_graph(pkg)
    assert edges == {
        "pkg": {"pkg.sub", "pkg.a"},
        "pkg.a": {"pkg.b", "pkg.sub.deep"},
        "pkg.b": {"pkg.sub.deep"},
        "pkg.sub": {"pkg.a"},
        "pkg.sub.deep": {"pkg.b"},
        "pkg.sub.leaf": {"pkg"},
    }
    # pkg -> pkg.sub -> pkg.a -> pkg.b <-> pkg.sub.deep; nothing leads back to pkg (pkg.sub.leaf is a leaf).
    assert import_cycles(edges) == [["pkg.b", "pkg.sub.deep"]]
    # A submodule importing a name from its package, which imports the submodule: a cycle.
    (pkg / "sub" / "deep.py").write_text("from .. import f\n")
    assert import_cycles(import_graph(pkg)) == [["pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.deep"]]


# ---------------------------------------------------------------------------------------------------
# 2. one test module per library module


# The layer subpackages, lowest first: a module imports only from its own layer or a lower one. The base is
# the package's top-level modules (errors, numerics, signals, the cubic feature map); the package's own
# `__init__` (the lazy public API) and `__main__` stand above every layer, with cli.
LAYERS = ("linalg", "io", "statistics", "model", "solve", "api", "cli")


def layer_of(module: str, package: str = "mhla_cli") -> int:
    """0 for the base modules, 1 + the index in LAYERS for a layer's modules, len(LAYERS) + 1 for the top."""
    parts = module.split(".")
    if parts == [package] or parts[1:] == ["__main__"]:
        return len(LAYERS) + 1
    if len(parts) > 2 or parts[1] in LAYERS:
        return 1 + LAYERS.index(parts[1])
    return 0


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """The imports that run from a lower layer to a higher one."""
    return sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs if layer_of(b) > layer_of(a))


def test_no_import_runs_up_the_layers() -> None:
    edges = import_graph(PACKAGE)
    assert {p.parent.name for p in PACKAGE.glob("*/__init__.py")} >= set(LAYERS), "a layer has no package"
    layers_seen = {layer_of(m) for m in edges}
    assert layers_seen == set(range(len(LAYERS) + 2)), layers_seen
    bad = upward_imports(edges)
    assert not bad, "imports from a lower layer to a higher one: " + "; ".join(bad)


def test_upward_import_is_found() -> None:
    assert upward_imports({"mhla_cli.io.formats": {"mhla_cli.model.heads", "mhla_cli.errors"}}) == [
        "mhla_cli.io.formats -> mhla_cli.model.heads"]
    assert upward_imports({"mhla_cli.errors": {"mhla_cli.linalg.device"}}) == ["mhla_cli.errors -> mhla_cli.linalg.device"]
    assert upward_imports({"mhla_cli.solve.lowrank.cv": {"mhla_cli.solve.lstsq", "mhla_cli.model.heads"}}) == []
    assert upward_imports({"mhla_cli.cli.fit": {"mhla_cli.api.learn"}, "mhla_cli": {"mhla_cli.cli"}}) == []


def _is_folder(init: Path) -> bool:
    """A subpackage whose `__init__` imports nothing is a folder of modules (e.g. statistics/storage), each one a
    library module; one that imports its parts (e.g. solve/lowrank) is one module split in files."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return not any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


def library_modules(package_dir: Path = PACKAGE) -> list[str]:
    """The dotted modules that need a tests/test_<leaf>.py: the public modules of the package and of its layer
    subpackages; any other subpackage (e.g. solve/lowrank) is one module; cli is the command layer."""
    pkg = package_dir.name

    def collect(directory: Path, prefix: str, layered: bool) -> list[str]:
        names = [f"{prefix}.{p.stem}" for p in directory.glob("*.py") if not p.stem.startswith("_")]
        for sub in directory.glob("*/__init__.py"):
            name = sub.parent.name
            if name == "cli" or name.startswith("_"):
                continue
            if layered and name in LAYERS or _is_folder(sub):
                names += collect(sub.parent, f"{prefix}.{name}", False)
            else:
                names.append(f"{prefix}.{name}")
        return names

    return sorted(collect(package_dir, pkg, True))


def _reexports(package_dir: Path) -> dict[str, str]:
    """Name -> dotted module for the names the package's __init__ imports from its own modules."""
    out = {}
    tree = ast.parse((package_dir / "__init__.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # also the lazy names' imports under `if TYPE_CHECKING:`
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{package_dir.name}.{node.module}"
    return out


def _modules_imported(test_file: Path, package: str, reexports: dict[str, str]) -> set[str]:
    """The dotted names of the package a test file imports (a module, or the module that defines a name)."""
    found = set()
    tree = ast.parse(test_file.read_text(encoding="utf-8"))
    as_module = False  # `import mhla_cli`: then `mhla_cli.fit(...)` uses learn's fit
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package and alias.name != package:
                    found.add(alias.name)
                as_module |= alias.name == package and alias.asname is None
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != package:
                continue
            for alias in node.names:
                if node.module == package:
                    found.add(reexports.get(alias.name, f"{package}.{alias.name}"))
                else:
                    found.add(f"{node.module}.{alias.name}")  # a submodule, or a name: both lie under node.module
    if as_module:
        found |= {reexports.get(node.attr, f"{package}.{node.attr}") for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == package}
    return found


def _imports_module(found: set[str], module: str) -> bool:
    return any(name == module or name.startswith(module + ".") for name in found)


def test_one_test_module_per_library_module() -> None:
    modules = library_modules()
    leaves = [m.rpartition(".")[2] for m in modules]
    assert {"mhla_cli.statistics.stream", "mhla_cli.solve.certificate", "mhla_cli.solve.lowrank",
            "mhla_cli.io.formats"} <= set(modules) and not any(".cli" in m for m in modules)
    assert len(set(leaves)) == len(leaves), "two library modules share a name (their tests would share a file)"
    reexports = _reexports(PACKAGE)
    missing, not_importing = [], []
    for module, name in zip(modules, leaves):
        test_file = ROOT / "tests" / f"test_{name}.py"
        if not test_file.is_file():
            missing.append(f"tests/test_{name}.py")
        elif name not in TESTED_THROUGH_CLI and not _imports_module(_modules_imported(test_file, "mhla_cli", reexports),
                                                                    module):
            not_importing.append(f"tests/test_{name}.py (never imports {module})")
    assert (ROOT / "tests" / "test_cli.py").is_file()
    assert not missing, "library modules without a test module: " + ", ".join(missing)
    assert not not_importing, ", ".join(not_importing)
    stale = sorted(TESTED_THROUGH_CLI - set(leaves))
    assert not stale, f"TESTED_THROUGH_CLI names modules that no longer exist: {stale}"


def test_library_modules_rule_on_a_synthetic_package(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "from .alpha import a\nfrom .io.fmt import w\n", "pkg/__main__.py": "", "pkg/_private.py": "",
        "pkg/alpha.py": "", "pkg/beta.py": "", "pkg/cli/__init__.py": "", "pkg/cli/opts.py": "",
        "pkg/sub/__init__.py": "from .part import z\n", "pkg/sub/part.py": "", "pkg/_hidden/__init__.py": "",
        "pkg/io/__init__.py": "", "pkg/io/fmt.py": "", "pkg/io/_raw.py": "",
        "pkg/io/inner/__init__.py": "from .x import y\n", "pkg/io/inner/x.py": "",
        "pkg/io/folder/__init__.py": '"""A folder."""\n', "pkg/io/folder/one.py": "", "pkg/io/folder/_two.py": "",
    })
    assert library_modules(pkg) == ["pkg.alpha", "pkg.beta", "pkg.io.fmt", "pkg.io.folder.one", "pkg.io.inner", "pkg.sub"]
    rx = _reexports(pkg)
    assert rx == {"a": "pkg.alpha", "w": "pkg.io.fmt"}
    test = tmp_path / "test_alpha.py"
    test.write_text("import pkg.beta\nfrom pkg import a\nfrom pkg.sub.part import z\n\ndef f():\n"
                    "    from pkg import cli\n")
    found = _modules_imported(test, "pkg", rx)
    assert found == {"pkg.alpha", "pkg.beta", "pkg.sub.part.z", "pkg.cli"}
    assert _imports_module(found, "pkg.sub") and not _imports_module(found, "pkg.io.fmt")
    test.write_text("import pkg\n\ndef test():\n    pkg.w()\n")
    assert _imports_module(_modules_imported(test, "pkg", rx), "pkg.io.fmt")
    test.write_text("from pkg.io import fmt\n")
    assert _imports_module(_modules_imported(test, "pkg", rx), "pkg.io.fmt")
    assert not _imports_module(_modules_imported(test, "pkg", rx), "pkg.io.inner")
    test.write_text("import numpy\nfrom pkg.cli import run\n\ndef test():\n    run(['beta'])\n")
    assert _modules_imported(test, "pkg", rx) == {"pkg.cli.run"}


# ---------------------------------------------------------------------------------------------------
# 3. nothing outside the repository


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_UPWARD = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.$-][\w./$-]*)")


def outside_references(md: Path, root: Path = ROOT) -> list[str]:
    """Relative paths in a markdown file that leave the repository, and relative links to no file."""
    text = md.read_text(encoding="utf-8")
    bad = []
    for path in _UPWARD.findall(text):
        target = (md.parent / path).resolve()
        if not target.is_relative_to(root.resolve()):
            bad.append(f"{md.name}: {path} (outside the repository)")
    for link in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL or an anchor
        target = (md.parent / link.split("#")[0]).resolve()
        if not target.is_relative_to(root.resolve()):
            bad.append(f"{md.name}: link {link} (outside the repository)")
        elif not target.exists():
            bad.append(f"{md.name}: link {link} (no such file)")
    return sorted(set(bad))


def test_readme_points_at_nothing_outside_the_repository() -> None:
    bad = outside_references(ROOT / "README.md")
    assert not bad, "; ".join(bad)


def test_docs_links_stay_inside_the_repository() -> None:
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs
    bad = [b for md in docs for b in outside_references(md)]
    assert not bad, "; ".join(bad)


# a markdown file named in code or a comment: docs/x.md, README.md, CHANGELOG.md, or a bare NAME.md
_MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")


def missing_markdown(py: Path, root: Path = ROOT) -> list[str]:
    """The markdown files a Python file names that the repository does not hold (a bare name is looked for at
    the root and in docs/)."""
    bad = []
    for name in sorted(set(_MD_NAME.findall(py.read_text(encoding="utf-8")))):
        places = [root / name] if "/" in name else [root / name, root / "docs" / name]
        if not any(p.exists() for p in places):
            bad.append(f"{py.relative_to(root)}: {name}")
    return bad


def test_code_cites_only_files_of_the_repository() -> None:
    synthetic = {"test_layout.py", "test_docs.py"}  # they name files of the trees they build
    files = [p for folder in ("mhla_cli", "tests", "benchmarks", "examples", "experiments")
             for p in sorted((ROOT / folder).rglob("*.py")) if p.name not in synthetic]
    bad = [b for py in files for b in missing_markdown(py)]
    assert not bad, "; ".join(bad)


def test_missing_markdown_on_a_synthetic_tree(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x")
    (tmp_path / "README.md").write_text("x")
    py = tmp_path / "m.py"
    py.write_text('"""See docs/a.md, a.md, README.md, docs/b.md and NOTES.md."""\n')
    assert missing_markdown(py, tmp_path) == ["m.py: NOTES.md", "m.py: docs/b.md"]


def test_outside_references_on_a_synthetic_tree(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x")
    readme = tmp_path / "README.md"
    readme.write_text("[a](docs/a.md) [b](docs/b.md) [w](https://example.org/x) [s](#sec)\n"
                      "run `python ../shared/tools/import_cycles.py` and see [t](../tools/t.py)\n")
    assert outside_references(readme, tmp_path) == [
        "README.md: ../shared/tools/import_cycles.py (outside the repository)",
        "README.md: ../tools/t.py (outside the repository)",
        "README.md: link ../tools/t.py (outside the repository)",
        "README.md: link docs/b.md (no such file)",
    ]
    doc = tmp_path / "docs" / "c.md"
    doc.write_text("[readme](../README.md), `../docs/a.md`\n")
    assert outside_references(doc, tmp_path) == []


# ---------------------------------------------------------------------------------------------------
# 4. no `pip install mhla` while no release exists


# `pip install mhla`, `pip install 'mhla[dask]'`, `pip install -U "mhla[plot]"`; not `pip install -e .`, a wheel's
# path, or a direct reference (`pip install "mhla[dask] @ git+https://..."`).
_FROM_INDEX = re.compile(r"""pip install(?:\s+-{1,2}[\w-]+)*\s+['"]?mhla\b(?![_-]|\S*\s*@)""")


def _texts() -> list[Path]:
    """What tells users how to install: the markdown files (not CHANGELOG.md, a history) and the code."""
    out = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted(p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith("."))]
    for folder in ("mhla_cli", "benchmarks", "experiments", "examples"):
        out += sorted(p for p in (ROOT / folder).rglob("*.py") if "out" not in p.relative_to(ROOT / folder).parts)
    out += [p for p in (ROOT / ".ci").glob("*") if p.is_file()]
    return sorted(set(out))


def test_no_install_from_an_index() -> None:
    hits = []
    for path in _texts():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _FROM_INDEX.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "install instructions that need a published mhla:\n" + "\n".join(hits)


# An index named by pip's --index-url / --extra-index-url, and a repository named by `git clone`.
_INDEX_URL = re.compile(r"--(?:extra-)?index-url[ =]+['\"]?([^'\"\s]+)")
_CLONE = re.compile(r"git clone\b[^\n]*?((?:https?|git|ssh|file)://[^'\"\s]+|git@[^'\"\s]+|$)")


def test_install_lines_name_real_addresses() -> None:
    """Install lines work as written: an index is a concrete https address (no placeholder such as
    "$PYTORCH_CPU_INDEX"), and a `git clone` only of an address pyproject.toml records in [project.urls]
    (none is recorded while no public address is known: the docs say "from a checkout"); every address there is
    an absolute https URL."""
    tomllib = pytest.importorskip("tomllib")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
    assert all(re.fullmatch(r"https://[\w.-]+\.[a-z]{2,}(/\S*)?", u) for u in urls.values()), urls
    known = {u.rstrip("/").removesuffix(".git") for u in urls.values()}
    bad = []
    for path in _texts():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
            bad += [where for u in _INDEX_URL.findall(line) if not re.fullmatch(r"https://[\w.-]+\.[a-z]{2,}/\S*", u)]
            bad += [where for u in _CLONE.findall(line) if u.rstrip("/").removesuffix(".git") not in known]
    assert not bad, "install lines with an address that is not a real one:\n" + "\n".join(bad)
    assert _INDEX_URL.findall('pip install "torch==2.13.0" --index-url "$PYTORCH_CPU_INDEX"') == ["$PYTORCH_CPU_INDEX"]
    assert _CLONE.findall("git clone --depth 1 https://github.com/mhla-dev/mhla.git") == [
        "https://github.com/mhla-dev/mhla.git"]
    assert _CLONE.findall("git clone <the repository's address>") == [""]  # a placeholder: no address


def test_install_pattern() -> None:
    for line in ["pip install mhla", "pip install 'mhla[dask]'", 'pip install -U "mhla[plot]"', "- run: pip install mhla"]:
        assert _FROM_INDEX.search(line), line
    for line in ["pip install -e .", "pip install -e '.[test,dask,plot]'", "pip install 'dask[distributed]>=2023.1'",
                 "pip install mhla_cli-0.1.0.whl", "pip install ./dist/mhla-0.1.0-py3-none-any.whl",
                 "pip install 'mhla-0.1.0-py3-none-any.whl[dask]'", 'pip install "mhla @ git+https://host/mhla.git"',
                 "pip install 'mhla[dask]@ file:///tmp/mhla-0.1.0-py3-none-any.whl'"]:
        assert not _FROM_INDEX.search(line), line


def test_library_hints_name_the_extras_requirements() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    hint = re.compile(r"""pip install '([^']+)' \(mhla's \[(\w+)\] extra\)""")
    seen = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"\"\s*\n\s*\"", "", text)  # join implicitly concatenated string literals
        for req, extra in hint.findall(text):
            seen += 1
            assert req in extras.get(extra, []), f"{path.name}: {req!r} is not in the [{extra}] extra"
    assert seen >= 4  # safetensors, plot, torch, dask


# ---------------------------------------------------------------------------------------------------
# 5. every package's docstring maps its modules


_MAP_LINE = re.compile(r"^- `(\w+)`:", re.MULTILINE)


def package_map(init: Path) -> list[str]:
    """The modules a package's docstring names in its map: its lines ``- `name`: what it does``."""
    return _MAP_LINE.findall(ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or "")


def package_contents(package: Path) -> set[str]:
    """The modules (`name.py`, not `__init__` / `__main__`) and the subpackages of a package directory."""
    return ({p.stem for p in package.glob("*.py") if not (p.stem.startswith("__") and p.stem.endswith("__"))}
            | {p.parent.name for p in package.glob("*/__init__.py")})


def map_errors(package_dir: Path = PACKAGE) -> list[str]:
    """Where a package's map and its directory disagree: a module it does not name, a name it maps that is
    not on disk, a name mapped twice."""
    errors = []
    for init in sorted(package_dir.rglob("__init__.py")):
        where = init.relative_to(package_dir.parent).as_posix()
        named, on_disk = package_map(init), package_contents(init.parent)
        errors += [f"{where}: the map does not name `{m}`" for m in sorted(on_disk - set(named))]
        errors += [f"{where}: the map names `{m}`, which is not in the package" for m in sorted(set(named) - on_disk)]
        errors += [f"{where}: the map names `{m}` twice" for m in sorted({m for m in named if named.count(m) > 1})]
    return errors


def test_every_package_maps_its_modules() -> None:
    assert len(package_map(PACKAGE / "statistics" / "__init__.py")) >= 15
    errors = map_errors()
    assert not errors, "package maps (a line '- `module`: what it does' each in the __init__ docstring):\n" + \
        "\n".join(errors)


def test_map_errors_on_a_synthetic_package(tmp_path: Path) -> None:
    doc = '"""The package.\n\n- `alpha`: one job;\n- `_raw`: another;\n- `sub`: a subpackage.\n"""\n'
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": doc, "pkg/__main__.py": "", "pkg/alpha.py": "", "pkg/_raw.py": "",
        "pkg/sub/__init__.py": '"""Sub.\n\n- `x`: x.\n"""\n', "pkg/sub/x.py": "", "pkg/data/table.csv": "",
    })
    assert package_map(pkg / "__init__.py") == ["alpha", "_raw", "sub"]
    assert map_errors(pkg) == []
    (pkg / "beta.py").write_text("")  # a new module nobody mapped
    (pkg / "sub" / "__init__.py").write_text('"""Sub.\n\n- `x`: x.\n- `y`: gone.\n- `x`: again.\n"""\n')
    assert map_errors(pkg) == ["pkg/__init__.py: the map does not name `beta`",
                               "pkg/sub/__init__.py: the map names `y`, which is not in the package",
                               "pkg/sub/__init__.py: the map names `x` twice"]
    (pkg / "beta.py").unlink()
    (pkg / "sub" / "__init__.py").write_text('"""Sub: x does its job."""\n')  # named in prose, not in the map
    assert map_errors(pkg) == ["pkg/sub/__init__.py: the map does not name `x`"]


# A module longer than this is more than one job (docs/development.md): split it by job.
MAX_MODULE_LINES = 530


def test_no_module_is_longer_than_the_limit() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, long


# A function longer than this (def line to last line, docstring included) is more than one job: split it by job.
MAX_FUNCTION_LINES = 80


def long_functions(package_dir: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`path::name` -> lines of every function (methods and nested ones too) longer than `limit`."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if (n := node.end_lineno - node.lineno + 1) > limit:
                    out[f"{path.relative_to(package_dir).as_posix()}::{node.name}"] = n
    return out


def test_no_function_is_longer_than_the_limit(tmp_path: Path) -> None:
    assert long_functions(PACKAGE) == {}
    pkg = _write_package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": (
        "def short():\n" + "    x = 1\n" * 79 + "\n\nclass C:\n    def long(self):\n" + "        x = 1\n" * 80)})
    assert long_functions(pkg) == {"a.py::long": 81}


# ---------------------------------------------------------------------------------------------------
# 6. one import path per name


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """A module's top-level statements, those under `if` / `try` included (not inside functions or classes)."""
    out: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            out.append(stmt)
            if isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for part in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                    visit(part)

    visit(tree.body)
    return out


def _source_of(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted module a `from ... import` statement in `module` reads from."""
    if not node.level:
        return node.module or ""
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _names_of(files: dict[str, Path]) -> dict[str, tuple[dict[str, str], set[str]]]:
    """Module -> (the names it imports, each with the module it imports it from; the names it defines)."""
    out = {}
    for mod, path in files.items():
        imported: dict[str, str] = {}
        defined: set[str] = set()
        for stmt in _top_level(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(stmt, ast.ImportFrom):
                src = _source_of(mod, path.name == "__init__.py", stmt)
                imported.update({a.asname or a.name: src for a in stmt.names})
            elif isinstance(stmt, ast.Import):
                imported.update({a.asname or a.name.partition(".")[0]: a.name for a in stmt.names})
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
                targets = (stmt.targets if isinstance(stmt, ast.Assign)
                           else [i.optional_vars for i in stmt.items if i.optional_vars] if isinstance(stmt, ast.With)
                           else [stmt.target])
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        out[mod] = (imported, defined)
    return out


def _split_packages(files: dict[str, Path], layers: tuple[str, ...] = LAYERS) -> set[str]:
    """The subpackages that are one module split in files (their `__init__` imports their parts: lowrank,
    forward, convert, formats), not the package, its layers or a folder of modules."""
    root = min(files, key=len)
    return {m for m, p in files.items() if p.name == "__init__.py" and m != root
            and m.split(".")[1:] not in ([layer] for layer in layers) and not _is_folder(p)}


def import_path_errors(package_dir: Path, scanned: dict[str, Path]) -> list[str]:
    """`from X import n` statements in the scanned files (dotted name -> file; a file outside the package has a
    name outside it) that (a) take n from a module X that only imports it (re-exports: import n from its home),
    except the package itself (the public API) and a split package's names from its own parts; or (b) take a
    private name `_n` from another module, except between the parts of one split package and a test module's
    `test_<leaf>.py` taking the private names of its module `<leaf>` (or of its parts)."""
    files = _module_files(package_dir)
    root, names, split = package_dir.name, _names_of(files), _split_packages(files)
    errors = []
    for mod, path in scanned.items():
        tested = path.stem.removeprefix("test_") if path.stem.startswith("test_") else None
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or (node.level and mod not in files):
                continue
            src = _source_of(mod, path.name == "__init__.py", node)
            if src not in files:
                continue
            imported, defined = names[src]
            for alias in node.names:
                n, where = alias.name, f"{path.relative_to(package_dir.parent)}:{node.lineno}"
                if f"{src}.{n}" in files or n.startswith("__"):
                    continue
                own_part = src in split and imported.get(n, "").startswith(src + ".")
                if n in imported and n not in defined and src != root and not own_part:
                    errors.append(f"{where}: {n} from {src}, which only imports it from {imported[n]}")
                elif n.startswith("_") and src != mod:
                    same_split = any((mod == s or mod.startswith(s + ".")) and src.startswith(s + ".") for s in split)
                    own_test = tested is not None and tested in src.split(".")
                    if not (same_split or own_test):
                        errors.append(f"{where}: the private {n} of {src}")
    return sorted(errors)


def _scanned(folders: tuple[str, ...] = ("tests", "benchmarks", "examples", "experiments")) -> dict[str, Path]:
    """The package's modules and the Python files of the repository's other folders (named by their path)."""
    out = dict(_module_files(PACKAGE))
    for folder in folders:
        out.update({p.relative_to(ROOT).with_suffix("").as_posix(): p for p in sorted((ROOT / folder).rglob("*.py"))})
    return out


def test_one_import_path_per_name() -> None:
    scanned = _scanned()
    assert "mhla_cli.statistics.stream" in scanned and "tests/test_layout" in scanned
    assert _split_packages(_module_files(PACKAGE)) == {
        "mhla_cli.solve.lowrank", "mhla_cli.model.forward", "mhla_cli.io.convert", "mhla_cli.io.formats"}
    errors = import_path_errors(PACKAGE, scanned)
    assert not errors, "import each name from the module that defines it:\n" + "\n".join(errors)


def test_import_path_errors_on_a_synthetic_package(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "from .base import f\n",
        "pkg/base.py": "import os\n\ndef f():\n    pass\n\ndef _g():\n    pass\n\nK = 1\n",
        "pkg/hub.py": "from .base import f, K\nfrom .split import part\n\ndef h():\n    pass\n",
        "pkg/split/__init__.py": "from .part import p\nfrom ..base import f\n",
        "pkg/split/part.py": "from ..base import K\n\ndef p():\n    pass\n\ndef _q():\n    pass\n",
        "pkg/split/other.py": "from .part import _q\n",
        "pkg/user.py": ("from pkg import f\nfrom pkg.base import f, K\nfrom .hub import h\nfrom pkg.split import p\n"
                        "from pkg.split import part\n"),
    })
    files = _module_files(pkg)
    assert _split_packages(files, layers=()) == {"pkg.split"}
    assert import_path_errors(pkg, files) == []
    (pkg / "hub.py").write_text("from .base import f, _g, K\n")
    (pkg / "user.py").write_text("from .hub import f, K\nfrom pkg.split import f as g\nfrom pkg.split.part import K\n"
                                 "from pkg.base import os\n\ndef later():\n    from pkg.base import _g\n")
    (tmp_path / "test_part.py").write_text("from pkg.split.part import _q\nfrom pkg.base import _g\n")
    scanned = {**files, "tests/test_part": tmp_path / "test_part.py"}
    assert import_path_errors(pkg, scanned) == [
        "pkg/hub.py:1: the private _g of pkg.base",
        "pkg/user.py:1: K from pkg.hub, which only imports it from pkg.base",
        "pkg/user.py:1: f from pkg.hub, which only imports it from pkg.base",
        "pkg/user.py:2: f from pkg.split, which only imports it from pkg.base",
        "pkg/user.py:3: K from pkg.split.part, which only imports it from pkg.base",
        "pkg/user.py:4: os from pkg.base, which only imports it from os",
        "pkg/user.py:7: the private _g of pkg.base",
        "test_part.py:2: the private _g of pkg.base",
    ]


# `--name` in a string: an option of the command line (not a negative number or a rule of dashes).
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def option_names(root: Path, skip: tuple[str, ...] = ("cli",)) -> list[str]:
    """Every string literal of the modules under `root` (but the folders `skip`; docstrings apart) that names an
    option of the command line, as `path:line: --option`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in skip:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                out += [f"{root.name}/{rel}:{node.lineno}: {m}" for m in _OPTION.findall(node.value)]
    return out


def test_the_library_names_no_option_of_the_command_line() -> None:
    found = option_names(PACKAGE)  # the CLI words the library's remedies (mhla_cli.errors.Refused) in its options
    assert not found, found


def test_option_names_on_a_synthetic_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "cli" / "a.py").write_text('X = "give --ridge"\n')
    (pkg / "b.py").write_text('"""Mentions --ridge in its docstring."""\nY = "x --- y, -1 --2"\n'
                              'def f():\n    raise ValueError("use --scheduler-timeout SECONDS")\n')
    assert option_names(pkg) == ["pkg/b.py:4: --scheduler-timeout"]
