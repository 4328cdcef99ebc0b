"""Every example in README.md and docs/*.md runs as written.

Each file's blocks run in order in one empty temporary folder, so a block can use the files an
earlier block of the same file wrote (a checkpoint made, then migrated). Each ```python block runs
in a fresh namespace. Each ```console or ```bash block is a list of commands, and each one must be
one of the project's own: ``slim-mha-migrate`` lines run through the CLI's real entry point with
their argv, and ``python -m slim_mha...`` lines in a subprocess. A block that cannot run in a test
(it installs a fresh environment, needs a GPU or downloads from the hub) has an HTML comment on
the line just before it, ``<!-- not run: REASON -->``, and the reason is required.

docs/equivariance.md is left out here: tests/test_equivariance_model_mode.py runs its blocks and
checks what they print.
"""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from slim_mha.migration.cli import main as migrate

ROOT = Path(__file__).resolve().parent.parent
TESTED_ELSEWHERE = {"docs/equivariance.md": "tests/test_equivariance_model_mode.py"}
DOCUMENTS = ["README.md"] + sorted(
    path.relative_to(ROOT).as_posix()
    for path in (ROOT / "docs").glob("*.md")
    if path.relative_to(ROOT).as_posix() not in TESTED_ELSEWHERE
)
RUN_LANGUAGES = {"python", "console", "bash"}
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run_reason: str | None  # None: the block runs

    def __str__(self) -> str:
        return f"{self.document}, the ```{self.language} block at line {self.line}"


def read_blocks(document: str) -> list[Block]:
    """The fenced blocks of ``document``, each with the skip marker on the line before it, if any."""
    lines = (ROOT / document).read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), None)
        assert end is not None, f"{document}: the block at line {index + 1} is never closed"
        marker = NOT_RUN.match(lines[index - 1]) if index else None
        blocks.append(
            Block(
                document,
                index + 1,
                opening.group(1),
                "\n".join(lines[index + 1 : end]) + "\n",
                marker.group(1).strip() if marker else None,
            )
        )
        index = end + 1
    return blocks


