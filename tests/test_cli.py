"""The `mhla` command line end to end: exit codes, JSON keys, files, no partial outputs."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.io import formats
from mhla_cli import __version__
from mhla_cli.cli import run
from mhla_cli.cli.console import SCHEMA_VERSION
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model


def cli_json(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 0) -> dict:
    assert run(args) == code, capsys.readouterr().err
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # exactly one JSON object on stdout
    obj = json.loads(out[0])
    assert next(iter(obj)) == "schema_version" and obj["schema_version"] == SCHEMA_VERSION, obj
    return obj


def test_pipeline_recovers_teacher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, teacher, feats, model, heads, pred = (tmp_path / n for n in
                                                 ("d.h5", "t.h5", "f.h5", "m.h5", "h.h5", "p.h5"))
    g = cli_json(capsys, ["generate", "teacher", "-o", str(data), "--dim", "3", "--heads", "2", "--n-samples",
                          "300", "--seq-len", "1:20", "--teacher-out", str(teacher), "--dtype", "float64",
                          "--json", "-q"])
    assert g["n_samples"] == 300 and g["d"] == 3
    f = cli_json(capsys, ["featurize", str(data), "-o", str(feats), "--chunk-size", "50", "--json", "-q"])
    assert f["n_features"] == 18 and f["n_samples"] == 300 and f["basis_passes"] == 1  # the estimate sufficed
    c = cli_json(capsys, ["certify", str(feats), "--json", "-q"])
    for key in ("identifiable", "lambda_min", "lambda_max", "rank", "n_features", "n_samples", "threshold",
                "domain", "margin"):
        assert key in c
    assert c["identifiable"] is True and c["domain"] == "full"
    m = cli_json(capsys, ["fit", str(feats), "-o", str(model), "--json", "-q"])
    assert m["identifiable"] is True and m["train_mse"] <= m["mse_resolution"]
    e = cli_json(capsys, ["export-heads", str(model), "-o", str(heads), "--json", "-q"])
    assert 1 <= e["n_heads"] <= 9 and e["function_change"] < 1e-12 and e["coordinates"] == "canonical"
    p = cli_json(capsys, ["predict", str(heads), str(data), "-o", str(pred), "--json", "-q"])
    assert p["mse"] < 1e-20
    true_coef = Heads.load(teacher).coef
    fitted = Model.load(model)
    assert np.linalg.norm(fitted.coef - true_coef) < 1e-8 * np.linalg.norm(true_coef)
    with h5py.File(pred) as fh:
        assert fh.attrs["mhla_kind"] == "predictions" and fh.attrs["mhla_format_version"] == formats.FORMAT_VERSION
        assert fh["predictions"].shape == (300, 3) and fh["predictions"].dtype == np.float64
    # certify straight from the tokens file gives the same verdict
    c2 = cli_json(capsys, ["certify", str(data), "--json", "-q"])
    assert c2["lambda_min"] == pytest.approx(c["lambda_min"], rel=1e-10)


def test_certify_exit_1_and_json_when_not_identifiable(tmp_path: Path, capsys) -> None:
    data = tmp_path / "a.h5"
    assert run(["generate", "assoc", "-o", str(data), "--keys", "2", "--n-samples", "500",
                "--orthogonal-fraction", "1", "-q"]) == 0
    c = cli_json(capsys, ["certify", str(data), "--json", "--domain", "observed"], code=1)
    assert c["identifiable"] is False and c["reasons"]
    g = tmp_path / "g.h5"
    assert run(["generate", "assoc", "-o", str(g), "--keys", "2", "--n-samples", "500", "-q"]) == 0
    assert run(["certify", str(g), "-q"]) == 1
    assert run(["certify", str(g), "-q", "--domain", "observed"]) == 0


def test_all_positions_outputs(tmp_path: Path, teacher_file) -> None:
    data, teacher, ds = teacher_file
    pred = tmp_path / "p.h5"
    assert run(["predict", str(teacher), str(data), "-o", str(pred), "--all-positions", "-q"]) == 0
    from mhla_cli.model.forward import forward_heads

    th = Heads.load(teacher)
    with h5py.File(pred) as f:
        off = f["offsets"][()]
        np.testing.assert_array_equal(off, ds.offsets)
        out = f["outputs"][()]
    for i in (0, 7, 299):
        np.testing.assert_allclose(out[off[i]:off[i + 1]], forward_heads(th.V, th.Q, ds.sequence(i), True),
                                   rtol=1e-10, atol=1e-10)


def test_max_heads_reports_function_change(tmp_path: Path, teacher_file, capsys) -> None:
    data, _, _ = teacher_file
    model, heads = tmp_path / "m.h5", tmp_path / "h.h5"
    assert run(["fit", str(data), "-o", str(model), "-q"]) == 0
    e = cli_json(capsys, ["export-heads", str(model), "-o", str(heads), "--max-heads", "1", "--json", "-q"])
    assert e["n_heads"] == 1 and 0 < e["function_change"] < 1 and 0 < e["coef_change"] < 1
    assert Heads.load(heads).V.shape == (1, 3, 3)


def test_failed_command_leaves_no_output(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope.h5"
    out = tmp_path / "out.h5"
    assert run(["featurize", str(missing), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"mhla: error: {missing}: no such file"
    assert not out.exists()
    out.write_bytes(b"keep me")
    assert run(["featurize", str(missing), "-o", str(out)]) == 2
    assert out.read_bytes() == b"keep me"
    assert not list(tmp_path.glob("*.tmp-mhla"))


def test_usage_errors_exit_2_one_line(capsys) -> None:
    assert run(["fit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: fit: Missing argument")
    assert run(["certify", "x.h5", "--domain", "sideways"]) == 2
    assert "mhla: error:" in capsys.readouterr().err


def test_console_script_as_process(tmp_path: Path, teacher_file) -> None:
    data, _, _ = teacher_file
    script = shutil.which("mhla")  # the installed console script; `python -m mhla_cli` otherwise
    exe = [script] if script else [sys.executable, "-m", "mhla_cli"]
    v = subprocess.run(exe + ["--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.strip() == f"mhla {__version__}"
    r = subprocess.run(exe + ["certify", str(data), "--json"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["identifiable"] is True
    bad = subprocess.run(exe + ["certify", str(tmp_path / "missing.h5")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("mhla: error: ") and "Traceback" not in bad.stderr


# --------------------------------------------------------------------------------------------
# help, completion, progress, the fit warning (issue 16)
# --------------------------------------------------------------------------------------------


def _command_paths() -> list[list[str]]:
    """Every command of `mhla`, as the argv that names it (["fit"], ["generate", "teacher"], ...)."""
    import typer

    from mhla_cli.cli import app
    root = typer.main.get_command(app)
    ctx = typer._click.Context(root)
    paths = []
    for name in root.list_commands(ctx):  # the commands are loaded when asked for (start-up)
        cmd = root.get_command(ctx, name)
        subs = getattr(cmd, "commands", None)
        paths += [[name, s] for s in subs] if subs else [[name]]
    return paths


def test_every_command_is_covered() -> None:
    names = {" ".join(p) for p in _command_paths()}
    assert {"featurize", "merge", "certify", "fit", "export-heads", "spectrum", "predict", "rollout", "compare",
            "inspect", "generate teacher", "generate assoc"} <= names


@pytest.mark.parametrize("argv", _command_paths(), ids=" ".join)
def test_help_has_an_example_and_no_type_placeholders(argv: list[str], capsys) -> None:
    import re
    assert run([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Example" in out, out
    # typer 0.29 printed <bool> after every flag, <path> after arguments, <list[Path]> on merge
    assert not re.search(r"<(bool|str|int|float|path|file|directory|list\[.*?\]|(int|float) range)>", out), out
    for line in out.splitlines():  # a flag shows no value name
        if re.search(r"--(json|quiet|help)\b", line):
            assert not re.search(r"\b(BOOLEAN|TEXT|PATH|INTEGER)\b", line), line


def test_help_names_values_and_arguments(capsys) -> None:
    assert run(["merge", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: mhla merge [OPTIONS] PART..." in out and "PATH" in out
    assert run(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: mhla fit [OPTIONS] DATA" in out and "FLOAT" in out and "INTEGER" in out
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--install-completion" in out and "--show-completion" in out and "<bool>" not in out
    assert 'eval "$(mhla --show-completion bash)"' in out  # the completion flags' example


def _mhla() -> list[str]:
    script = shutil.which("mhla")
    return [script] if script else [sys.executable, "-m", "mhla_cli"]


def test_shell_completion(tmp_path: Path) -> None:
    import os
    import shlex

    env = {**os.environ, "SHELL": "/bin/bash", "HOME": str(tmp_path)}
    # typer finds the shell by walking up the process tree (shellingham): run mhla from bash, so that
    # the answer does not depend on how pytest itself was started
    # (a second command after mhla: bash would otherwise exec it in its own place)
    in_bash = ["bash", "-c", shlex.join(_mhla()) + ' "$@"; exit $?', "bash"]
    show = subprocess.run(in_bash + ["--show-completion"], capture_output=True, text=True, env=env)
    assert show.returncode == 0, show.stderr
    assert "_MHLA_COMPLETE=complete_bash" in show.stdout and "complete -o default -F _mhla_completion mhla" in show.stdout
    # what bash runs on <TAB>: commands, then a command's options
    for words, cword, expect in (("mhla fe", 1, "featurize"), ("mhla fit --ri", 2, "--ridge"),
                                 ("mhla generate t", 2, "teacher"),
                                 # choice options offer their values (issue 26)
                                 ("mhla certify d.h5 --domain ", 4, "observed"),
                                 ("mhla fit d.h5 --normalize ", 4, "length"),
                                 ("mhla featurize d.h5 --spans o", 4, "off"),
                                 ("mhla predict m.h5 d.h5 --device c", 5, "cuda:0")):
        comp = subprocess.run(_mhla(), capture_output=True, text=True,
                              env={**env, "_MHLA_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                   "COMP_CWORD": str(cword)})
        assert comp.returncode == 0 and expect in comp.stdout.split(), (words, comp.stdout, comp.stderr)
    inst = subprocess.run(in_bash + ["--install-completion"], capture_output=True, text=True, env=env)
    assert inst.returncode == 0, inst.stderr
    assert (tmp_path / ".bash_completions" / "mhla.sh").is_file()
    assert "_mhla_completion" in (tmp_path / ".bash_completions" / "mhla.sh").read_text()


def test_featurize_progress_moves_within_large_chunks(tmp_path: Path, monkeypatch, capsys) -> None:
    # 4000 sequences of 50 tokens (2e5 tokens) in one or two chunks: the bar must move within a chunk, not jump from 0 to done
    from contextlib import contextmanager

    import mhla_cli.cli.featurize as featurize_cli
    from mhla_cli.statistics.stream import featurize

    data = tmp_path / "d.h5"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "4", "--heads", "1", "--n-samples", "4000",
                "--seq-len", "50", "-q"]) == 0
    calls: list[tuple[str, int]] = []

    @contextmanager
    def counting_bar(description: str, total: int, quiet: bool):
        calls.append(("total", total))
        yield lambda n: calls.append(("advance", n))
    monkeypatch.setattr(featurize_cli, "progress_bar", counting_bar)
    for chunk, workers in (("4000", "1"), ("2000", "1"), ("2000", "2")):  # -j 2: threads tell their chunks
        calls.clear()
        out = tmp_path / f"f{chunk}_{workers}.h5"
        assert run(["featurize", str(data), "-o", str(out), "--chunk-size", chunk, "-j", workers, "-q"]) == 0
        steps = [n for kind, n in calls if kind == "advance"]
        assert calls[0] == ("total", 4000) and sum(steps) == 4000
        assert len(steps) >= 10 and all(n > 0 for n in steps), steps
    # the ticks change nothing: the same statistics with and without a progress callback
    a = featurize(data, chunk_size=2000, progress=lambda n: None)
    b = featurize(data, chunk_size=2000)
    for name in ("gram", "moments", "target_gram", "token_gram"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_fit_warning_names_the_observed_domain(tmp_path: Path, capsys) -> None:
    # Gaussian keys: not identifiable on R^d (the last tokens (q, 0) span half of it), identifiable on
    # the observed domain; orthogonal keys: identifiable on neither
    g, held, o = tmp_path / "g.h5", tmp_path / "held.h5", tmp_path / "o.h5"
    for path, frac, n, seed in ((g, "0", "500", "0"), (held, "0", "200", "7"), (o, "1", "500", "0")):
        assert run(["generate", "assoc", "-o", str(path), "--keys", "2", "--n-samples", n, "--seed", seed,
                    "--orthogonal-fraction", frac, "-q"]) == 0
    capsys.readouterr()
    assert run(["fit", str(g), "-o", str(tmp_path / "gm.h5"), "-q"]) == 0
    warn = capsys.readouterr().err.strip().splitlines()
    assert len(warn) == 1 and warn[0].startswith("mhla: warning: the data do not determine the function")
    assert "they do determine it on the observed domain" in warn[0] and "certify --domain observed" in warn[0]
    assert "its predictions there are exact" in warn[0]
    # ... and they are: held-out inputs of the same domain are predicted to float64 rounding
    p = cli_json(capsys, ["predict", str(tmp_path / "gm.h5"), str(held), "-o", str(tmp_path / "p.h5"), "--json",
                          "-q"])
    assert p["mse"] < 1e-20
    assert run(["fit", str(g), "-o", str(tmp_path / "gr.h5"), "-q", "--ridge", "0.1"]) == 0
    warn = capsys.readouterr().err
    assert "observed domain" in warn and "without --ridge, its predictions there would be exact" in warn
    assert run(["fit", str(o), "-o", str(tmp_path / "om.h5"), "-q"]) == 0
    warn = capsys.readouterr().err
    assert "do not determine the function" in warn and "observed domain" not in warn
    assert "see `mhla certify`" in warn


def test_teacher_out_writes_the_format_of_its_suffix(tmp_path: Path, capsys) -> None:
    data, teacher = tmp_path / "d.h5", tmp_path / "teacher.npz"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "2", "--heads", "1", "--n-samples", "50",
                "--seq-len", "3:8", "--dtype", "float64", "--teacher-out", str(teacher), "-q"]) == 0
    with np.load(teacher) as z:  # a real .npz archive (not HDF5 under that name)
        assert z["V"].shape == (1, 2, 2) and z["Q"].shape == (1, 2, 2)
    p = cli_json(capsys, ["predict", str(teacher), str(data), "-o", str(tmp_path / "p.h5"), "--json", "-q"])
    assert p["mse"] < 1e-25
    if importlib.util.find_spec("safetensors") is None:  # an optional package (the `test` extra has it)
        return
    st = tmp_path / "teacher.safetensors"
    assert run(["generate", "assoc", "-o", str(tmp_path / "a.h5"), "--keys", "1", "--n-samples", "8",
                "--teacher-out", str(st), "-q"]) == 0
    assert st.read_bytes()[8:9] == b"{"  # safetensors: an 8-byte header length, then JSON


def test_predict_causal_progress_moves_within_a_range(tmp_path: Path, monkeypatch, capsys) -> None:
    from contextlib import contextmanager

    import mhla_cli.cli.predict as predict_cli
    from mhla_cli.model.forward import predict_file
    from mhla_cli.model.model import load_function

    data, model = tmp_path / "d.h5", tmp_path / "m.h5"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "3", "--heads", "1", "--n-samples", "600",
                "--seq-len", "2:60", "--per-position", "-q"]) == 0
    assert run(["fit", str(data), "-o", str(model), "-q"]) == 0
    steps: list[int] = []

    @contextmanager
    def counting_bar(description: str, total: int, quiet: bool):
        assert total == 600
        yield steps.append
    monkeypatch.setattr(predict_cli, "progress_bar", counting_bar)
    for workers in ("1", "2"):
        steps.clear()
        assert run(["predict", str(model), str(data), "-o", str(tmp_path / f"p{workers}.h5"), "--causal",
                    "--chunk-size", "600", "-j", workers, "-q"]) == 0
        assert sum(steps) == 600 and len(steps) >= 10 and all(n > 0 for n in steps), steps
    fn = load_function(model)
    a = predict_file(fn, data, causal=True, progress=lambda n: None)
    b = predict_file(fn, data, causal=True, chunk_size=7)  # the blocks change no value
    assert np.array_equal(a.outputs, b.outputs) and a.mse == pytest.approx(b.mse, rel=1e-12)


# Every command with --json, on a missing input (exit 2): one error object naming the input.
JSON_ERROR_RUNS = {
    "certify": ["certify", "{missing}"],
    "certify --on": ["certify", "{missing}", "--on", "{missing}"],
    "fit": ["fit", "{missing}", "-o", "{out}"],
    "featurize": ["featurize", "{missing}", "-o", "{out}"],
    "export-heads": ["export-heads", "{missing}", "-o", "{out}"],
    "spectrum": ["spectrum", "{missing}"],
    "predict": ["predict", "{missing}", "{missing}", "-o", "{out}"],
    "compare": ["compare", "{missing}", "{missing}"],
    "inspect": ["inspect", "{missing}"],
    "merge": ["merge", "{missing}", "-o", "{out}"],
    "convert": ["convert", "{missing_npy}", "-o", "{out}"],
    "rollout": ["rollout", "{missing}", "{missing}", "--steps", "1", "-o", "{out}"],
}


@pytest.mark.parametrize("name", sorted(JSON_ERROR_RUNS))
def test_json_error_object_on_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    missing = str(tmp_path / "missing.h5")
    args = [a.format(missing=missing, missing_npy=str(tmp_path / "missing.npy"), out=str(tmp_path / "o.h5"))
            for a in JSON_ERROR_RUNS[name]]
    obj = cli_json(capsys, [*args, "--json"], code=2)
    assert obj["exit_code"] == 2 and "missing" in obj["error"], obj
    assert obj["path"] is not None and obj["path"].endswith(("missing.h5", "missing.npy")), obj
    assert not (tmp_path / "o.h5").exists()


def test_json_error_object_on_usage_errors_and_internal_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    obj = cli_json(capsys, ["certify", "--json"], code=2)  # a usage error: no DATA
    assert obj["exit_code"] == 2 and "Missing argument" in obj["error"] and obj["path"] is None
    data = tmp_path / "d.h5"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "2", "--heads", "1", "--n-samples", "40",
                "--seq-len", "4", "-q"]) == 0
    import mhla_cli.solve.certificate

    def boom(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(mhla_cli.solve.certificate, "certify_features", boom)  # the command imports it when it runs
    monkeypatch.delenv("MHLA_DEBUG", raising=False)
    obj = cli_json(capsys, ["certify", str(data), "--json"], code=3)
    assert obj["exit_code"] == 3 and "internal error: RuntimeError: a bug" in obj["error"]
    assert obj["path"] == str(data)
    # without --json nothing goes to stdout; after `--` a file named --json is no option
    assert run(["certify", str(tmp_path / "missing.h5")]) == 2
    assert capsys.readouterr().out == ""


def test_certify_missing_json_redirect_leaves_an_object(tmp_path: Path) -> None:
    """The README's CI step: `mhla certify missing.h5 --json > cert.json` leaves a JSON object, not 0 bytes."""
    cert = tmp_path / "cert.json"
    with open(cert, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "mhla_cli", "certify", "missing.h5", "--json"], stdout=f,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == "mhla: error: missing.h5: no such file\n"
    assert json.loads(cert.read_text()) == {"schema_version": SCHEMA_VERSION, "error": "missing.h5: no such file",
                                            "exit_code": 2, "path": "missing.h5"}


