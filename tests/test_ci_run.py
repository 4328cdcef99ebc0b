""".ci/run's own logic: its refusals, and how it turns each step's outcome into its exit status.

The script runs on a copy of itself in a temporary folder, with a PATH that holds only the shell
tools it uses and stand-ins for ``python3``, ``pip`` and ``python``: nothing is installed and no
real test suite runs, so each case takes a fraction of a second. The stand-in ``python`` answers the
torch-version probe with ``$FAKE_TORCH`` and a pytest run with ``$FAKE_PYTEST_RC`` and a matching
result line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' && .venv/bin/python -m pytest"
TOOLS = ("bash", "grep", "awk", "sed", "tee", "tail", "rm", "mkdir", "dirname", "chmod", "cp")

_FAKE_PYTHON = """#!{bash}
if [ "$1" = -c ]; then echo "$FAKE_TORCH"; exit 0; fi
case "$FAKE_PYTEST_RC" in
    0) echo "============ 7 passed, 1 skipped in 0.01s ============" ;;
    1) echo "============ 1 failed, 6 passed in 0.01s ============" ;;
    5) echo "============ no tests ran in 0.01s ============" ;;
esac
exit "$FAKE_PYTEST_RC"
"""

_FAKE_PYTHON3 = """#!{bash}
# python3 -m venv DIR: a venv whose pip succeeds and whose python is the stand-in above.
mkdir -p "$3/bin"
printf '#!{bash}\\nexit 0\\n' > "$3/bin/pip"
cp "{fake_python}" "$3/bin/python"
chmod +x "$3/bin/pip" "$3/bin/python"
"""


@pytest.fixture
def ci_copy(tmp_path) -> Path:
    """A folder holding copies of .ci/run, pyproject.toml and README.md, and a bin/ for PATH."""
    if shutil.which("bash") is None or not Path("/proc/self/status").exists():
        pytest.skip(".ci/run needs bash and Linux's /proc")
    (tmp_path / ".ci").mkdir()
    for name in (".ci/run", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in TOOLS:
        (tools / tool).symlink_to(shutil.which(tool))
    bash = shutil.which("bash")
    (tools / "fake-python").write_text(_FAKE_PYTHON.format(bash=bash))
    (tools / "python3").write_text(_FAKE_PYTHON3.format(bash=bash, fake_python=tools / "fake-python"))
    for stub in ("fake-python", "python3"):
        (tools / stub).chmod(0o755)
    return tmp_path


def run_ci(folder: Path, *, ignore_sigint: bool = False, **variables: str) -> subprocess.CompletedProcess:
    environment = {"PATH": str(folder / "bin"), "FAKE_TORCH": "2.13.0", "FAKE_PYTEST_RC": "0",
                   "SLIM_MHA_CI_OLDEST": "0", "SLIM_MHA_CI_NEWEST": "0", **variables}
    # SIGINT's disposition is set either way, so the result does not depend on how pytest was started.
    disposition = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    return subprocess.run(
        [shutil.which("bash"), str(folder / ".ci" / "run")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
    )


def test_the_readme_holds_the_test_command_that_ci_runs():
    assert TEST_COMMAND in (ROOT / "README.md").read_text().splitlines()


def test_a_passing_step_passes(ci_copy):
    result = run_ci(ci_copy)
    assert result.returncode == 0, result.stderr
    assert "local  torch 2.13.0  ok: 7 passed, 1 skipped in 0.01s  (install " in result.stdout
    assert "oldest  torch 2.4.1  skipped (SLIM_MHA_CI_OLDEST=0)\n" in result.stdout
    assert "newest  torch 2.15.0  skipped (SLIM_MHA_CI_NEWEST=0)\n" in result.stdout
    assert result.stdout.endswith(".ci/run: all steps passed\n")


def test_every_step_runs_and_one_failure_fails_the_run(ci_copy):
    result = run_ci(ci_copy, FAKE_PYTEST_RC="1", SLIM_MHA_CI_NEWEST="1", FAKE_TORCH="2.15.0")
    assert result.returncode == 1
    assert "local  torch 2.13.0  FAILED: the venv has torch 2.15.0\n" in result.stdout
    assert "newest  torch 2.15.0  FAILED: pytest exit 1: 1 failed, 6 passed in 0.01s  (install " in result.stdout
    assert result.stderr == ".ci/run: FAILED\n"


def test_pytest_collecting_no_tests_fails_the_run(ci_copy):
    result = run_ci(ci_copy, FAKE_PYTEST_RC="5")
    assert result.returncode == 1
    assert "local  torch 2.13.0  FAILED: pytest collected no tests (exit 5)\n" in result.stdout
    assert result.stderr == ".ci/run: FAILED\n"


def test_a_range_that_ci_does_not_test_is_refused(ci_copy):
    pyproject = ci_copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"torch>=2.4.1,<2.16"', '"torch>=2.4.1,<2.17"'))
    result = run_ci(ci_copy)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ('.ci/run: pyproject.toml must declare "torch>=2.4.1,<2.16" (oldest and newest tested '
                             "torch); update pyproject.toml and .ci/run together\n")


def test_a_readme_without_the_test_command_is_refused(ci_copy):
    readme = ci_copy / "README.md"
    readme.write_text(readme.read_text().replace(TEST_COMMAND, TEST_COMMAND.replace("2.13.0", "2.12.0")))
    result = run_ci(ci_copy)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f".ci/run: README.md must hold the test command this script runs, on a line of its own: "
                             f"{TEST_COMMAND}; update README.md and .ci/run together\n")


def test_a_switch_other_than_0_or_1_is_refused(ci_copy):
    result = run_ci(ci_copy, SLIM_MHA_CI_NEWEST="no")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ".ci/run: SLIM_MHA_CI_NEWEST must be 0 (skip that torch) or 1 (run it, the default), not 'no'\n"


def test_a_run_started_as_a_background_job_runs(ci_copy):
    """A background job inherits an ignored SIGINT; the tests that send one reset it in their child
    processes (tests/_migration_helpers.py), so .ci/run need not refuse such a start."""
    result = run_ci(ci_copy, ignore_sigint=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(".ci/run: all steps passed\n")
