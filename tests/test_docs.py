"""The docs against the code: every command README.md and docs/ show runs as shown.

Checks, over README.md and every Markdown file under docs/ (fenced shell blocks, and inline code spans that start
with a command):

- every command that invokes dpcompare (`python -m dpcompare ...`, `.venv/bin/python -m dpcompare ...`,
  `torchrun ... -m dpcompare ...`, `horovodrun ... python -m dpcompare ...`, `mpirun ... python -m dpcompare ...`,
  `deepspeed ... --module dpcompare ...`, `dpcompare ...`) uses only flags that the parser of its subcommand,
  `dpcompare.cli.parser_for(command)`, accepts (the subcommand is the first word after the module when it is one
  of `dpcompare.cli.SUBCOMMANDS`, else `run`);
- every `--dpcompare-*` flag is an option of the pytest plugin (`dpcompare/commands/pytest_plugin.py`), and every
  marker a pytest command selects with `-m` is declared in pyproject.toml;
- every relative link points at a file that exists, and a `#anchor` into a Markdown file at one of its headings;
- the checker can fail: given a made-up flag, marker or link, it reports it (the negative twin);
- the README's own-model examples (its own batches, and a torch Dataset's through `from_dataset`) and
  docs/extending.md's custom backend run as written (torchrun, 2 ranks, with only `--out` added) and come out
  `equivalent`.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conftest import without_launcher_vars
from dpcompare import cli
from dpcompare.commands import pytest_plugin
from dpcompare.run import launchers

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "yaml", "yml"}
"""Fenced blocks read as commands; others (python, text output, json) are not commands."""
COMMAND_WORDS = {"python", "python3", "torchrun", "horovodrun", "mpirun", "deepspeed", "dpcompare", "pytest", "bash",
                 "srun", "sbatch", "time"}
"""An inline code span is a command when its first word (after VAR=value assignments) is one of these programs."""
OPERATORS = set("();<>|&")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^`]*$")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t#]*$")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:[ \t]+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(?P<ticks>`+)(?P<code>.+?)(?P=ticks)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
NUMBER = re.compile(r"^-\d[\d.eE+-]*$")


# -- reading Markdown -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    lang: str
    line: int
    """1-based line of the opening fence."""
    text: str


def split_markdown(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """Fenced code blocks (with their language), and the lines outside them (with their 1-based numbers)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(opening["lang"].lower(), i + 1, "\n".join(body)))
        i = j + 1
    return blocks, prose


def paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Runs of non-blank lines outside code blocks, joined with spaces (an inline span may wrap a line)."""
    out: list[tuple[int, str]] = []
    start, buf = 0, []
    for number, line in [*prose, (0, "")]:
        if line.strip():
            start = start or number
            buf.append(line.strip())
        elif buf:
            out.append((start, " ".join(buf)))
            start, buf = 0, []
    return out


def inline_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(line, m["code"].strip()) for line, para in paragraphs(prose) for m in INLINE_CODE.finditer(para)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens, underscores kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    _, prose = split_markdown(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        heading = HEADING.match(line)
        if heading:
            base = slug(heading["text"])
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


# -- reading commands ------------------------------------------------------------------------------------------
def logical_lines(block: str) -> list[str]:
    """The block's lines with `\\`-newline continuations joined."""
    return block.replace("\\\n", " ").splitlines()


