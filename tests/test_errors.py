"""The library's exceptions (mhla_cli.errors) and how the CLI reports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhla_cli.cli import run
from mhla_cli.errors import InputError, MhlaError


def test_input_error_is_a_value_error_with_the_path() -> None:
    e = InputError("offsets[0] = 1, expected 0", Path("/data/x.h5"))
    assert isinstance(e, ValueError) and isinstance(e, MhlaError)
    assert str(e) == "/data/x.h5: offsets[0] = 1, expected 0" and e.path == "/data/x.h5"
    bare = InputError("bad option")
    assert str(bare) == "bad option" and bare.path is None
    with pytest.raises(ValueError):  # library users may catch ValueError
        raise InputError("x")


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.h5"
    assert run(["featurize", str(missing), "-o", str(tmp_path / "f.h5")]) == 2
    err = capsys.readouterr().err
    assert err == f"mhla: error: {missing}: no such file\n"


def test_about_names_the_file_of_a_pathless_error() -> None:
    from mhla_cli.cli.options import about
    with pytest.raises(InputError) as bare:
        with about(Path("d.h5")):
            raise InputError("the data have no 'targets'")
    assert str(bare.value) == "d.h5: the data have no 'targets'" and bare.value.path == "d.h5"
    with pytest.raises(InputError) as named:  # an error that names its file keeps it
        with about(Path("d.h5")):
            raise InputError("bad offsets", Path("other.h5"))
    assert str(named.value) == "other.h5: bad offsets"


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert run(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and cap.out == "" and "Traceback" not in cap.err, cap.err
    return lines[0]


def test_errors_about_a_file_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    untargeted = tmp_path / "x.h5"
    with h5py.File(untargeted, "w") as f:  # tokens alone: featurize and certify take them, fit cannot
        f["tokens"] = rng.standard_normal((3, 4, 2))
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(untargeted), "-o", str(feats), "-q"]) == 0
    # each line names the file and what the command needs (not a bare "the data have no 'targets'")
    line = _one_error(capsys, ["fit", str(untargeted), "-o", str(tmp_path / "m.h5")])
    assert line == f"mhla: error: {untargeted}: has no 'targets': fit needs (X, y) pairs"
    assert not (tmp_path / "m.h5").exists()
    line = _one_error(capsys, ["fit", str(feats), "-o", str(tmp_path / "m.h5")])
    assert line.startswith(f"mhla: error: {feats}: ") and "no 'targets'" in line
    line = _one_error(capsys, ["certify", str(untargeted), "--witness", str(tmp_path / "w.h5")])
    assert line.startswith(f"mhla: error: {untargeted}: --witness needs targets")
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, dim in ((a, "2"), (b, "3")):
        data = tmp_path / f"d{dim}.h5"
        assert run(["generate", "teacher", "-o", str(data), "--dim", dim, "--heads", "1", "--n-samples", "60",
                    "-q"]) == 0
        assert run(["fit", str(data), "-o", str(path), "-q"]) == 0
    line = _one_error(capsys, ["compare", str(a), str(b)])
    assert line == f"mhla: error: {a}: the models have different d (2 here, 3 in {b}): nothing to compare"


def test_a_refusal_carries_its_remedy_for_the_caller_to_word() -> None:
    """errors.Refused: the library's message names no option of the command line; the CLI words the same remedies in
    its options (cli.options.REMEDY_OPTIONS, one entry for each of the library's), the file named alike."""
    from mhla_cli.cli.options import REMEDY_OPTIONS, in_options
    from mhla_cli.errors import REMEDY_WORDS, InputError, Refused

    assert set(REMEDY_OPTIONS) == set(REMEDY_WORDS)
    exc = Refused("too wide: map them first: {reduce}; or {cluster}", "t.h5", reduce={"tokens": "t.h5", "dim": 8},
                  cluster={})
    assert isinstance(exc, InputError) and exc.path == "t.h5"
    assert str(exc) == ("t.h5: too wide: map them first: mhla_cli.reduce_tokens(t.h5, REDUCED, dim=8); or the "
                        "scheduler argument (docs/cluster.md)")
    assert str(in_options(exc)) == ("t.h5: too wide: map them first: mhla reduce t.h5 -o REDUCED.h5 --dim 8; or "
                                    "--scheduler (docs/cluster.md)")
    assert all("--" not in REMEDY_WORDS[k] for k in REMEDY_WORDS)


def test_a_slot_takes_the_value_of_its_option_and_survives_pickling() -> None:
    """`{name:arg}` fills the word's `{}` with `arg` (one remedy, several values); a slot of no remedy and other
    braces stay as written; a pickled refusal (a worker's) keeps its template, remedies and file."""
    import pickle

    from mhla_cli.cli.options import in_options
    from mhla_cli.errors import Refused

    exc = Refused("{key:tokens=NAME} and {key:targets=NAME}: {keys} twice; {other} {'a': 1} {dim}", "x.pt",
                  key={}, keys={})
    assert str(exc) == "x.pt: keys=['tokens=NAME'] and keys=['targets=NAME']: keys twice; {other} {'a': 1} {dim}"
    assert str(in_options(exc)) == "x.pt: --key tokens=NAME and --key targets=NAME: --key twice; {other} {'a': 1} {dim}"
    odd = Refused("{key:t={x}}: expected ROLE=NAME", key={})  # a value with braces, as the user typed it
    assert (str(odd), str(in_options(odd))) == ("keys=['t={x}']: expected ROLE=NAME", "--key t={x}: expected ROLE=NAME")
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.template, back.remedies, back.path) == (Refused, exc.template, exc.remedies, "x.pt")
    assert str(in_options(back)) == str(in_options(exc))
