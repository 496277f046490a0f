"""The documentation, checked: README.md stays under 300 lines and links every guide; every
relative link in README.md, ARCHITECTURE.md, BENCHMARKS.md and docs/*.md leads to a file (and
an anchor to a heading); every command of the repository's entry points in a ``bash`` block
parses with that entry point's own flags; the names Python blocks import exist; the README's
API snippet runs; and blocks marked ``<!-- doc-check: run -->`` run for real.

Commands are parsed, never run (except the marked blocks), in one subprocess for all of them
(``_parse_worker``): absl entry points (train.py, eval.py, generate.py, the absl benchmarks) are
loaded as modules, without ``app.run``, and their flags parsed by absl, so an unknown flag, a
missing config file or a ``--config.x.y=v`` override of a field that does not exist fails;
argparse tools are parsed by their own parser (``build_parser``, else their ``main`` with
``ArgumentParser.parse_args`` stopped after parsing); ``make`` targets must be in the Makefile.
A ``--config`` path outside ``configs/`` (``runs/kimi/config.py``, written by an earlier
command) is replaced by configs/tiny.py to parse the other flags.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDES = sorted((REPO / "docs").glob("*.md"))
DOCS = [README, *GUIDES]  # where commands and snippets are checked
LINKED = [*DOCS, REPO / "ARCHITECTURE.md", REPO / "BENCHMARKS.md"]  # where links are checked
README_MAX_LINES = 300
RUN_MARKER = "<!-- doc-check: run -->"
STANDIN_CONFIG = "configs/tiny.py"  # parses the flags of a command whose config a run wrote
REPO_PACKAGES = ("kimi_k3", "pallas_kernels", "configs", "benchmarks", "tests")


# ---------------------------------------------------------------------------------------------
# Reading Markdown
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its language, text, file and first line, and whether the line
    before it is RUN_MARKER."""

    lang: str
    text: str
    where: str
    run: bool


FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