def segments(command_line: str) -> list[list[str]]:
    """Simple commands of a shell line: words split as the shell would, comments dropped, and `|`, `&&`, `||`,
    `;`, parentheses and redirections as separators. A line that is not valid shell (prose in an output block)
    falls back to splitting on blanks."""
    try:
        lexer = shlex.shlex(command_line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        words = command_line.split()
    out: list[list[str]] = [[]]
    for word in words:
        if word and set(word) <= OPERATORS:
            out.append([])
        else:
            out[-1].append(word)
    return [s for s in out if s]


def program(word: str) -> str:
    """`.venv/bin/python3.11` -> `python`: the program a word names."""
    return re.sub(r"\d+(\.\d+)*$", "", os.path.basename(word)) or os.path.basename(word)


def first_program(words: list[str]) -> int | None:
    """Index of the first word that is not a VAR=value assignment."""
    for i, word in enumerate(words):
        if not ASSIGNMENT.match(word):
            return i
    return None


def dpcompare_args(words: list[str]) -> list[str] | None:
    """The words after the dpcompare module or program in one simple command, or None when it runs no dpcompare."""
    start = first_program(words)
    for i, word in enumerate(words):
        if word != "dpcompare" and not word.endswith("/dpcompare"):
            continue
        if (i > 0 and words[i - 1] in ("-m", "--module")) or i == start:
            return words[i + 1:]
    return None


def pytest_args(words: list[str]) -> list[str] | None:
    """The words after `pytest` (a program or `-m pytest`) in one simple command, or None."""
    for i, word in enumerate(words):
        if program(word) == "pytest" and (i == first_program(words) or (i > 0 and words[i - 1] == "-m")):
            return words[i + 1:]
    return None


@cache
def options_of(command: str) -> frozenset[str]:
    parser = cli.parser_for(command)
    return frozenset(s for action in parser._actions for s in action.option_strings)


class _OptionRecorder:
    """Stands in for pytest's parser: records the option names pytest_addoption declares."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def getgroup(self, *args, **kwargs) -> _OptionRecorder:
        return self

    def addoption(self, *names: str, **kwargs) -> None:
        self.names.update(names)


@cache
def plugin_options() -> frozenset[str]:
    recorder = _OptionRecorder()
    pytest_plugin.pytest_addoption(recorder)
    return frozenset(recorder.names)


@cache
def declared_markers() -> frozenset[str]:
    """The markers pyproject.toml declares ([tool.pytest.ini_options] markers = ["name: meaning", ...])."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    try:
        import tomllib  # Python 3.11+

        listed = tomllib.loads(text)["tool"]["pytest"]["ini_options"]["markers"]
    except ModuleNotFoundError:  # Python 3.10: the list's quoted entries
        block = re.search(r"^markers\s*=\s*\[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
        listed = re.findall(r'"([^"]*)"', block[1]) if block else []
    return frozenset(m.split(":")[0].strip() for m in listed)


def flag_name(word: str) -> str | None:
    """`--run-arg=--sync-bn` -> `--run-arg`; None for a word that is not an option (a value, a number)."""
    if not word.startswith("-") or word == "-" or NUMBER.match(word):
        return None
    return word.split("=", 1)[0]


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one simple command: flags dpcompare, its pytest plugin or pytest's markers do not have."""
    problems: list[str] = []
    for word in words:
        name = flag_name(word)
        if name and name.startswith("--dpcompare-") and name not in plugin_options():
            problems.append(f"{name} is not an option of the pytest plugin (dpcompare/commands/pytest_plugin.py)")
    args = dpcompare_args(words)
    if args is not None:
        command = args[0] if args and args[0] in cli.SUBCOMMANDS else "run"
        for word in args[1:] if args and args[0] in cli.SUBCOMMANDS else args:
            name = flag_name(word)
            if name and name not in options_of(command):
                problems.append(f"{name} is not a flag of `dpcompare {command}`")
    rest = pytest_args(words)
    if rest is not None:
        for i, word in enumerate(rest):
            if word == "-m" and i + 1 < len(rest):
                names = set(re.findall(r"[A-Za-z_]\w*", rest[i + 1])) - {"and", "or", "not"}
                problems += [f"marker {m!r} is not declared in pyproject.toml" for m in sorted(names - declared_markers())]
    return problems


def starts_a_command(span: str) -> bool:
    words = span.split()
    start = first_program(words)
    return start is not None and program(words[start]) in COMMAND_WORDS


def check_text(text: str, path: Path = REPO_ROOT / "README.md") -> list[str]:
    """Every problem in one Markdown text: commands using flags or markers that do not exist, and relative links
    to files or anchors that do not exist. Each problem names its line."""
    blocks, prose = split_markdown(text)
    commands: list[tuple[int, str]] = []
    for block in blocks:
        if block.lang in SHELL_LANGUAGES:
            commands += [(block.line, line) for line in logical_lines(block.text)]
    for line, span in inline_spans(prose):
        if starts_a_command(span) or span.startswith("--dpcompare-"):
            commands.append((line, span))
    problems = [f"{path.name}:{line}: {problem}: {command.strip()}"
                for line, command in commands for words in segments(command) for problem in check_command(words)]
    for line, para in paragraphs(prose):
        for match in LINK.finditer(INLINE_CODE.sub("", para)):
            problems += [f"{path.name}:{line}: {p}" for p in check_link(match["target"], path)]
    return problems


def check_link(target: str, path: Path) -> list[str]:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
        return []
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.exists():
        return [f"link {target!r} points at {linked}, which does not exist"]
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return [f"link {target!r}: {linked.name} has no heading with the anchor #{anchor}"]
    return []


# -- the docs ------------------------------------------------------------------------------------------------------
def test_the_docs_are_found():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in DOC_FILES}
    assert {"README.md", "docs/extending.md", "docs/ARCHITECTURE.md"} <= names


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_command_and_link_in_the_docs_exists(path: Path):
    assert check_text(path.read_text(), path) == []


def test_the_checker_sees_the_commands_it_must_check():
    """The positive twin of the negative one: commands of every shape are recognised (and pass)."""
    shapes = [
        "python -m dpcompare --backend ddp --opt dist_backend=gloo --model mlp",
        "OMP_NUM_THREADS=1 .venv/bin/python -m dpcompare compare --run-arg=--sync-bn --world-sizes 1,2",
        "torchrun --nproc_per_node=N -m dpcompare --backend ddp",
        "horovodrun --gloo -np N -H localhost:N python -m dpcompare --backend horovod",
        "mpirun -np N python -m dpcompare --backend ddp   # or horovod",
        "deepspeed --num_gpus N --module dpcompare --backend deepspeed",
        "dpcompare regress --baseline DIR --current DIR",
        "cd x && (python -m dpcompare report DIR --out D) | tee log; echo done",
    ]
    for shape in shapes:
        (words,) = [w for w in segments(shape) if dpcompare_args(w) is not None]
        assert check_command(words) == [], shape


# -- the negative twin -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("`python -m dpcompare compare --no-such-flag`", "--no-such-flag is not a flag of `dpcompare compare`"),
    ("```bash\ntorchrun --nproc_per_node=2 -m dpcompare --backend ddp \\\n    --no-such-flag 3\n```",
     "--no-such-flag is not a flag of `dpcompare run`"),
    ("```bash\nhorovodrun -np 2 python -m dpcompare --backend horovod --sweep  # a compare flag\n```",
     "--sweep is not a flag of `dpcompare run`"),
    ("```\n.venv/bin/python -m dpcompare regress --baseline a --current b --no-such-flag\n```",
     "--no-such-flag is not a flag of `dpcompare regress`"),
    ("`OMP_NUM_THREADS=1 .venv/bin/python -m pytest --pyargs dpcompare.regression --dpcompare-no-such 3`",
     "--dpcompare-no-such is not an option of the pytest plugin"),
    ("`OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m 'slow and not no_such_marker'`",
     "marker 'no_such_marker' is not declared in pyproject.toml"),
    ("See [the page](docs/no-such-page.md).", "docs/no-such-page.md"),
    ("See [the page](docs/extending.md#no-such-heading).", "has no heading with the anchor #no-such-heading"),
])
def test_the_checker_reports_what_does_not_exist(text: str, expected: str):
    problems = check_text(text)
    assert len(problems) == 1 and expected in problems[0], problems


