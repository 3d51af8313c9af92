r"""The README's and docs' code blocks run, and every number they quote is what the command prints.

Blocks and numbers are tied to commands by HTML comments (invisible on GitHub) placed on the line(s)
right before a fenced block, or right after a paragraph that quotes numbers:

    <!-- docs-test: run [id=NAME] [slow] [errexit=no] [exit=N] [copy=DIR,...] [requires=MOD,...] [timeout=S] -->
        run the block: sh/bash as a script (`bash -e -o pipefail`, or plain `bash` with errexit=no),
        python as a script, console as one command per `$ ` line (its `# exit N` comment asserts the
        exit status, the lines after it are expected in that command's output). Every block of a doc
        runs in order in one fresh temporary directory; copy= copies repository folders into it first
        (sample_data, experiments); requires= skips the block (and what checks it) when a module is
        missing.
    <!-- docs-test: file NAME -->          write the block to NAME in that directory ("save this as ...")
    <!-- docs-test: output [of=BLOCK] [match=search] [; TOL clauses] -->
        the block is the output of the last run block, or of BLOCK (stdout and stderr together); `...` stands
        for any text; whitespace and table padding are free; by default the whole output must match.
    <!-- docs-test: skip REASON -->        not run (a reason is required)
    <!-- docs-test: quote BLOCK [slow]
    NUMBER TOL REGEX
    ... -->
        each NUMBER must appear in the paragraph right above the comment and equal, within TOL, the
        number captured by REGEX (group 1, or the whole match) in the output of block BLOCK
        (`docs/x.md#BLOCK`: a block of another doc; checked with -m slow only).
    <!-- docs-test: table BLOCK [slow] [; TOL clauses] -->
        the markdown table right above the comment appears, row by row, in the output of BLOCK.

Numbers are compared by value, never as text. TOL is `=` (the default: equal to the printed digits,
half a unit of the last digit, and at least 1e-9 relative), `rel=X`, `abs=X`, `order` / `order=K`
(rounding-level values: within a factor 10^K, default 10), or `any` (wall times: not checked).
Clauses after `;` in an output annotation set TOL for a literal (`; 7.6e-30 order`), for the literals
a regex matches (`; /\d\.\de-1[4-6]/ order`) or for a table column (`; col=8..13 any`, 1-based cells of
a markdown table row).

In README.md and every page of docs/ but those listed in LOOSE (docs/formats.md, docs/real_model.md, ...)
every fenced block must carry an annotation; on those only the annotated blocks are tested. Blocks marked slow
(and quotes of their output) run only with `-m slow`; README's Testing section lists them.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Pages whose unannotated blocks are examples not required to run (file layouts, a model's code); on
# every other page (OWNED) each fenced block carries an annotation.
LOOSE = ("docs/formats.md", "docs/tokens.md", "docs/formats_features.md", "docs/certificate.md", "docs/real_model.md",
         "docs/head_survey.md")


def all_docs() -> list[str]:
    """README.md and every page of the documentation site (docs/, subfolders included)."""
    docs = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return [d for d in docs if (ROOT / d).exists()]


OWNED = tuple(d for d in all_docs() if d not in LOOSE)


# ---------------------------------------------------------------------------------------------
# parsing

NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
NUM_TOKEN = re.compile(r"(?<![\w.])" + NUM)   # a number not glued to a name (float64, heads2.h5)
ANNOT = re.compile(r"<!--\s*docs-test:(.*?)-->", re.S)
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    index: int               # order in the doc (0-based, fenced blocks only)
    line: int                # 1-based line of the opening fence
    lang: str
    text: str
    kind: str | None = None  # run / file / output / skip / None (unannotated)
    opts: dict = field(default_factory=dict)
    tols: list = field(default_factory=list)   # [(literal or ('col', lo, hi), tol)]
    annot_line: int = 0
    cut: list = field(default_factory=list)    # indentation removed from each body line

    @property
    def name(self) -> str:
        return self.opts.get("id", f"block{self.index}")

    @property
    def slow(self) -> bool:
        return "slow" in self.opts


@dataclass
class Quote:
    line: int
    block: str
    slow: bool
    paragraph: str
    claims: list            # [(literal, tol, regex)]
    kind: str = "quote"     # or "table": the paragraph (a markdown table) is found in the output
    tols: list = field(default_factory=list)


@dataclass
class Doc:
    path: str
    blocks: list
    quotes: list
    errors: list


def parse_opts(words: list[str]) -> dict:
    opts: dict = {}
    for w in words:
        k, eq, v = w.partition("=")
        opts[k] = v if eq else True
    return opts


def parse_tols(clauses: list[str], where: str, errors: list) -> list:
    tols = []
    for c in clauses:
        c = c.strip()
        if not c:
            continue
        parts = c.rsplit(None, 1)
        if len(parts) != 2 or not valid_tol(parts[1]):
            errors.append(f"{where}: bad tolerance clause {c!r}")
            continue
        target, tol = parts
        m = re.fullmatch(r"col=(\d+)(?:\.\.(\d+))?", target)
        tols.append((("col", int(m[1]), int(m[2] or m[1])) if m else target, tol))
    return tols


def valid_tol(tol: str) -> bool:
    return bool(re.fullmatch(r"=|any|order(=\d+)?|(rel|abs)=" + NUM, tol))


def parse(path: str, text: str) -> Doc:
    lines = text.split("\n")
    blocks, quotes, errors = [], [], []
    pending = None          # (annotation text, line) waiting for the next fence
    i = 0
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln) + 1)
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            fence, lang = m[2], m[3]
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            ind = len(m[1])     # a fence inside a list item: its lines carry the item's indentation
            cut = [min(ind, len(ln) - len(ln.lstrip(" "))) for ln in lines[i + 1:j]]
            body = "\n".join(ln[c:] for ln, c in zip(lines[i + 1:j], cut))
            b = Block(len(blocks), i + 1, lang, body)
            b.cut = cut
            if pending is not None:
                head, aline = pending
                head_words, *clauses = head.split(";")
                words = head_words.split()
                b.kind, b.annot_line = words[0] if words else "?", aline
                if b.kind == "skip":
                    b.opts, clauses = {"reason": head.split(None, 1)[1] if words[1:] else ""}, []
                    if not words[1:]:
                        errors.append(f"{path}:{aline}: skip needs a reason")
                elif b.kind == "file":
                    b.opts = {"file": words[1] if len(words) > 1 else ""}
                elif b.kind in ("run", "output"):
                    b.opts = parse_opts(words[1:])
                else:
                    errors.append(f"{path}:{aline}: unknown docs-test kind {b.kind!r}")
                b.tols = parse_tols(clauses, f"{path}:{aline}", errors)
            blocks.append(b)
            pending = None
            i = j + 1
            continue
        if "docs-test:" in lines[i]:
            start = offsets[i]
            m2 = ANNOT.search(text, start)
            if not m2:
                errors.append(f"{path}:{i + 1}: unterminated docs-test comment")
                break
            end_line = text.count("\n", 0, m2.end())
            body = m2[1].strip()
            if body.startswith(("quote", "table")):
                quotes.append(parse_quote(path, i + 1, body, lines, i, errors))
                pending = None
            else:
                pending = (body, i + 1)
            i = end_line + 1
            continue
        if lines[i].strip() and pending is not None:
            errors.append(f"{path}:{pending[1]}: docs-test annotation not followed by a fenced block")
            pending = None
        i += 1
    return Doc(path, blocks, quotes, errors)


def parse_quote(path: str, line: int, body: str, lines: list[str], i: int, errors: list) -> Quote:
    head, *rest = body.split("\n")
    head, *clauses = head.split(";")
    words = head.split()
    if len(words) < 2:
        errors.append(f"{path}:{line}: quote needs a block id")
        words.append("?")
    j = i - 1           # the paragraph right above: contiguous non-blank lines (text before the comment too)
    para = [lines[i].split("<!--")[0]]
    while j >= 0 and lines[j].strip() and not FENCE.match(lines[j]):
        if lines[j].rstrip().endswith("-->"):       # another quote right above: the paragraph is above it
            k = j
            while k >= 0 and "<!--" not in lines[k]:
                k -= 1
            if k < 0 or "docs-test: quote" not in lines[k]:
                break
            para.append(lines[k].split("<!--")[0])
            j = k - 1
            continue
        para.append(lines[j])
        j -= 1
    claims = []
    for r in rest:
        r = r.strip()
        if not r:
            continue
        parts = r.split(None, 2)
        if len(parts) != 3 or not re.fullmatch(NUM, parts[0]) or not valid_tol(parts[1]):
            errors.append(f"{path}:{line}: bad quote line {r!r} (want: NUMBER TOL REGEX)")
            continue
        try:
            re.compile(parts[2])
        except re.error as e:
            errors.append(f"{path}:{line}: bad regex {parts[2]!r}: {e}")
            continue
        claims.append(tuple(parts))
    q = Quote(line, words[1], "slow" in words[2:], "\n".join(reversed(para)), claims, words[0],
              parse_tols(clauses, f"{path}:{line}", errors))
    if q.kind == "table" and not q.paragraph.lstrip().startswith("|"):
        errors.append(f"{path}:{line}: docs-test table not right after a markdown table")
    return q


# ---------------------------------------------------------------------------------------------
# numbers

def digits_tol(lit: str) -> float:
    """Half a unit of the last printed digit of a number literal."""
    mant, _, exp = lit.lower().lstrip("+-").partition("e")
    dec = len(mant.split(".")[1]) if "." in mant else 0
    return 0.5 * 10.0 ** (int(exp or 0) - dec)


def close(lit: str, actual: float, tol: str) -> bool:
    want = float(lit)
    if tol == "any":
        return True
    if not math.isfinite(actual):
        return False
    if tol.startswith("order"):
        k = int(tol.partition("=")[2] or 1)
        if want == 0 or actual == 0:
            return want == actual
        return abs(math.log10(abs(actual) / abs(want))) <= k
    if tol.startswith("rel="):
        return abs(actual - want) <= float(tol[4:]) * abs(want)
    if tol.startswith("abs="):
        return abs(actual - want) <= float(tol[4:])
    return abs(actual - want) <= max(digits_tol(lit) * (1 + 1e-9), 1e-9 * abs(want))


def tol_for(lit: str, cell: int | None, tols: list) -> str:
    for target, tol in tols:
        if isinstance(target, tuple):
            if cell is not None and target[1] <= cell <= target[2]:
                return tol
        elif target == lit or len(target) > 2 and target[0] == target[-1] == "/" and re.fullmatch(target[1:-1], lit):
            return tol
    return "="


def pattern(expected: str):
    """A regex for the expected text: numbers captured, `...` any text, whitespace / table padding free.
    Returns (regex, [(literal, table cell or None, offset in expected)])."""
    out, nums = [], []
    pos = 0
    tok = re.compile(r"\.\.\.|\s+|\||" + r"(?<![\w.])" + NUM)
    text = expected.strip()
    for m in tok.finditer(text):
        if m.start() > pos:
            out.append(re.escape(text[pos:m.start()]))
        t = m[0]
        if t == "...":
            out.append(r"[\s\S]*?")
        elif t.isspace():
            out.append(r"\s+")
        elif t == "|":
            out.append(r"\s*\|\s*")
        else:
            line_start = text.rfind("\n", 0, m.start()) + 1
            line = text[line_start:m.start()]
            cell = line.count("|") if line.lstrip().startswith("|") else None
            out.append("(" + NUM + ")")
            nums.append((t, cell, m.start()))
        pos = m.end()
    out.append(re.escape(text[pos:]))
    rx = "".join(out)
    rx = re.sub(r"(\\s\+|\\s\*\\\|\\s\*)(\\s\+)+", r"\1", rx)
    return rx, nums


def compare_output(expected: str, actual: str, tols: list, search: bool) -> list[str]:
    """Failures (empty: the actual output matches the expected text and numbers)."""
    rx, nums = pattern(expected)
    actual = actual.strip()
    m = (re.search if search else re.fullmatch)(rx, actual)
    if not m:
        return [f"output does not match the documented text.\n--- documented:\n{expected.strip()}\n"
                f"--- printed:\n{actual}\n"]
    fails = []
    for (lit, cell, _), got in zip(nums, m.groups()):
        tol = tol_for(lit, cell, tols)
        if not close(lit, float(got), tol):
            fails.append(f"documented {lit}, printed {got} (tolerance {tol})")
    return fails


# ---------------------------------------------------------------------------------------------
# running

@dataclass
class Ran:
    output: str
    rc: int
    seconds: float
    parts: list = field(default_factory=list)   # console: [(command, expected, output, rc, want_rc)]


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e["COLUMNS"] = "200"
    e.pop("MHLA_DEBUG", None)
    return e


def sh(cmd: list[str], cwd: Path, timeout: float) -> tuple[str, int]:
    p = subprocess.run(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return p.stdout, p.returncode


def console_parts(text: str) -> list[tuple[str, str, int]]:
    parts, cmd, out = [], None, []
    for ln in text.split("\n"):
        if ln.startswith("$ "):
            if cmd is not None:
                parts.append((cmd, "\n".join(out)))
            cmd, out = ln[2:], []
        else:
            out.append(ln)
    if cmd is not None:
        parts.append((cmd, "\n".join(out)))
    res = []
    for cmd, exp in parts:
        m = re.search(r"#\s*exit\s+(\d+)\s*$", cmd)
        res.append((cmd, exp, int(m[1]) if m else 0))
    return res


def run_block(b: Block, cwd: Path) -> Ran:
    timeout = float(b.opts.get("timeout", 1800 if b.slow else 300))
    t0 = time.perf_counter()
    if b.lang == "console":
        parts, outs = [], []
        for cmd, exp, want in console_parts(b.text):
            out, rc = sh(["bash", "-c", cmd], cwd, timeout)
            parts.append((cmd, exp, out, rc, want))
            outs.append(out)
        return Ran("".join(outs), 0, time.perf_counter() - t0, parts)
    script = cwd / f".docs-test-{b.index}.{'py' if b.lang == 'python' else 'sh'}"
    script.write_text(b.text + "\n")
    if b.lang == "python":
        cmd = [sys.executable, script.name]
    elif b.lang in ("sh", "bash", "shell", ""):
        cmd = ["bash"] + ([] if b.opts.get("errexit") == "no" else ["-e", "-o", "pipefail"]) + [script.name]
    else:
        raise ValueError(f"cannot run a {b.lang!r} block")
    out, rc = sh(cmd, cwd, timeout)
    script.unlink()
    return Ran(out, rc, time.perf_counter() - t0)


def missing_modules(b: Block) -> list[str]:
    import importlib.util
    mods = [m for m in str(b.opts.get("requires", "")).split(",") if m]
    return [m for m in mods if importlib.util.find_spec(m) is None]


def run_doc(doc: Doc, workdir: Path, slow: bool) -> dict:
    """Run the doc's blocks in order in workdir; {block name: Ran}. Slow blocks only if slow."""
    results: dict = {}
    for b in doc.blocks:
        if b.kind not in ("run", "file") or (b.slow and not slow):
            continue
        if b.kind == "file":
            (workdir / b.opts["file"]).write_text(b.text + "\n")
            continue
        if missing_modules(b):
            continue
        for d in filter(None, str(b.opts.get("copy", "")).split(",")):
            if not (workdir / d).exists():
                shutil.copytree(ROOT / d, workdir / d, ignore=shutil.ignore_patterns("out", "__pycache__"))
        results[b.name] = run_block(b, workdir)
    return results