def _modules_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running `code`."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules} | " \
                   "{m for m in sys.modules if m.startswith('scipy.')})))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_start_up_imports_only_what_the_command_needs() -> None:
    """`import mhla_cli` loads no SciPy LAPACK, h5py or torch; `mhla --version` not even typer or NumPy;
    `mhla certify --help` only the parser (typer, rich), none of the library's numerics."""
    heavy = {"scipy.linalg", "torch", "h5py"}
    assert not _modules_after("import mhla_cli") & (heavy | {"numpy", "typer"})
    assert not _modules_after("from mhla_cli.cli import run; run(['--version'])") & (heavy | {"numpy", "typer"})
    loaded = _modules_after("import io, contextlib\nfrom mhla_cli.cli import run\n"
                            "with contextlib.redirect_stdout(io.StringIO()): run(['certify', '--help'])")
    assert "typer" in loaded and not loaded & (heavy | {"numpy", "scipy"}), loaded
    # nor pydantic: typer builds a pydantic validator for an option when it parses its value, and the
    # root's flags (--help, completion: None when absent) need none (help._Option.get_runtime_param)
    assert "pydantic" not in loaded, loaded
    # the low-rank solvers import SciPy's LAPACK when they run, not when fit / the estimator is imported
    assert "scipy.linalg" not in _modules_after("import mhla_cli.api.learn, mhla_cli.api.estimator, mhla_cli.cli.fit")


