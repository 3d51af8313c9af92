"""FeaturesFields (mhla_cli.statistics.record_fields): the record's fields declared for the mixins of Features,
for the type checker only. At run time it adds nothing to Features; its declarations match features.py.

References: the dataclass's own fields (dataclasses.fields) and the source of features.py, read with ast.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import mhla_cli.statistics.features as features_mod
import mhla_cli.statistics.record_fields as record_fields_mod
from mhla_cli.statistics.algebra import FeaturesAlgebra
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.files.features_file import FeaturesFile
from mhla_cli.statistics.record_fields import FeaturesFields

# The fields of Features, in the order of its __init__ (a field added or moved changes this list on purpose).
FIELDS = ("d", "n_samples", "n_tokens", "gram", "token_gram", "last_token_gram", "moments", "target_gram",
          "token_dtype", "sample_range", "source", "extra_attrs", "basis", "basis_gram", "basis_moments",
          "basis_token_gram", "basis_last_token_gram", "read", "n_sequences", "span_pairs", "span_last",
          "factor_cache", "target_sum", "weight_sum", "token_weight_sum", "affine")
# Features' fields with no default (positional in its __init__); gram's descriptor is no default.
REQUIRED = ("d", "n_samples", "n_tokens", "gram", "token_gram", "last_token_gram")
# What any class body defines at run time (`__annotations__` an empty dict: its annotations are not run).
CLASS_BASICS = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__",
                "__static_attributes__", "__annotations__"}


def _declared(cls_name: str, path: str) -> dict[str, str]:
    """name -> annotation of the annotated names (fields) and names of the functions (methods, properties)
    declared in the class `cls_name` of `path`, under `if TYPE_CHECKING:` or not (the `else:` branch too)."""
    tree = ast.parse(Path(path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out: dict[str, str] = {}

    def walk(body: list[ast.stmt], runtime: bool) -> None:
        for node in body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                walk(node.body, False)
                walk(node.orelse, True)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if runtime or cls_name == "FeaturesFields":
                    out.setdefault(node.target.id, ast.unparse(node.annotation))
            elif isinstance(node, ast.FunctionDef):
                out.setdefault(node.name, "def")
    walk(cls.body, True)
    return out


def test_features_fields_are_unchanged() -> None:
    """The dataclass picks up no field from the base: the same fields, in the same order, the same required."""
    assert tuple(f.name for f in dataclasses.fields(Features)) == FIELDS
    required = tuple(f.name for f in dataclasses.fields(Features)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    assert required == REQUIRED
    # the annotations the dataclass reads at run time: features.py's own, not the type checker's branch
    types = {f.name: f.type for f in dataclasses.fields(Features)}
    assert types["gram"] == types["basis_gram"] == "np.ndarray | None"


def test_the_base_is_empty_at_run_time() -> None:
    """FeaturesFields defines nothing at run time (no annotation, attribute nor method) and is a base of both
    mixins, hence of Features."""
    assert set(vars(FeaturesFields)) <= CLASS_BASICS
    assert not FeaturesFields.__dict__.get("__annotations__")
    assert issubclass(FeaturesAlgebra, FeaturesFields) and issubclass(FeaturesFile, FeaturesFields)
    assert Features.__mro__.index(FeaturesFields) > Features.__mro__.index(FeaturesFile)


def test_declarations_match_features() -> None:
    """Every field of Features is declared in the base with features.py's own annotation (gram and basis_gram,
    descriptors there, as properties), and every name the base declares exists on Features."""
    base = _declared("FeaturesFields", record_fields_mod.__file__)
    host = _declared("Features", features_mod.__file__)
    for name in FIELDS:
        assert name in base, name
        if name in ("gram", "basis_gram"):
            assert base[name] == "def", name
        else:
            assert base[name] == host[name], (name, base[name], host[name])
    for name in base:
        assert name == "__init__" or hasattr(Features, name) or name in FIELDS, name


def test_declarations_checker_sees_a_drift(tmp_path: Path) -> None:
    """The comparison above notices a field declared with another type than features.py's."""
    src = Path(record_fields_mod.__file__).read_text().replace("        n_tokens: int\n", "        n_tokens: float\n")
    assert src != Path(record_fields_mod.__file__).read_text()
    (tmp_path / "r.py").write_text(src)
    assert _declared("FeaturesFields", str(tmp_path / "r.py"))["n_tokens"] != \
        _declared("Features", features_mod.__file__)["n_tokens"]