def check_doc(doc: Doc, results: dict, slow: bool, external=None) -> list[str]:
    """Every failure of the doc against the recorded outputs (no commands are run here).
    external(path) gives another doc's (Doc, results), for quotes of `path#block` (slow only)."""
    fails = list(doc.errors)
    names = [b.name for b in doc.blocks]
    dup = {n for n in names if names.count(n) > 1}
    fails += [f"{doc.path}: block id {n!r} used twice" for n in dup]
    last = None
    for b in doc.blocks:
        where = f"{doc.path}:{b.line}"
        if b.kind is None:
            if doc.path in OWNED:
                fails.append(f"{where}: fenced block without a docs-test annotation")
            continue
        if b.kind == "file" and not b.opts.get("file"):
            fails.append(f"{where}: file needs a name")
        if b.kind == "run":
            last = b
            if b.slow and not slow or missing_modules(b):
                continue
            r = results.get(b.name)
            if r is None:
                fails.append(f"{where}: block {b.name} did not run")
                continue
            if b.lang == "console":
                if [c for c, _, _ in console_parts(b.text)] != [p[0] for p in r.parts]:
                    fails.append(f"{where}: the commands differ from those that ran")
                    continue
                for (cmd, exp, want), (_, _, out, rc, _) in zip(console_parts(b.text), r.parts):
                    if rc != want:
                        fails.append(f"{where}: `{cmd}` exited {rc}, documented {want}:\n{out}")
                    if exp.strip():
                        fails += [f"{where}: `{cmd}`: {f}"
                                  for f in compare_output(exp, out, b.tols, search=True)]
            elif r.rc != int(b.opts.get("exit", 0)):
                fails.append(f"{where}: block {b.name} exited {r.rc}:\n{r.output[-3000:]}")
        if b.kind == "output":
            src = last if "of" not in b.opts else next(
                (c for c in doc.blocks if c.kind == "run" and c.name == b.opts["of"]), None)
            if src is None:
                fails.append(f"{where}: output of no run block")
                continue
            if src.slow and not slow or missing_modules(src):
                continue
            r = results.get(src.name)
            if r is None:
                continue
            fails += [f"{where} (output of {src.name}): {f}"
                      for f in compare_output(b.text, r.output, b.tols, search=b.opts.get("match") == "search")]
    blocks = {b.name: b for b in doc.blocks}
    for q in doc.quotes:
        where = f"{doc.path}:{q.line}"
        src, res = blocks.get(q.block), results
        if "#" in q.block:                  # another doc's block: runs only with -m slow
            if not slow or external is None:
                continue
            other, name = q.block.split("#", 1)
            odoc, res = external(other)
            src = next((c for c in odoc.blocks if c.kind == "run" and c.name == name), None)
            res = {q.block: res.get(name)} if src is not None and name in res else {}
            if src is not None:
                src = Block(src.index, src.line, src.lang, src.text, src.kind, src.opts)
                src.opts = {**src.opts, "id": q.block}
        if src is None or src.kind != "run":
            fails.append(f"{where}: quote of unknown run block {q.block!r}")
            continue
        if (src.slow or q.slow) and not slow or missing_modules(src):
            continue
        if q.kind == "table":
            r = res.get(q.block)
            if r is None:
                fails.append(f"{where}: block {q.block} did not run")
            else:
                fails += [f"{where} (table from {q.block}): {f}"
                          for f in compare_output(q.paragraph, r.output, q.tols, search=True)]
            continue
        literals = [m[0] for m in NUM_TOKEN.finditer(q.paragraph)]
        r = res.get(q.block)
        for lit, tol, rx in q.claims:
            if lit not in literals:
                fails.append(f"{where}: quoted number {lit} is not in the paragraph above")
                continue
            if r is None:
                fails.append(f"{where}: block {q.block} did not run")
                continue
            m = re.search(rx, r.output)
            if not m:
                fails.append(f"{where}: /{rx}/ not found in the output of {q.block}:\n{r.output[-2000:]}")
                continue
            got = m[1] if m.groups() else m[0]
            if not close(lit, float(got), tol):
                fails.append(f"{where}: documented {lit}, {q.block} printed {got} (tolerance {tol})")
    return fails