def commands(block: Block) -> list[str]:
    """The command lines of a console block: blank lines and comment lines left out."""
    return [line for line in block.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def run_command(command: str, where: str) -> None:
    argv = shlex.split(command, comments=True)
    if argv[0] == "slim-mha-migrate":
        try:
            status = migrate(argv[1:])
        except SystemExit as exit_:  # parser.error
            status = exit_.code
        assert status == 0, f"{where}: `{command}` exited with {status}"
    elif argv[:2] == ["python", "-m"] and argv[2].startswith("slim_mha"):
        finished = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, f"{where}: `{command}` exited with {finished.returncode}:\n{finished.stderr}"
    else:
        raise AssertionError(
            f"{where}: `{command}` is not one of the project's commands (slim-mha-migrate, python -m slim_mha...); "
            "run it here, or mark the block with <!-- not run: REASON --> on the line before it"
        )


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_block_runs_as_written(document, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [block for block in read_blocks(document) if block.language in RUN_LANGUAGES]
    assert blocks, f"{document} has no example to run"
    for block in blocks:
        if block.not_run_reason is not None:
            continue
        if block.language == "python":
            exec(compile(block.code, str(block), "exec"), {"__name__": "__main__"})
        else:
            for command in commands(block):
                run_command(command, str(block))


@pytest.mark.parametrize("document", DOCUMENTS + sorted(TESTED_ELSEWHERE))
def test_every_skipped_block_gives_a_reason(document):
    for block in read_blocks(document):
        if block.not_run_reason is not None:
            assert block.not_run_reason, f"{block}: the not-run marker gives no reason"
            assert block.language in RUN_LANGUAGES, f"{block}: only python and console blocks run, no marker needed"


@pytest.mark.parametrize("document", DOCUMENTS + sorted(TESTED_ELSEWHERE))
def test_every_marker_stands_just_before_a_block(document):
    lines = (ROOT / document).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if "not run" in line and line.lstrip().startswith("<!--"):
            assert NOT_RUN.match(line), f"{document}, line {number}: write the marker as <!-- not run: REASON -->"
            assert number < len(lines) and FENCE.match(lines[number]), (
                f"{document}, line {number}: the marker must be on the line just before the block it skips"
            )


def test_the_runner_fails_on_a_broken_example(tmp_path, monkeypatch):
    """The runner can fail: a block that raises, and a command that exits non-zero, are reported."""
    monkeypatch.chdir(tmp_path)
    broken = Block("README.md", 1, "python", "build_my_model()\n", None)
    with pytest.raises(NameError):
        exec(compile(broken.code, str(broken), "exec"), {"__name__": "__main__"})
    with pytest.raises(AssertionError, match="exited with"):
        run_command("slim-mha-migrate inspect missing.safetensors", "a test block")
    with pytest.raises(AssertionError, match="not one of the project's commands"):
        run_command("pip install slim-mha", "a test block")


def test_a_marker_without_a_reason_is_refused(tmp_path, monkeypatch):
    document = tmp_path / "example.md"
    document.write_text("<!-- not run: -->\n```python\nraise SystemExit\n```\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (block,) = read_blocks("example.md")
    assert block.not_run_reason == ""
    with pytest.raises(AssertionError, match="gives no reason"):
        test_every_skipped_block_gives_a_reason("example.md")


def test_the_front_page_says_who_it_is_for_and_stays_short():
    """A newcomer decides from the top of the page: who it is for, then the two set-up commands."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; details belong in docs/"
    box = next(i for i, line in enumerate(lines) if "Is it for you?" in line)
    commands = [i for i, line in enumerate(lines) if line.startswith("python3 -m venv .venv && ")]
    assert box < 20 and len(commands) == 2 and max(commands) < 80
    box_text = " ".join(lines[box : box + 12])
    assert "CUDA has never been measured" in box_text and "wins" in box_text and "matches stock" in box_text
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").count("\n") <= 250


# Files of this repository named in prose: a folder of the tree, then a path ending in a file type.
_NAMED_FILE = re.compile(
    r"(?<![\w./-])((?:slim_mha|migration|tests|benchmarks|docs|\.ci)/[\w./-]*\w\.(?:py|md|json|sh|png|toml))"
)
# Dotted names in slim_mha's namespace: a module, then attributes of it.
_NAMED_OBJECT = re.compile(r"(?<![\w.])(slim_mha(?:\.\w+)+)")


def _documents() -> list[Path]:
    """The code, docstrings and docs that name paths: the two packages and the Markdown (the tests
    name missing things on purpose, to check that they are refused)."""
    roots = ("slim_mha", "migration", "docs", "benchmarks")
    files = [path for root in roots for path in (ROOT / root).rglob("*") if path.suffix in (".py", ".md")]
    return [*files, ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "pyproject.toml"]


def _resolves(dotted: str) -> bool:
    """Whether a dotted name is a module of slim_mha or an attribute of one (``slim_mha.migration``
    is the ``migration/`` folder, as installed)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_path_and_name_the_project_mentions_exists():
    """A file moved or a name renamed leaves no reference behind: every repository path and every
    ``slim_mha.…`` name in the code, its docstrings and the docs exists (CHANGELOG history aside)."""
    # The keys slim_mha writes into a checkpoint's metadata are names in files, not in the code.
    code = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "migration").glob("*.py"))
    metadata_keys = set(re.findall(r"\"(slim_mha\.\w+)\"", code))
    missing = []
    for document in _documents():
        if document.name == "CHANGELOG.md":
            continue  # the history names what was, by design
        text = document.read_text(encoding="utf-8")
        for named in sorted(set(_NAMED_FILE.findall(text))):
            if not (ROOT / named).exists():
                missing.append(f"{document.relative_to(ROOT)}: {named}")
        for dotted in sorted(set(_NAMED_OBJECT.findall(text))):
            if dotted not in metadata_keys and not _resolves(dotted):
                missing.append(f"{document.relative_to(ROOT)}: {dotted}")
    assert missing == [], "named but missing:\n" + "\n".join(missing)


def test_the_name_check_can_fail():
    assert not _resolves("slim_mha._memory_guard")
    assert not _resolves("slim_mha.paths.no_such_function")
    assert _resolves("slim_mha.paths.choose_path") and _resolves("slim_mha.migration.strip_checkpoint")
    assert _NAMED_FILE.findall("see slim_mha/bench/encoder.py, and docs/migration.md.") == [
        "slim_mha/bench/encoder.py",
        "docs/migration.md",
    ]
