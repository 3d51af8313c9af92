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