# ---------------------------------------------------------------------------------------------
# mutations: every checked number, edited, must make the check fail

def edit_number(lit: str, tol: str) -> str:
    """The literal edited by more than its tolerance."""
    if tol.startswith("order"):
        k = int(tol.partition("=")[2] or 1)
        v = float(lit)
        return repr(v * 10.0 ** (k + 2)) if v != 0 else "1.0"
    if tol.startswith(("rel=", "abs=")):
        v, t = float(lit), float(tol[4:])
        step = t * abs(v) if tol.startswith("rel=") else t
        return repr(v + 3 * step + (0.5 if v == 0 and step == 0 else 0))
    v = float(lit)
    if 1e-9 * abs(v) > digits_tol(lit):         # many digits: the 1e-9 relative floor applies
        return repr(v * (1 + 3e-9))
    # = : bump the last digit of the mantissa (by 2, so that the new literal is > 1/2 unit away)
    m = re.fullmatch(r"([-+]?[\d.]*?)(\d)((?:[eE][-+]?\d+)?)", lit)
    head, last, exp = m[1], int(m[2]), m[3]
    return f"{head}{(last + 2) % 10}{exp}" if last < 8 else f"{head}{last - 2}{exp}"


def mutations(text: str, doc: Doc):
    """(description, edited text) for every number that the check compares without -m slow."""
    blocks = {b.name: b for b in doc.blocks}
    last, src_of = None, {}
    for b in doc.blocks:
        if b.kind == "run":
            last = b
        if b.kind == "output":
            src_of[b.index] = blocks.get(b.opts["of"]) if "of" in b.opts else last

    def unchecked(src: Block | None) -> bool:
        return src is None or src.slow or bool(missing_modules(src))

    lines = text.split("\n")
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln) + 1)
    for b in doc.blocks:
        if b.kind != "output" or unchecked(src_of[b.index]):
            continue
        base = starts[b.line]            # the block's first body line
        body = b.text
        lead = len(body) - len(body.lstrip())
        for lit, cell, off in pattern(body)[1]:
            tol = tol_for(lit, cell, b.tols)
            if tol == "any":
                continue
            k = body.count("\n", 0, lead + off)          # the body line of the number
            at = base + lead + off + sum(b.cut[:k + 1])
            assert text[at:at + len(lit)] == lit, (text[at:at + len(lit)], lit)
            yield f"{doc.path}:{b.line} {lit}", text[:at] + edit_number(lit, tol) + text[at + len(lit):]
    for q in doc.quotes:
        if q.slow or unchecked(blocks.get(q.block)):
            continue
        if q.kind == "table":
            base = starts[q.line - 1 - q.paragraph.count("\n")]
            body = q.paragraph
            lead = len(body) - len(body.lstrip())
            for lit, cell, off in pattern(body)[1]:
                tol = tol_for(lit, cell, q.tols)
                if tol == "any":
                    continue
                at = base + lead + off
                assert text[at:at + len(lit)] == lit
                yield f"{doc.path}:{q.line} {lit}", text[:at] + edit_number(lit, tol) + text[at + len(lit):]
            continue
        for lit, tol, _ in q.claims:
            if tol == "any":
                continue
            base = starts[q.line - 1 - q.paragraph.count("\n")]
            region = text[base:starts[q.line]]
            m = re.search(r"(?<![\w.])" + re.escape(lit) + r"(?![\d])", region)
            if m:
                at = base + m.start()
                yield f"{doc.path}:{q.line} {lit}", text[:at] + edit_number(lit, tol) + text[at + len(lit):]
    for b in doc.blocks:
        if b.kind == "run" and b.lang == "console" and not unchecked(b):
            base = starts[b.line]
            off = 0
            for ln in b.text.split("\n"):
                if not ln.startswith("$ "):
                    for lit, cell, o in pattern(ln)[1] if ln.strip() else []:
                        tol = tol_for(lit, cell, b.tols)
                        if tol == "any":
                            continue
                        at = base + off + (len(ln) - len(ln.lstrip())) + o
                        if text[at:at + len(lit)] == lit:
                            yield (f"{doc.path}:{b.line} {lit}",
                                   text[:at] + edit_number(lit, tol) + text[at + len(lit):])
                off += len(ln) + 1