def test_full_app_gives_typer_docs_every_command_and_help_stays_lazy() -> None:
    """`mhla_cli.cli.full_app` registers every command up front, so typer's own documentation generator (what
    the docs' CLI reference runs) documents all of them, each with its options; `mhla certify --help` still
    loads no other command module."""
    import typer
    from typer.cli import get_docs_for_click

    from mhla_cli.cli import full_app
    from mhla_cli.cli.registry import COMMANDS

    command = typer.main.get_command(full_app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command, info_name="mhla"), name="mhla")
    titles = re.findall(r"^#+ `mhla (.+)`$", text, flags=re.M)
    assert titles == ["generate", "generate teacher", "generate assoc", *[c for c in COMMANDS if c != "generate"]]
    assert "* `--ridge L|auto`: Ridge penalty" in text and "* `-o, --output PATH`: " in text
    # `mhla certify --help` still loads only certify's command module
    probe = ("import io, contextlib, sys\nfrom mhla_cli.cli import run\n"
             "with contextlib.redirect_stdout(io.StringIO()): run(['certify', '--help'])\n"
             "print(sorted(m for m in sys.modules if m.startswith('mhla_cli.cli.') and m.split('.')[-1] in "
             f"{sorted(set(COMMANDS.values()))!r}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "['mhla_cli.cli.certify']", proc.stdout + proc.stderr


def test_lazy_public_names_resolve() -> None:
    import mhla_cli

    assert set(mhla_cli._EXPORTS) | {"InputError", "MhlaError", "__version__"} == set(mhla_cli.__all__)
    for name in mhla_cli.__all__:
        assert getattr(mhla_cli, name) is not None and name in dir(mhla_cli)
    assert mhla_cli.fit.__module__ == "mhla_cli.api.learn" and mhla_cli.Model.__module__ == "mhla_cli.model.model"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mhla_cli.nope  # noqa: B018


def test_version_fast_path_and_help_list_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from mhla_cli.cli.registry import COMMANDS
    from mhla_cli.cli import app

    assert run(["--version"]) == 0 and capsys.readouterr().out == f"mhla {__version__}\n"
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f" {name} " in out, name
    assert app is not None


def test_choice_options_show_their_values_and_refuse_others(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, shown in ((["certify", "--help"], ("[full|observed]", "[none|length]", "DEVICE")),
                        (["featurize", "--help"], ("[auto|on|off]",)),
                        (["generate", "teacher", "--help"], ("[float32|float64]",))):
        assert run(argv) == 0
        out = capsys.readouterr().out
        for s in shown:
            assert s in out, (argv, s)
    assert run(["certify", "x.h5", "--domain", "both"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'both' is not one of 'full', 'observed'" in err


def test_help_is_wrapped_by_the_console(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A docstring's paragraph is one paragraph of the help, filled to the terminal's width (no hand wraps)."""
    from mhla_cli.cli.help import unwrap

    assert unwrap("a b\nc d\n\n- x\n- y\n  z") == "a b c d\n\n- x\n- y z"
    monkeypatch.setenv("COLUMNS", "300")
    assert run(["certify", "--help"]) == 0
    out = capsys.readouterr().out
    # the whole paragraph on one line at 300 columns (it was three ragged lines)
    assert any("lambda_min / lambda_max are those of the canonical" in ln and "docs/certificate.md" in ln
               for ln in out.splitlines())


@pytest.mark.parametrize("argv", [["featurize", "{data}", "-o", "-"], ["certify", "-"], ["fit", "-", "-o", "{m}"],
                                  ["convert", "tokens=-", "-o", "{m}"], ["predict", "-", "{data}", "-o", "{m}"],
                                  ["generate", "teacher", "-o", "-", "--dim", "2", "--heads", "1", "--n-samples", "3"]])
def test_dash_as_a_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    data = tmp_path / "d.h5"
    data.write_bytes(b"")
    args = [a.format(data=data, m=tmp_path / "m.h5") for a in argv]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'-': mhla reads and writes files, not standard input or output" in err \
        or "'tokens=-'" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]
    assert not Path("-").exists()


def test_more_workers_than_cores_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import mhla_cli.cli.options as options

    data = tmp_path / "d.h5"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "2", "--heads", "1", "--n-samples", "20",
                "--seq-len", "4", "-q"]) == 0
    monkeypatch.setattr(options, "available_cores", lambda: 2)
    assert run(["featurize", str(data), "-o", str(tmp_path / "f.h5"), "--workers", "3", "-q"]) == 0
    err = capsys.readouterr().err
    assert err == "mhla: warning: --workers 3 is more than the 2 cores available here: the workers share them\n"
    assert run(["featurize", str(data), "-o", str(tmp_path / "g.h5"), "--workers", "2", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_featurize_compact_certifies_and_fits_as_the_full_file(tmp_path: Path, capsys) -> None:
    """`featurize --compact` stores the Gram's distinct entries; certify and fit read it as the full file,
    inspect names the form, and --folds (stored whole) is refused with it."""
    data, full, compact = tmp_path / "d.h5", tmp_path / "f.h5", tmp_path / "c.h5"
    cli_json(capsys, ["generate", "teacher", "-o", str(data), "--dim", "3", "--heads", "2", "--n-samples", "200",
                      "--seq-len", "1:12", "--dtype", "float64", "--json", "-q"])
    assert cli_json(capsys, ["featurize", str(data), "-o", str(full), "--json", "-q"])["compact"] is False
    assert cli_json(capsys, ["featurize", str(data), "-o", str(compact), "--compact", "--json", "-q"])["compact"]
    assert compact.stat().st_size < full.stat().st_size
    a, b = (cli_json(capsys, ["certify", str(p), "--json", "-q"]) for p in (full, compact))
    assert a["identifiable"] == b["identifiable"] and a["rank"] == b["rank"]
    assert abs(a["lambda_min"] - b["lambda_min"]) <= 1e-12 * a["lambda_max"]
    forms = [cli_json(capsys, ["inspect", str(p), "--json"])["gram_form"] for p in (full, compact)]
    assert forms == ["full", "compact"]
    assert run(["featurize", str(data), "-o", str(tmp_path / "x.h5"), "--compact", "--folds", "3"]) == 2
    assert "--compact and --folds" in capsys.readouterr().err
