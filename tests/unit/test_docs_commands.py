"""The docs' runnable command blocks run, and print what the docs say they print.

A fenced block on the line after ``<!-- run -->`` in README.md or a page under docs/ is runnable:

- a ``bash`` block holds commands, one a line (continued by a trailing ``\\``), each of which must exit 0;
- a ``console`` block holds commands, each on a line starting with ``$ `` (continued by a trailing ``\\``), and
  after each the lines it prints: every such line must be a line of its output (stdout and stderr), in order,
  other lines may come between; a line ``...`` is for the reader only, and a line ending in `` ...`` matches a line
  that starts with what comes before it. Each command must exit 0.

Each command runs in bash (``-eo pipefail``) in its block's directory: a fresh copy of the inputs the docs name
(README.md, clusters/, configs/, examples/), with the repository's .venv/bin first on PATH and the loopback-only
environment the Makefile sets. What a command prints depends only on those inputs and the block's commands before
it, so a command already run after the same ones (the same command on two pages) is run once per test process.
Only cheap commands are marked runnable (seconds: ``hybrid estimate``, ``hybrid plan`` of a file, ``hybrid data
prepare`` of a small file); never a launch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- run -->"
COPIED = ("README.md", "clusters", "configs", "examples")
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                "no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1",
                "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, from 1
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def runnable_blocks(text: str, path: str) -> list[Block]:
    """The fenced blocks of ``text`` whose opening fence is on the line after ``MARKER``."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        match = re.fullmatch(r"(`{3,})\s*(\w+)\s*", fence)
        if not match or match.group(2) not in ("bash", "console"):
            raise ValueError(f"{path}:{i + 1}: {MARKER} must be followed by a ```bash or ```console fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == match.group(1)), None)
        if end is None:
            raise ValueError(f"{path}:{i + 2}: the runnable block is not closed")
        out.append(Block(path, i + 2, match.group(2), "\n".join(lines[i + 2:end])))
    return out


def bash_steps(text: str) -> list[tuple[str, list[str]]]:
    """A bash block as ``(command, [])`` pairs: one command a line, comments and blank lines left out."""
    steps: list = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            while line.endswith("\\"):
                line = line + "\n" + next(lines)
            steps.append((line, []))
    return steps


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """A console block as ``(command, expected lines)`` pairs."""
    steps: list = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command + "\n" + next(lines)
            steps.append((command, []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"output before any command: {line!r}")
    return steps


def unmatched(expected: list[str], output: str) -> str | None:
    """The first expected line not found, in order, among the output's lines; None if all are."""
    actual = iter(line.rstrip() for line in output.splitlines())
    for want in expected:
        want = want.rstrip()
        if want.strip() == "...":
            continue
        prefix = want[:-4] if want.endswith(" ...") else None
        if not any((line.startswith(prefix) if prefix is not None else line == want) for line in actual):
            return want
    return None


def all_blocks() -> list[Block]:
    return [b for page in doc_pages() for b in runnable_blocks(page.read_text(encoding="utf-8"),
                                                                str(page.relative_to(ROOT)))]


def environment() -> dict:
    env = {**os.environ, **LOOPBACK_ENV}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


def without_comment(command: str) -> str:
    """``command`` without a trailing ``  # comment`` (outside quotes), for comparing commands."""
    import shlex

    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        return " ".join(lexer)
    except ValueError:
        return command


_RAN: dict = {}  # (commands so far, without comments) -> the last one's CompletedProcess


def run(commands: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The last of ``commands`` run in ``cwd`` after the others were (``_RAN``: once per test process)."""
    key = tuple(without_comment(c) for c in commands)
    if key not in _RAN:
        _RAN[key] = subprocess.run(["bash", "-eo", "pipefail", "-c", commands[-1]], cwd=cwd, env=environment(),
                                   text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=BLOCK_TIMEOUT_S)
    return _RAN[key]


def copy_inputs(to: Path) -> None:
    skip = shutil.ignore_patterns("runs", "__pycache__", "*.bin", "*.bin.json")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, to / name, ignore=skip)
        else:
            shutil.copy2(source, to / name)


@pytest.mark.slow
@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.id)
def test_the_runnable_block_runs_and_prints_what_the_docs_say(block, tmp_path):
    copy_inputs(tmp_path)
    steps = bash_steps(block.text) if block.lang == "bash" else console_steps(block.text)
    assert steps, f"{block.id}: a runnable block without a command"
    for i, (command, expected) in enumerate(steps):
        done = run([c for c, _ in steps[:i + 1]], tmp_path)
        assert done.returncode == 0, f"{block.id}: `{command}` exited {done.returncode}\n{done.stdout}"
        missing = unmatched(expected, done.stdout)
        assert missing is None, (f"{block.id}: `{command}` did not print, in this order, the line\n{missing}\n"
                                 f"its output:\n{done.stdout}")


# ------------------------------------------------------------------ the reading of the blocks (no process)


def test_the_docs_have_runnable_blocks_of_each_kind_and_every_marker_opens_one():
    blocks = all_blocks()  # raises on a marker without its block
    assert {b.lang for b in blocks} == {"bash", "console"}
    assert any(b.path == "README.md" for b in blocks)
    assert not any("hybrid launch" in b.text or "make " in b.text for b in blocks), "launches are not cheap"


def test_a_marker_without_a_fenced_block_is_an_error():
    with pytest.raises(ValueError, match="must be followed by"):
        runnable_blocks("<!-- run -->\nhybrid --help\n", "x.md")
    with pytest.raises(ValueError, match="not closed"):
        runnable_blocks("<!-- run -->\n```bash\nhybrid --help\n", "x.md")


def test_bash_blocks_are_one_command_a_line_and_comments_do_not_tell_commands_apart():
    assert bash_steps("# set up\nhybrid plan a.yaml   # the plan\nhybrid estimate \\\n  --gpus 8\n") == [
        ("hybrid plan a.yaml   # the plan", []), ("hybrid estimate \\\n  --gpus 8", [])]
    assert without_comment("hybrid plan a.yaml   # the plan") == without_comment("hybrid plan a.yaml")
    assert without_comment("printf '# not a comment' > x") != without_comment("printf ''")


def test_console_blocks_read_commands_continuations_and_expected_lines():
    steps = console_steps("$ hybrid estimate --params 7B \\\n    --gpus 8\nRecommended: ZeRO stage 1\n$ true\n")
    assert steps == [("hybrid estimate --params 7B \\\n    --gpus 8", ["Recommended: ZeRO stage 1"]), ("true", [])]


def test_expected_lines_must_appear_in_order_and_in_full():
    output = "model 1\nmesh 2 nodes\ntp auto: 1, since ...\nchoice tp 1, stage 3: fastest\n"
    assert unmatched(["mesh 2 nodes", "...", "choice tp 1, stage 3: ..."], output) is None
    assert unmatched(["mesh 2 nodes", "model 1"], output) == "model 1"  # out of order
    assert unmatched(["mesh 2"], output) == "mesh 2"  # a line is matched whole unless it ends in " ..."
    assert unmatched(["choice tp 8, stage 3: ..."], output) == "choice tp 8, stage 3: ..."