# ---------------------------------------------------------------------------------------------
# tests

_CACHE: dict = {}


def doc_results(path: str, tmp_path_factory, slow: bool) -> tuple[Doc, dict]:
    key = (path, slow)
    if key not in _CACHE:
        doc = parse(path, (ROOT / path).read_text())
        work = tmp_path_factory.mktemp(Path(path).stem + ("-slow" if slow else ""))
        _CACHE[key] = (doc, run_doc(doc, work, slow))
    return _CACHE[key]


@pytest.mark.parametrize("path", all_docs())
def test_doc(path, tmp_path_factory):
    doc, results = doc_results(path, tmp_path_factory, slow=False)
    fails = check_doc(doc, results, slow=False)
    assert not fails, "\n\n".join(fails)


@pytest.mark.slow
@pytest.mark.parametrize("path", all_docs())
def test_doc_slow(path, tmp_path_factory):
    doc = parse(path, (ROOT / path).read_text())
    if not any(b.slow for b in doc.blocks) and not any("#" in q.block or q.slow for q in doc.quotes):
        pytest.skip("no slow blocks")
    doc, results = doc_results(path, tmp_path_factory, slow=True)
    fails = check_doc(doc, results, slow=True,
                      external=lambda other: doc_results(other, tmp_path_factory, slow=True))
    assert not fails, "\n\n".join(fails)