def code_blocks(text: str, name: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        blocks.append(Block(lang, "\n".join(body), f"{name}:{start + 1}", before == RUN_MARKER))
        i += 1
    return blocks


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code (links inside code are not links)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.startswith(fence):
            fence = None
        elif fence is None:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of ``path`` (or of ``text``, as if it were at ``path``) whose file,
    or whose anchor in a Markdown file, does not exist."""
    text = path.read_text() if text is None else text
    bad = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(REPO)}: ({target})"
        if not dest.exists():
            bad.append(f"{where}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return bad


# ---------------------------------------------------------------------------------------------
# Commands in bash blocks
# ---------------------------------------------------------------------------------------------

OPERATORS = {"&&", "||", ";", "|", "&"}


def shell_lines(block: str) -> list[tuple[int, str]]:
    """The block's commands as (line offset in the block, text): continuation lines joined,
    comment lines dropped."""
    out, start, parts = [], 0, []
    for i, line in enumerate(block.splitlines()):
        if not parts:
            start = i
        parts.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            text = " ".join(p.strip() for p in parts).strip()
            if text and not text.startswith("#"):
                out.append((start, text))
            parts = []
    return out


def tokens(line: str) -> list[str]:
    """Shell words of ``line``, operators as their own words, ``$VAR`` replaced by 0 (an
    integer flag stays an integer, a path stays a path); a quoted word holding a command
    (``gcloud ... --command="cd x && python ..."``) is split again."""
    lex = shlex.shlex(re.sub(r"\$\{?\w+\}?", "0", line), posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, "#"
    out = []
    for word in lex:
        if " " in word and re.search(r"(^|[\s/])python3?\s", word):
            out += tokens(word.replace("=", " ", 1) if word.startswith("--") else word)
        else:
            out.append(word)
    return out


@dataclasses.dataclass
class Command:
    """One invocation of a repository entry point: ``kind`` is "script" (python X.py),
    "module" (python -m a.b), "make" or "pytest"; ``argv`` the arguments after it."""

    kind: str
    target: str
    argv: list[str]
    where: str
    line: str


def is_python(word: str) -> bool:
    return os.path.basename(word) in ("python", "python3") or word == sys.executable


def commands(line: str, where: str) -> list[Command]:
    words, out = tokens(line), []
    for i, word in enumerate(words):
        end = next((j for j in range(i + 1, len(words)) if words[j] in OPERATORS), len(words))
        if is_python(word) and i + 1 < end:
            if words[i + 1] == "-m" and i + 2 < end:
                module = words[i + 2]
                if module == "pytest":
                    out.append(Command("pytest", module, words[i + 3:end], where, line))
                elif module.split(".")[0] in REPO_PACKAGES:
                    out.append(Command("module", module, words[i + 3:end], where, line))
            elif words[i + 1].endswith(".py"):
                out.append(Command("script", words[i + 1], words[i + 2:end], where, line))
        elif word == "make" and (i == 0 or words[i - 1] in OPERATORS):
            out.append(Command("make", "make", words[i + 1:end], where, line))
    return out


def documented_commands(blocks: list[Block]) -> list[Command]:
    out = []
    for block in blocks:
        if block.lang in ("bash", "sh", "shell", "console"):
            file, first = block.where.rsplit(":", 1)
            for offset, line in shell_lines(block.text):
                out += commands(line, f"{file}:{int(first) + 1 + offset}")
    return out


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def parser_kind(path: Path) -> str:
    """"absl" (flags parsed by ``app.run``, or ``kimi_k3.cli.run`` over it), "argparse" (a
    package's ``__main__``, or a file that builds a parser) or "plain" (runs without
    arguments)."""
    source = path.read_text()
    if re.search(r"\b(app|cli)\.run\(", source):
        return "absl"
    if path.name == "__main__.py" or re.search(r"\bargparse\b|\bbuild_parser\b", source):
        return "argparse"
    return "plain"


def static_problems(cmd: Command) -> tuple[list[str], dict | None]:
    """(problems found without importing anything, the job for the parse worker or None)."""
    where = f"{cmd.where}: {cmd.line}"
    if cmd.kind == "make":
        missing = [t for t in cmd.argv if not t.startswith("-") and "=" not in t
                   and t not in makefile_targets()]
        return [f"{where}: no Makefile target {t!r}" for t in missing], None
    if cmd.kind == "pytest":
        bad = []
        for arg in (a for a in cmd.argv if not a.startswith("-")):
            file, _, test = arg.partition("::")
            path = REPO / file
            if not path.is_file():
                bad.append(f"{where}: no test file {file}")
            elif test and not re.search(rf"^def {re.escape(test.split('[')[0])}\(",
                                        path.read_text(), re.M):
                bad.append(f"{where}: no test {test} in {file}")
        return bad, None
    if cmd.kind == "module":
        path = module_file(cmd.target)
        if path is None:
            return [f"{where}: no module {cmd.target} in the repository"], None
    else:
        path = REPO / cmd.target
        if not path.is_file():
            return [f"{where}: no script {cmd.target}"], None
    kind = parser_kind(path)
    if kind == "plain":
        if cmd.argv:
            return [f"{where}: {cmd.target} takes no arguments"], None
        if "__main__" not in path.read_text():
            return [f"{where}: {cmd.target} does nothing when run"], None
        return [], None
    argv = list(cmd.argv)
    if kind == "absl":
        for i, arg in enumerate(argv):
            m = re.match(r"--config=([^:]+)(:.*)?$", arg)
            if m and not m.group(1).startswith("configs/") and not (REPO / m.group(1)).is_file():
                argv[i] = f"--config={STANDIN_CONFIG}"
        # A tool run as cli.run(main, config_from=(...)) takes --config from the run folder of
        # one of those flags when --config is absent; the doc's run folders do not exist here.
        m = re.search(r"config_from=\(([^)]*)\)", path.read_text())
        named = re.findall(r"[\"'](\w+)[\"']", m.group(1)) if m else []
        if (not any(a.startswith("--config=") for a in argv)
                and any(a.startswith(f"--{n}=") for n in named for a in argv)):
            argv.insert(0, f"--config={STANDIN_CONFIG}")
    return [], {"kind": kind, "module": cmd.target if cmd.kind == "module" else None,
                "script": str(path), "argv": argv, "where": where}


# ---------------------------------------------------------------------------------------------
# The parse worker (a subprocess: absl's flags are process-global)
# ---------------------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised once a tool's arguments have parsed: its main goes no further."""


def _parse_absl(job: dict, loaded: dict) -> str | None:
    import ml_collections
    from absl import flags

    FLAGS = flags.FLAGS
    script = job["script"]
    if script not in loaded:
        for name in loaded.pop("_defined", ()):  # the previous script's flags
            delattr(FLAGS, name)
        before = set(FLAGS)
        spec = importlib.util.spec_from_file_location(f"_doc_check_{len(loaded)}", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)  # defines the flags; app.run is not reached
        loaded.clear()
        loaded[script] = module
        loaded["_defined"] = set(FLAGS) - before
    FLAGS.unparse_flags()
    defined, saved_argv = set(FLAGS), sys.argv
    sys.argv = [script, *job["argv"]]  # config_flags reads the --config.* overrides from here
    try:
        rest = FLAGS(sys.argv)
    finally:
        sys.argv = saved_argv
        for name in set(FLAGS) - defined:  # the overrides' flags, defined while parsing
            delattr(FLAGS, name)
    if rest[1:]:
        return f"unexpected arguments {rest[1:]}"
    for name in loaded["_defined"]:  # a config file that failed to load fails when it is read
        value = FLAGS[name].value
        if FLAGS[name].parser.flag_type() == "config object" and value is not None:
            if not isinstance(value, ml_collections.ConfigDict):
                value.lock()  # raises the load error
    if os.path.basename(script) == "eval.py":  # --checkpoint=LABEL=PATH@CONFIG: CONFIG loads
        from kimi_k3.config_files import load_config
        from kimi_k3.evaluation import CheckpointSpec

        for text in FLAGS["checkpoint"].value:
            spec = CheckpointSpec.parse(text)
            if spec.config and spec.config.split(":")[0].startswith("configs/"):
                load_config(spec.config)
    return None


def _parse_argparse(job: dict) -> None:
    import argparse

    if job["module"]:
        module = importlib.import_module(job["module"].removesuffix(".__main__"))
    else:
        spec = importlib.util.spec_from_file_location("_doc_check_tool", job["script"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    argv = job["argv"]
    if callable(getattr(module, "build_parser", None)):
        module.build_parser().parse_args(argv)
        return
    # Run main only as far as its parser: parse_args (or a direct parse_known_args) raises
    # _Parsed once the arguments have parsed.
    orig_args, orig_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        out = orig_known(self, args, namespace)
        if depth[0] == 0:
            raise _Parsed
        return out

    def parse_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            orig_args(self, args, namespace)
        finally:
            depth[0] -= 1
        raise _Parsed

    main = getattr(module, "main", None) or getattr(module, "parse_args", None)
    if main is None:
        raise RuntimeError("neither build_parser, main nor parse_args to parse with")
    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    saved_argv = sys.argv
    sys.argv = [job["script"], *argv]
    try:
        params = inspect.signature(main).parameters
        main(argv) if params else main()
        raise RuntimeError("main returned without parsing its arguments")
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = orig_args
        argparse.ArgumentParser.parse_known_args = orig_known
        sys.argv = saved_argv


def _parse_worker() -> None:
    """Reads the jobs (JSON) from stdin; prints ``RESULT`` and a JSON list of one
    [job index, None or the error] per job. Jobs of one script go together, so each absl
    script is loaded once."""
    jobs = json.load(sys.stdin)
    results, loaded = [], {}
    for index in sorted(range(len(jobs)), key=lambda i: jobs[i]["script"]):
        job = jobs[index]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                if job["kind"] == "absl":
                    message = _parse_absl(job, loaded)
                else:
                    _parse_argparse(job)
                    message = None
        except SystemExit:
            message = (err.getvalue().strip().splitlines() or ["exited"])[-1]
        except Exception as e:  # any failure to parse is the finding
            lines = str(e).strip().splitlines() or [""]
            message = f"{type(e).__name__}: {lines[-1]}"
        results.append((index, message))
    print("RESULT " + json.dumps(results))


def parse_in_subprocess(jobs: list[dict]) -> list[str | None]:
    """Each job's parse error (None: it parsed), in the order of ``jobs``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", "from tests.test_docs import _parse_worker; "
                        "_parse_worker()"], input=json.dumps(jobs), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "RESULT " in p.stdout, p.stderr[-4000:]
    return [message for _, message in sorted(json.loads(p.stdout.split("RESULT ", 1)[1]))]


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in code_blocks(path.read_text(), str(path.relative_to(REPO)))]


def test_readme_is_short_and_links_every_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert GUIDES, "docs/ has no guide"
    targets = LINK.findall(prose(README.read_text()))
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in targets}
    assert not [g.name for g in GUIDES if g.resolve() not in linked], "guides the README does not link"


BENCHMARKS_MAX_LINES = 462
RESULTS_MAX_BYTES = 4 << 20


def test_benchmarks_is_a_reference_of_current_figures():
    """BENCHMARKS.md stays a reference (one current table per benchmark), and
    benchmarks/results/ holds only what it quotes: small, and every file linked from it."""
    text = (REPO / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= BENCHMARKS_MAX_LINES
    results = REPO / "benchmarks" / "results"
    files = [f for f in results.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= RESULTS_MAX_BYTES
    unquoted = [str(f.relative_to(REPO)) for f in files
                if str(f.relative_to(REPO)) not in text and f.name not in text]
    assert not unquoted, f"results BENCHMARKS.md does not quote: {unquoted}"


def test_relative_links_lead_to_files_and_headings():
    bad = [problem for path in LINKED for problem in broken_links(path)]
    assert not bad, "\n".join(bad)
    # and the check sees a broken file, a broken anchor, and ignores code and URLs
    probe = ("[a](docs/no_such_guide.md) [b](README.md#no-such-heading) [c](README.md#tests) "
             "`[d](nowhere.md)` [e](https://example.com/x.md)")
    found = broken_links(README, probe)
    assert len(found) == 2 and "no_such_guide" in found[0] and "no-such-heading" in found[1], found


# Commands that must fail the check, one per kind of mistake it is there to catch.
BAD_COMMANDS = {
    "unknown flag": "python train.py --config=configs/tiny.py --workdir=w --no_such_flag=1",
    "misspelt field": "python train.py --config=configs/tiny.py --workdir=w --config.train.stepz=5",
    "wrong type": "python train.py --config=configs/tiny.py --workdir=w --config.train.steps=many",
    "bad flag value": "python eval.py --config=configs/tiny.py --workdir=w --context_lengths=1x",
    "missing config": "python eval.py --config=configs/no_such.py --workdir=w",
    "missing @CONFIG": "python eval.py --config=configs/tiny.py --workdir=w --checkpoint=a=r@configs/nope.py",
    "bad config argument": "python train.py --config=configs/ablate_ratio.py:ratios=3 --workdir=w",
    "missing required flag": "python generate.py --prompt=x",
    "argparse flag": "python -m kimi_k3.data a.txt --out=x --no_such_flag",
    "missing argparse flag": "python -m kimi_k3.hf import --workdir=w",
    "missing script": "python no_such_script.py",
    "missing module": "python -m kimi_k3.no_such_module",
    "missing target": "make no_such_target",
    "missing test": ".venv/bin/python -m pytest 'tests/test_docs.py::test_no_such_test'",
}


def test_every_documented_command_parses_with_its_entry_points_flags():
    cmds = documented_commands(all_blocks())
    kinds = {c.kind for c in cmds}
    assert {"script", "module", "make"} <= kinds, kinds  # the extraction finds them at all
    bad_cmds = {name: commands(line, f"bad:{name}") for name, line in BAD_COMMANDS.items()}
    assert all(len(c) == 1 for c in bad_cmds.values()), bad_cmds

    problems, jobs = [], []
    for cmd in cmds + [c[0] for c in bad_cmds.values()]:
        found, job = static_problems(cmd)
        problems += found
        jobs += [job] if job else []
    parsed = parse_in_subprocess(jobs)
    problems += [f"{job['where']}: {message}" for job, message in zip(jobs, parsed, strict=True)
                 if message]

    good = [p for p in problems if not p.startswith("bad:")]
    assert not good, "\n".join(good)
    # and every bad command was caught
    caught = {name for name in BAD_COMMANDS if any(p.startswith(f"bad:{name}:") for p in problems)}
    assert caught == set(BAD_COMMANDS), f"not caught: {set(BAD_COMMANDS) - caught}\n" + "\n".join(problems)


def test_python_blocks_compile_and_import_names_that_exist():
    bad = []
    for block in all_blocks():
        if block.lang != "python":
            continue
        try:
            tree = ast.parse(block.text)
        except SyntaxError as e:
            bad.append(f"{block.where}: {e}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in REPO_PACKAGES:
                module = importlib.import_module(node.module)
                bad += [f"{block.where}: {node.module} has no {a.name}" for a in node.names
                        if not hasattr(module, a.name)]
    assert not bad, "\n".join(bad)


def readme_snippet() -> Block:
    snippets = [b for b in code_blocks(README.read_text(), "README.md") if b.lang == "python"]
    assert len(snippets) == 1, "README.md should hold one python block: the API tour"
    return snippets[0]


def test_readme_api_snippet_runs(tmp_path, jax_cache):
    """In a subprocess from the repository root (the snippet loads configs/tiny.py by a
    relative path), where XLA compiles these small programs without its optimisations."""
    from tests.helpers import env

    block = readme_snippet()
    script = tmp_path / "readme_snippet.py"
    script.write_text(block.text)
    p = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env(jax_cache),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{block.where}:\n{p.stderr[-3000:]}"
    assert p.stdout.startswith("KKKM\n"), p.stdout


def marked(lang: str) -> list[Block]:
    return [b for b in all_blocks() if b.run and b.lang == lang]


def test_marked_python_blocks_run(monkeypatch):
    blocks = marked("python")
    assert blocks, f"no python block is marked {RUN_MARKER}"
    monkeypatch.chdir(REPO)
    for block in blocks:
        exec(compile(block.text, block.where, "exec"), {"__name__": "doc_block"})


def test_marked_bash_blocks_run(tmp_path, jax_cache):
    """Each command of a marked block, in order, from the repository root, with ``runs/``
    pointed at a temporary folder."""
    from tests.helpers import env

    blocks = marked("bash")
    assert blocks, f"no block is marked {RUN_MARKER}"
    runs = str(tmp_path / "runs") + "/"
    for block in blocks:
        for _, line in shell_lines(block.text):
            words = [re.sub(r"(^|=)runs/", lambda m: m.group(1) + runs, w) for w in tokens(line)]
            assert is_python(words[0]), f"{block.where}: only python commands run here: {line}"
            p = subprocess.run([sys.executable, *words[1:]], cwd=REPO, env=env(jax_cache),
                               capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, f"{block.where}: {line}\n{p.stderr[-3000:]}"