# -- the examples run as written -----------------------------------------------------------------------------------
def example(path: Path, flag: str, which: int = 0) -> tuple[str, list[str]]:
    """The command in `path` that runs dpcompare with `flag package.module:Name` (a file of the user's), the first
    (`which` 0) or a later one, and the last Python block before it: (that file's text, the command's words)."""
    blocks, _ = split_markdown(path.read_text())
    code = None
    found = 0
    for block in blocks:
        if block.lang == "python":
            code = block.text
            continue
        if block.lang not in SHELL_LANGUAGES:
            continue
        for line in logical_lines(block.text):
            for words in segments(line):
                args = dpcompare_args(words)
                if args and flag in args and ":" in args[args.index(flag) + 1]:
                    assert code is not None, f"{path.name}: no Python block before {' '.join(words)}"
                    if found == which:
                        return code, words
                    found += 1
    raise AssertionError(f"{path.name}: no command #{which} with {flag} package.module:Name")


def run_example(path: Path, flag: str, tmp_path: Path, extra: tuple[str, ...] = (), which: int = 0) -> str:
    code, words = example(path, flag, which)
    words = [*words, *extra]
    module, _, name = words[words.index(flag) + 1].partition(":")
    assert re.search(rf"^(def|class) {name}\b", code, re.MULTILINE), f"the Python block defines no {name}"
    (tmp_path / f"{module}.py").write_text(code)
    env = without_launcher_vars(launchers.child_env({"OMP_NUM_THREADS": "1"}))
    env["DPCOMPARE_HEARTBEAT_DIR"] = str(tmp_path / "heartbeat")
    done = launchers.run_process([*words, "--out", str(tmp_path / "results")], timeout_s=240, capture=True,
                                 env=env, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(words)} exited {done.returncode}:\n{output[-3000:]}"
    assert ": equivalent" in done.stdout, output[-3000:]
    return done.stdout


@pytest.mark.multiproc
def test_the_readme_own_model_example_runs_as_written(tmp_path: Path):
    out = run_example(REPO_ROOT / "README.md", "--model", tmp_path)
    assert "ws=2" in out


@pytest.mark.multiproc
def test_the_readme_dataset_example_runs_as_written(tmp_path: Path):
    """The second own-model example: its batches from a torch Dataset (dpcompare.from_dataset, scikit-learn's digits)."""
    code, _ = example(REPO_ROOT / "README.md", "--model", which=1)
    assert "from_dataset(" in code and "load_digits()" in code
    out = run_example(REPO_ROOT / "README.md", "--model", tmp_path, which=1)
    assert "ws=2 digits" in out


@pytest.mark.slow  # the README's own-model example keeps a docs example run in the default tier
@pytest.mark.multiproc
def test_the_custom_backend_example_runs_as_written(tmp_path: Path):
    out = run_example(REPO_ROOT / "docs" / "extending.md", "--backend", tmp_path)
    assert "ws=2" in out


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_custom_backend_example_gets_mixed_precision_from_the_base_class(tmp_path: Path):
    """The minimal backend overrides none of autocast, the GradScaler's loss scaling, unscale and its step: they come
    from the base Adapter, and the run is judged on the fp16 recipe's floor."""
    out = run_example(REPO_ROOT / "docs" / "extending.md", "--backend", tmp_path, ("--amp", "fp16"))
    assert "ws=2" in out and "--amp fp16 autocast recipe; loss scale 2^16 at the start" in out, out