@pytest.mark.parametrize("path", all_docs())
def test_edited_number_fails(path, tmp_path_factory):
    """Editing any checked number of the doc (beyond its tolerance) makes the check fail."""
    doc, results = doc_results(path, tmp_path_factory, slow=False)
    if check_doc(doc, results, slow=False):
        pytest.skip("the doc itself fails (test_doc)")
    text = (ROOT / path).read_text()
    n, passed = 0, []
    for what, edited in mutations(text, doc):
        e = parse(path, edited)
        if len(e.blocks) != len(doc.blocks):
            continue
        n += 1
        if not check_doc(e, results, slow=False):
            passed.append(what)
    assert not passed, f"edited numbers not caught: {passed}"
    if _has_fast_outputs(doc) or any(not q.slow for q in doc.quotes):
        assert n > 0  # (outputs and quotes of slow blocks are checked with -m slow only, and not edited here)


def _has_fast_outputs(doc: Doc) -> bool:
    """Whether an output block of the doc belongs to a run block that runs without -m slow (and whose
    required modules are installed)."""
    last, blocks = None, {b.name: b for b in doc.blocks}
    for b in doc.blocks:
        if b.kind == "run":
            last = b
        if b.kind == "output":
            src = blocks.get(b.opts["of"]) if "of" in b.opts else last
            if src is not None and not src.slow and not missing_modules(src):
                return True
    return False


def test_checker(tmp_path):
    """The checker itself, on a small doc: numbers, tolerances, quotes, console exit codes."""
    text = "\n".join([
        "# t", "",
        "<!-- docs-test: run id=a -->", "```sh", "echo 'lambda_min = 1.2345, tiny = 7.6e-15, took 3.2 s'",
        "python -c 'print(2 ** 0.5)'", "```",
        "<!-- docs-test: output; 7.1e-15 order; 9 any -->", "```", "lambda_min = 1.2345, tiny = 7.1e-15, took 9 s",
        "1.414", "```", "",
        "The minimum is 1.234 here.", "<!-- docs-test: quote a", r"1.234 rel=1e-3 lambda_min = (\S+),", "-->", "",
        "<!-- docs-test: run id=c -->", "```console", "$ echo '{\"x\": 3, \"y\": 4}'; exit 1   # exit 1",
        '{"x": 3, ...}', "```", "",
        "<!-- docs-test: skip an example -->", "```yaml", "a: 1", "```", ""])
    doc = parse("README.md", text)
    assert not doc.errors
    res = run_doc(doc, tmp_path, slow=False)
    assert check_doc(doc, res, slow=False) == []
    muts = list(mutations(text, doc))
    assert len(muts) == 5      # 1.2345, 7.1e-15, 1.414, the quoted 1.234, the console's 3 (not 3.2: any)
    for what, edited in muts:
        assert check_doc(parse("README.md", edited), res, slow=False), what
    for bad in (text.replace("1.414", "1.5"), text.replace("# exit 1", "# exit 0"),
                text.replace("took 9 s", "took 9 min"), text.replace("<!-- docs-test: skip an example -->", ""),
                text.replace("docs-test: skip an example", "docs-test: skip")):
        assert check_doc(parse("README.md", bad), res, slow=False)
    # other docs (formats.md, real_model.md): unannotated blocks are not required to run
    assert check_doc(parse("docs/formats.md", text.replace("<!-- docs-test: skip an example -->", "")),
                     res, slow=False) == []
    assert close("7.6e-15", 2e-15, "order") and not close("7.6e-15", 2e-17, "order")
    assert close("18.58", 18.584825, "=") and not close("18.58", 18.5951, "=")
    assert close("400", 400.0, "=") and not close("400", 401.0, "=")


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_linked_images_exist_and_are_small() -> None:
    """Every image a doc shows (`![...](img/x.png)`) is a committed PNG under 100 KB, and the docs that draw
    figures show them (issue 26: Fig. 1, 2a/2b, the sample complexity, the DFA executor, a spectrum)."""
    shown = {}
    for doc in all_docs():
        for link in IMAGE.findall((ROOT / doc).read_text()):
            path = ((ROOT / doc).parent / link).resolve()
            assert path.is_file(), f"{doc}: image {link} does not exist"
            data = path.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 100_000, (doc, link, len(data))
            shown.setdefault(doc, set()).add(path.name)
    assert {"fig1_teacher.png", "fig2_assoc.png", "sample_complexity.png"} <= shown.get("docs/reproduction.md", set())
    assert "dfa_executor.png" in shown.get("docs/dfa_executor.md", set())
    assert "spectrum.png" in shown.get("docs/spectrum.md", set())


LINK = re.compile(r"\[([^\]]+)\]\(([^)\s#]+)(?:#([^)\s]+))?\)")


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def performance_figures(readme: str) -> list[tuple[str, str, str | None, list[float]]]:
    """(figure cell, linked page, anchor, numbers) of each row of the README's Performance table: the
    numbers are those of the figure cell and the decimals of the baseline cell (`python -c pass`: 0.038 s)."""
    section = readme.split("\n## Performance", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("measure", "---"):
            continue
        link = LINK.search(cells[1])
        numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", LINK.sub(r"\1", cells[1]))]
        numbers += [float(x) for x in re.findall(r"(?<![\w.])\d+\.\d+", cells[2])]
        rows.append((cells[1], link[2] if link else None, link[3] if link else None, numbers))
    return rows


def check_performance_figures(readme: str, pages: dict[str, str]) -> list[str]:
    """Why the README's performance figures are not quotes of the performance pages they link to: a row
    without a link, a link to no such page or heading, or a number that no table or text of that page
    prints. The pages hold each figure where its benchmark's output stands; the README quotes it."""
    bad = []
    rows = performance_figures(readme)
    if not rows:
        return ["README.md: no Performance table"]
    for cell, page, anchor, numbers in rows:
        if page is None:
            bad.append(f"{cell}: no link to the page that holds the figure")
            continue
        text = pages.get(page)
        if text is None:
            bad.append(f"{cell}: {page} does not exist")
            continue
        if anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}:
            bad.append(f"{cell}: {page} has no heading #{anchor}")
        printed = {float(x) for x in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text)}
        bad += [f"{cell}: {x:g} is not on {page}" for x in numbers if x not in printed]
    return bad


def test_readme_performance_figures_quote_their_pages() -> None:
    """Each figure of the README's Performance table links to the performance page whose table prints it,
    and that page holds the same number (so the two cannot drift apart); an edited figure or link fails."""
    readme = (ROOT / "README.md").read_text()
    pages = {p: (ROOT / p).read_text() for p in all_docs() if p.startswith("docs/performance")}
    assert check_performance_figures(readme, pages) == []
    first = performance_figures(readme)[0][0]
    number = re.search(r"\d+\.\d+", first)[0]
    assert check_performance_figures(readme.replace(first, first.replace(number, number + "7")), pages)
    assert check_performance_figures(readme.replace(first, re.sub(r"\]\([^)]*\)", "]", first)), pages)
    assert check_performance_figures(readme.replace("#small-d-is-io-bound", "#small-d"), pages)


# The longest table cell of docs/api.md: a table says what a name is and links the API reference, which
# renders the docstring that carries the detail (docs/api_reference.md).
API_CELL_MAX = 250
_CELL_SPLIT = re.compile(r"(?<!\\)\|")  # GitHub and MkDocs split a row at every unescaped pipe, in code too


def table_cell_problems(text: str, limit: int = API_CELL_MAX, name: str = "docs/api.md") -> list[str]:
    """The cells of a markdown page's tables longer than `limit` characters, and the rows whose cell count
    is not their header's (an unescaped `|` in a cell, e.g. a norm ||x||, splits it)."""
    problems, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in _CELL_SPLIT.split(line.strip())[1:-1]]
        if header is None:
            header = len(cells)
        elif len(cells) != header:
            problems.append(f"{name}:{number}: {len(cells)} cells in a table of {header} columns")
        problems += [f"{name}:{number}: a cell of {len(c)} characters (> {limit}): {c[:60]}..."
                     for c in cells if len(c) > limit]
    return problems


def test_api_table_cells_stay_short() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    assert text.count("\n| ") >= 50  # the tables are there
    assert table_cell_problems(text) == []


def test_table_cell_problems_at_the_limit() -> None:
    row = "| name | " + "x" * API_CELL_MAX + " |\n"
    table = "| name | what |\n|---|---|\n"
    assert table_cell_problems(table + row) == []
    assert table_cell_problems(table + row.replace("x", "xx", 1)) == [
        f"docs/api.md:3: a cell of {API_CELL_MAX + 1} characters (> {API_CELL_MAX}): {'x' * 60}..."]
    assert table_cell_problems(table + "| `f` | the norm ||p|| |\n") == [
        "docs/api.md:3: 6 cells in a table of 2 columns"]
    assert table_cell_problems(table + "| `f` | the norm \\|\\|p\\|\\| |\n\ntext\n\n| a |\n|---|\n| b |\n") == []


# Columns a table of real_model.md may have: more hide behind a sideways scroll on the site's page.
MAX_TABLE_COLUMNS = 9


def test_real_model_tables_fit_the_page_and_are_the_example_s_own() -> None:
    """real_model.md's tables have at most MAX_TABLE_COLUMNS columns; the first two are what the example's
    `table` prints from their rows (so the slow run's comparison holds), and the quotes of the text find their
    numbers in that output."""
    from conftest import load_example

    path = ROOT / "docs" / "real_model.md"
    text = path.read_text()
    widths = [line.count("|") - 1 for line in text.splitlines() if line.startswith("|---")]
    assert widths and max(widths) <= MAX_TABLE_COLUMNS, widths
    doc = parse(str(path), text)
    tables = [q for q in doc.quotes if q.kind == "table" and q.block == "real"]
    heads = [[c.strip() for c in q.paragraph.strip().splitlines()[0].strip("|").split("|")] for q in tables]
    ex = load_example(ROOT / "examples" / "real_model.py", "real_model_tables")
    first, second = (tables[heads.index(list(h))] for h in ex.TABLE_HEADS)
    rows = []
    for a, b in zip(*(q.paragraph.strip().splitlines()[2:] for q in (first, second))):
        ca, cb = ([c.strip() for c in r.strip().strip("|").split("|")] for r in (a, b))
        assert ca[:3] == cb[:3]
        rows.append({"d": int(ca[0]), "normalize": ca[1], "n_features": int(ca[2]), "r2_train": float(ca[3]),
                     "r2_heldout": float(ca[4]), "r2_heldout_last": float(ca[5]), "r2_head": float(ca[6]),
                     "r2_reduction": float(ca[7]), "heads": int(ca[8].rstrip("*")),
                     "spectrum_converged": not ca[8].endswith("*"), "certify_full": cb[3] == "yes",
                     "certify_observed": cb[4] == "yes", "heldout_determined": int(cb[5].split("/")[0]),
                     "heldout_probes": int(cb[5].split("/")[1]), "ridge_cv": float(cb[6]),
                     "r2_heldout_cv": float(cb[7]), "r2_heldout_cv_last": float(cb[8])})
    out = ex.table(rows)
    for q in (first, second):
        assert compare_output(q.paragraph, out, q.tols, search=True) == []
    # the text's quotes of these two tables (a row of d and normalize, or of d, normalize and psi) find their number
    quoted = [(lit, rx) for q in doc.quotes if q.kind == "quote" and q.block == "real" for lit, _, rx in q.claims
              if re.match(r"\\\| \d+ \\\| (none|length) \\\|", rx) and "MHLA" not in rx and "affine" not in rx]
    assert len(quoted) >= 7, quoted
    for lit, rx in quoted:
        m = re.search(rx, out)
        assert m and float(m.group(1)) == float(lit), (lit, rx)


# Parameters a signature quoted in api.md may leave out without "...": the plumbing of the CLI (progress bars,
# chunking, provenance, the map backends, a path for messages).
_PLUMBING = {"progress", "chunk_size", "map", "inputs", "path", "self", "cls", "parallel"}
# Signatures api.md quotes with their leading parameters only and no "..." (to be completed, or given "..."):
# (name, the parameters left out). The test fails when one of these is completed, so the list only shrinks.
_API_GAPS = {
    "MHLA": {"bias_terms"}, "learn.check_fit_file": {"attention", "bias_terms"},
    "load_features": {"attention", "bias_terms", "affine_from", "read"}, "predict": {"wide", "layout"},
    "forward.predict_samples": {"wide"}, "folds.load_for_cv": {"attention", "bias_terms", "read"},
    "accumulate.chunk_features": {"device"}, "Heads.from_arrays": {"bias", "affine", "maps"},
    "spectrum.spectrum": {"W", "max_iter", "tol"}, "spectrum.outlier_heads": {"spec", "max_iter"},
    "parallel.make_map": {"backend", "timeout"}, "forward_heads": {"layout"},
}


# Parameters api.md names otherwise than the code (none now; a name quoted wrong fails the test).
_API_WRONG: tuple[str, ...] = ()


def _api_object(name: str, section: str):  # noqa: ANN202 (a module, class, function or method)
    """The object a name of api.md stands for: in the MHLA section a method of MHLA; else an attribute path from
    mhla_cli or from the mhla_cli module of its first part's name (None when not found)."""
    import importlib
    import pkgutil

    import mhla_cli

    bases = [mhla_cli.MHLA] if "MHLA" in section and name != "MHLA" else [mhla_cli]
    parts = name.split(".")
    mods = {m.name.rsplit(".", 1)[-1]: m.name for m in pkgutil.walk_packages(mhla_cli.__path__, "mhla_cli.")}
    if len(parts) > 1 and parts[0] in mods:
        try:
            bases.append((importlib.import_module(mods[parts[0]]), parts[1:]))
        except ImportError:  # a module of an optional extra (mhla_cli.model.splice: torch) not installed here
            return None
    for base in bases:
        obj, rest = (base if isinstance(base, tuple) else (base, parts))
        try:
            for p in rest:
                obj = getattr(obj, p)
            return obj
        except AttributeError:
            continue
    return None


def test_api_signatures_are_the_real_ones() -> None:
    """Every call quoted in the first column of api.md's tables, `name(a, b=1, ..., c=None)`, names parameters
    the real signature has (inspect.signature), in its order, with its defaults; one quoted without "..."
    leaves out none but the plumbing (_PLUMBING) and the known gaps (_API_GAPS)."""
    import ast
    import inspect

    section, checked, gaps, wrong = "", 0, {}, []
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("#"):
            section = line
        if not line.startswith("| `") or section.startswith("## Internal"):
            continue
        prefix = ""  # `a.b.f(...)` / `g(...)` in one cell: g of the module a.b first
        for name, args in re.findall(r"`([A-Za-z_][\w.]*)\(([^`]*)\)`", line.split(" | ")[0]):
            obj = (prefix and _api_object(prefix + name, section)) or _api_object(name, section)
            if "." in name:
                prefix = name.rsplit(".", 1)[0] + "."
            if obj is None:
                continue
            real = [p for p in inspect.signature(obj).parameters.values() if p.name not in ("self", "cls")]
            names = [p.name for p in real]
            quoted = [a.strip() for a in args.split(",") if a.strip() and a.strip() not in ("*", "**")]
            at = -1
            for q in quoted:
                if q == "...":
                    continue
                key, eq, default = q.partition("=")
                key = key.strip().lstrip("*")
                if key not in names or names.index(key) <= at:
                    wrong.append(f"{name}({args}): {key!r} is not the next of {names}")
                    continue
                at = names.index(key)
                if eq and ast.literal_eval(default.strip()) != real[at].default:
                    wrong.append(f"{name}: {key}={default} but the default is {real[at].default!r}")
            if "..." not in quoted and not any(w.startswith(f"{name}(") for w in wrong):
                left = set(names) - {q.partition("=")[0].strip().lstrip("*") for q in quoted} - _PLUMBING
                if left:
                    gaps[name] = left
            checked += 1
    assert checked > 40, checked
    assert wrong == list(_API_WRONG), wrong
    assert gaps == _API_GAPS, gaps
