""".ci/run's own logic: its refusals, and how it turns each step's outcome into its exit status.

The script runs on a copy of itself in a temporary folder, with a PATH that holds only the shell
tools it uses and stand-ins for ``python3``, ``pip`` and ``python``: nothing is installed and no
real test suite runs, so each case takes a fraction of a second. The stand-in ``python`` answers the
torch-version probe with ``$FAKE_TORCH``, the Python-version probe with its venv's version (3.11
for python3's), and a pytest run with ``$FAKE_PYTEST_RC`` and a matching result line. The Python
steps find stand-in interpreters in a fake pyenv folder; the Debian 13 root is built, mounted and
entered by stand-ins for ``debootstrap``, ``mount``, ``umount``, ``mountpoint`` and ``chroot`` that
write what they were asked to a log and keep the mount table in a folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' && .venv/bin/python -m pytest"
TOOLS = (
    "bash",
    "grep",
    "awk",
    "sed",
    "tee",
    "tail",
    "head",
    "sort",
    "rm",
    "mkdir",
    "dirname",
    "chmod",
    "cp",
    "cat",
    "touch",
)

_FAKE_PYTHON = """#!{bash}
if [ "$1" = -c ]; then
    case "$2" in
        *torch*) echo "$FAKE_TORCH" ;;
        *) cat "$(dirname "$0")/version" 2>/dev/null || echo "${{FAKE_CHROOT_PYTHON:-3.11}}" ;;
    esac
    exit 0
fi
case "$FAKE_PYTEST_RC" in
    0) echo "============ 7 passed, 1 skipped in 0.01s ============" ;;
    1) echo "============ 1 failed, 6 passed in 0.01s ============" ;;
    5) echo "============ no tests ran in 0.01s ============" ;;
esac
exit "$FAKE_PYTEST_RC"
"""

# df -P[k] .: the free space is $FAKE_FREE_KB (100 GB unless a test says less).
_FAKE_DF = """#!{bash}
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 200000000 0 ${{FAKE_FREE_KB:-100000000}} 0% /fake"
"""

_FAKE_PYTHON3 = """#!{bash}
# python3 [-c CODE | -m venv [--clear] DIR]: a venv whose pip succeeds and whose python is the stand-in
# above, reporting this interpreter's version ({version}); the -c probe of .ci/run accepts it.
[ "$1" = -c ] && exit 0
venv="${{@: -1}}"
mkdir -p "$venv/bin"
printf '#!{bash}\\nexit 0\\n' > "$venv/bin/pip"
cp "{fake_python}" "$venv/bin/python"
echo "{version}" > "$venv/bin/version"
echo "$0" > "$venv/made-by"
chmod +x "$venv/bin/pip" "$venv/bin/python"
"""

# Stand-ins for the Debian 13 root. Each writes its command line to $FAKE_LOG; mounts are files in
# $FAKE_MOUNTS named after the mount point.
_FAKE_ROOT_TOOLS = {
    "debootstrap": 'mkdir -p "$3/proc" "$3/dev" "$3/sys" "$3/usr/bin" "$3/usr/local/bin" "$3/etc"\n'
    'exit "${FAKE_DEBOOTSTRAP_RC:-0}"',
    "mount": '[ "$1" = --make-rslave ] || touch "$FAKE_MOUNTS/$(echo "${@: -1}" | tr / _)"',
    "umount": 'rm "$FAKE_MOUNTS/$(echo "${@: -1}" | tr / _)"',
    "mountpoint": '[ -e "$FAKE_MOUNTS/$(echo "${@: -1}" | tr / _)" ]',
    "apt-get": "exit 0",
    "chroot": """root=$1
shift
case "$1" in
    /usr/local/bin/slim-mha-python) shift; exec "$FAKE_PYTHON_TOOL" "$@" ;;
    apt-get) touch "$root/usr/bin/python3.13"; chmod +x "$root/usr/bin/python3.13" ;;
    /bin/sh) exit "${FAKE_CHROOT_INSTALL_RC:-0}" ;;
esac
exit 0""",
}


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
    (tools / "python3").write_text(_FAKE_PYTHON3.format(bash=bash, fake_python=tools / "fake-python", version="3.11"))
    (tools / "df").write_text(_FAKE_DF.format(bash=bash))
    for stub in ("fake-python", "python3", "df"):
        (tools / stub).chmod(0o755)
    return tmp_path


def add_pyenv(folder: Path, *versions: str) -> Path:
    """A fake pyenv folder holding a stand-in interpreter for each version (e.g. "3.13.1")."""
    root = folder / "pyenv"
    bash = shutil.which("bash")
    for version in versions:
        minor = version.rsplit(".", 1)[0]
        interpreter = root / "versions" / version / "bin" / f"python{minor}"
        interpreter.parent.mkdir(parents=True)
        interpreter.write_text(
            _FAKE_PYTHON3.format(bash=bash, fake_python=folder / "bin" / "fake-python", version=minor)
        )
        interpreter.chmod(0o755)
    return root


@pytest.fixture
def debian_tools(ci_copy) -> dict[str, str]:
    """Stand-ins for building and entering the Debian 13 root; returns the variables they read."""
    sources = list(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    if not any(path.is_file() for path in sources):
        pytest.skip("the Debian root reads its mirror from this machine's apt sources")
    bash = shutil.which("bash")
    tools = ci_copy / "bin"
    for name in ("tr",):
        (tools / name).symlink_to(shutil.which(name))
    for name, body in _FAKE_ROOT_TOOLS.items():
        (tools / name).write_text(f"#!{bash}\necho \"{name} $*\" >> \"$FAKE_LOG\"\n{body}\n")
        (tools / name).chmod(0o755)
    (ci_copy / "mounts").mkdir()
    return {
        "FAKE_LOG": str(ci_copy / "root.log"),
        "FAKE_MOUNTS": str(ci_copy / "mounts"),
        "FAKE_PYTHON_TOOL": str(tools / "fake-python"),
        "FAKE_CHROOT_PYTHON": "3.13",
        "PYENV_ROOT": str(ci_copy / "no-pyenv"),
        "SLIM_MHA_CI_PY313": "1",
    }


def run_ci(folder: Path, *, ignore_sigint: bool = False, **variables: str) -> subprocess.CompletedProcess:
    environment = {
        "PATH": str(folder / "bin"),
        "FAKE_TORCH": "2.13.0",
        "FAKE_PYTEST_RC": "0",
        "SLIM_MHA_CI_CHECKS": "0",
        "SLIM_MHA_CI_OLDEST": "0",
        "SLIM_MHA_CI_NEWEST": "0",
        "SLIM_MHA_CI_BETWEEN": "0",
        "SLIM_MHA_CI_PY312": "0",
        "SLIM_MHA_CI_PY313": "0",
        "PYENV_ROOT": str(folder / "pyenv"),
        **variables,
    }
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
    assert "torch2141  torch 2.14.1  skipped (SLIM_MHA_CI_BETWEEN=0)\n" in result.stdout
    for version in ("3.12", "3.13"):
        switch = f"SLIM_MHA_CI_PY{version.replace('.', '')}"
        assert f"py{version.replace('.', '')}  Python {version}  torch 2.13.0  skipped ({switch}=0)\n" in result.stdout
    assert result.stdout.endswith(".ci/run: all steps passed\n")


def test_every_step_runs_and_one_failure_fails_the_run(ci_copy):
    result = run_ci(ci_copy, FAKE_PYTEST_RC="1", SLIM_MHA_CI_NEWEST="1", FAKE_TORCH="2.15.0")
    assert result.returncode == 1
    assert "local  torch 2.13.0  FAILED: the venv has torch 2.15.0\n" in result.stdout
    assert "newest  torch 2.15.0  FAILED: pytest exit 1: 1 failed, 6 passed in 0.01s  (install " in result.stdout
    assert result.stderr == ".ci/run: FAILED\n"


def test_the_release_between_the_ends_runs_in_a_venv_of_its_own(ci_copy):
    result = run_ci(ci_copy, SLIM_MHA_CI_BETWEEN="1", FAKE_TORCH="2.14.1", SLIM_MHA_CI_KEEP_VENVS="1")
    assert "torch2141  torch 2.14.1  ok: 7 passed, 1 skipped in 0.01s  (install " in result.stdout
    assert (ci_copy / ".venv-torch2141" / "bin" / "python").exists()
    assert "local  torch 2.13.0  FAILED: the venv has torch 2.14.1\n" in result.stdout  # each step checks its own


def test_each_step_but_local_deletes_its_venv_when_it_ends(ci_copy):
    add_pyenv(ci_copy, "3.12.1")
    result = run_ci(ci_copy, SLIM_MHA_CI_BETWEEN="1", SLIM_MHA_CI_PY312="1", FAKE_PYTEST_RC="1")
    assert "torch2141  torch 2.14.1  FAILED: the venv has torch 2.13.0" in result.stdout  # a failed step too
    assert "py312  Python 3.12  torch 2.13.0  FAILED: pytest exit 1" in result.stdout
    assert (ci_copy / ".venv" / "bin" / "python").exists()  # the README's venv stays
    assert not (ci_copy / ".venv-torch2141").exists()
    assert not (ci_copy / ".venv-py312").exists()


def test_a_step_without_room_for_its_venv_fails_and_says_so(ci_copy):
    result = run_ci(ci_copy, SLIM_MHA_CI_BETWEEN="1", FAKE_FREE_KB="1000000")
    assert result.returncode == 1
    assert (
        "torch2141  torch 2.14.1  FAILED: under 7 GB free on /fake; a step's venv takes a few GB, free some "
        "and run again\n"
    ) in result.stdout
    assert "local  torch 2.13.0  ok: " in result.stdout  # local's venv is the README's own, made either way
    assert not (ci_copy / ".venv-torch2141").exists()


def test_pytest_collecting_no_tests_fails_the_run(ci_copy):
    result = run_ci(ci_copy, FAKE_PYTEST_RC="5")
    assert result.returncode == 1
    assert "local  torch 2.13.0  FAILED: pytest collected no tests (exit 5)\n" in result.stdout
    assert result.stderr == ".ci/run: FAILED\n"


@pytest.mark.parametrize(
    "declared, refused, message",
    [
        (
            '"torch>=2.4.1,<2.16"',
            '"torch>=2.4.1,<2.17"',
            '.ci/run: pyproject.toml must declare "torch>=2.4.1,<2.16" (oldest and newest tested torch); update '
            "pyproject.toml and .ci/run together\n",
        ),
        (
            'requires-python = ">=3.11"',
            'requires-python = ">=3.10"',
            '.ci/run: pyproject.toml must declare requires-python = ">=3.11" (the oldest Python tested); update '
            "pyproject.toml and .ci/run together\n",
        ),
    ],
    ids=["torch", "python"],
)
def test_a_range_that_ci_does_not_test_is_refused(ci_copy, declared, refused, message):
    pyproject = ci_copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(declared, refused))
    result = run_ci(ci_copy)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == message


def test_a_readme_without_the_test_command_is_refused(ci_copy):
    readme = ci_copy / "README.md"
    readme.write_text(readme.read_text().replace(TEST_COMMAND, TEST_COMMAND.replace("2.13.0", "2.12.0")))
    result = run_ci(ci_copy)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f".ci/run: README.md must hold the test command this script runs, on a line of its own: "
        f"{TEST_COMMAND}; update README.md and .ci/run together\n"
    )


def test_a_switch_other_than_0_or_1_is_refused(ci_copy):
    result = run_ci(ci_copy, SLIM_MHA_CI_NEWEST="no")
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr == ".ci/run: SLIM_MHA_CI_NEWEST must be 0 (skip that step) or 1 (run it, the default), not 'no'\n"
    )
    result = run_ci(ci_copy, SLIM_MHA_CI_PY313="yes")
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr == ".ci/run: SLIM_MHA_CI_PY313 must be 0 (skip that step) or 1 (run it, the default), not 'yes'\n"
    )
    result = run_ci(ci_copy, SLIM_MHA_CI_KEEP_VENVS="yes")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(".ci/run: SLIM_MHA_CI_KEEP_VENVS must be 0 (delete each step's venv")


def test_the_classifiers_and_the_tested_bytecode_are_the_pythons_ci_runs():
    script = (ROOT / ".ci" / "run").read_text()
    pythons = set(re.search(r"^pythons=\((.*)\)$", script, re.MULTILINE).group(1).split()) | {"3.11"}  # + python3
    pyproject = (ROOT / "pyproject.toml").read_text()
    classified = set(re.findall(r'"Programming Language :: Python :: (3\.\d+)"', pyproject))
    assert classified == pythons
    assert f'requires-python = ">={min(pythons, key=lambda v: tuple(map(int, v.split("."))))}"' in pyproject
    from slim_mha import unread_weights

    assert {f"{major}.{minor}" for major, minor in unread_weights._TESTED_VERSIONS} <= pythons


def test_each_python_step_runs_pyenv_s_newest_of_its_version(ci_copy):
    add_pyenv(ci_copy, "3.10.13", "3.12.1", "3.13.0", "3.13.10")
    result = run_ci(ci_copy, SLIM_MHA_CI_PY312="1", SLIM_MHA_CI_PY313="1", SLIM_MHA_CI_KEEP_VENVS="1")
    assert result.returncode == 0, result.stdout
    assert not (ci_copy / ".venv-py310").exists()
    for version in ("3.12", "3.13"):
        assert (
            f"py{version.replace('.', '')}  Python {version}  torch 2.13.0  ok: 7 passed, 1 skipped in 0.01s  (install "
            in result.stdout
        )
    made_by = (ci_copy / ".venv-py313" / "made-by").read_text().strip()
    assert made_by == str(ci_copy / "pyenv" / "versions" / "3.13.10" / "bin" / "python3.13")


def test_a_venv_of_another_python_fails_its_step(ci_copy):
    add_pyenv(ci_copy, "3.12.1")
    interpreter = ci_copy / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12"
    interpreter.write_text(interpreter.read_text().replace('echo "3.12" >', 'echo "3.11" >'))
    result = run_ci(ci_copy, SLIM_MHA_CI_PY312="1")
    assert result.returncode == 1
    assert "py312  Python 3.12  torch 2.13.0  FAILED: the venv has Python 3.11\n" in result.stdout


def test_a_python_that_is_not_there_fails_its_step_and_names_the_switch(ci_copy):
    add_pyenv(ci_copy, "3.13.0")
    result = run_ci(ci_copy, SLIM_MHA_CI_PY312="1")
    assert result.returncode == 1
    assert (
        "py312  Python 3.12  torch 2.13.0  FAILED: no Python 3.12 (pyenv's or python3.12 on PATH); install one, "
        "or set SLIM_MHA_CI_PY312=0 to skip this step\n"
    ) in result.stdout
    assert result.stderr == ".ci/run: FAILED\n"


def root_log(variables: dict[str, str]) -> list[str]:
    return Path(variables["FAKE_LOG"]).read_text().splitlines()


@pytest.mark.parametrize("outcome", ["passed", "tests failed", "install failed"])
def test_without_python_3_13_the_step_runs_in_a_debian_13_root_and_unmounts_it(ci_copy, debian_tools, outcome):
    variables = {
        **debian_tools,
        "FAKE_PYTEST_RC": "1" if outcome == "tests failed" else "0",
        "FAKE_CHROOT_INSTALL_RC": "1" if outcome == "install failed" else "0",
    }
    result = run_ci(ci_copy, **variables)
    root = ci_copy / ".ci-debian13"
    log = root_log(variables)
    assert any(line.startswith(f"debootstrap --variant=minbase trixie {root} ") for line in log)
    assert f"mount --bind {ci_copy} {root}/src" in log and f"mount --rbind /dev {root}/dev" in log
    assert f"mount -t proc proc {root}/proc" in log
    assert os.listdir(variables["FAKE_MOUNTS"]) == [], "a mount was left behind"
    assert log.index(f"umount -R {root}/src") > log.index(f"mount --bind {ci_copy} {root}/src")
    if outcome == "passed":
        assert result.returncode == 0, result.stdout
        assert "py313  Python 3.13  torch 2.13.0  ok: 7 passed, 1 skipped in 0.01s  (install " in result.stdout
        assert f"chroot {root} /usr/local/bin/slim-mha-python -m pytest" in log
    else:
        assert result.returncode == 1
        assert ("FAILED: pytest exit 1" if outcome == "tests failed" else "FAILED at install") in result.stdout


def test_a_debian_root_that_fails_to_build_fails_the_step_and_mounts_nothing(ci_copy, debian_tools):
    result = run_ci(ci_copy, **debian_tools, FAKE_DEBOOTSTRAP_RC="1")
    assert result.returncode == 1
    assert "py313  Python 3.13  torch 2.13.0  FAILED: the Debian 13 root (see .ci-logs/py313.log)\n" in result.stdout
    assert not any(line.startswith("mount ") for line in root_log(debian_tools))


def test_a_root_left_mounted_by_a_killed_run_is_unmounted_before_it_is_touched(ci_copy, debian_tools):
    root = ci_copy / ".ci-debian13"
    (root / "src").mkdir(parents=True)
    stale = Path(debian_tools["FAKE_MOUNTS"]) / str(root / "src").replace("/", "_")
    stale.touch()
    result = run_ci(ci_copy, **debian_tools)
    assert result.returncode == 0, result.stdout
    log = root_log(debian_tools)
    assert log.index(f"umount -R {root}/src") < next(i for i, line in enumerate(log) if line.startswith("debootstrap"))
    assert os.listdir(debian_tools["FAKE_MOUNTS"]) == []


def test_debootstrap_is_installed_when_missing(ci_copy, debian_tools):
    (ci_copy / "bin" / "debootstrap").rename(ci_copy / "bin" / "later-debootstrap")
    result = run_ci(ci_copy, **debian_tools)
    assert result.returncode == 1  # the stand-in apt-get installs nothing: the root cannot be built
    installs = [line for line in root_log(debian_tools) if line.startswith("apt-get")]
    assert installs == ["apt-get update", "apt-get install -y debootstrap"]


def test_a_run_started_as_a_background_job_runs(ci_copy):
    """A background job inherits an ignored SIGINT; the tests that send one reset it in their child
    processes (tests/_migration_helpers.py), so .ci/run need not refuse such a start."""
    result = run_ci(ci_copy, ignore_sigint=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(".ci/run: all steps passed\n")


_FAKE_CHECKS = """#!{bash}
# .ci/checks: fails the checks named in $FAKE_FAILING_CHECKS, as the real one reports them.
echo "checks ran with $PYTHON"
if [ -n "${{FAKE_FAILING_CHECKS:-}}" ]; then
    echo "checks: FAILED: $FAKE_FAILING_CHECKS"
    exit 1
fi
echo "checks: lint, format, types and build passed"
"""


@pytest.mark.parametrize("failing", ["", "lint types"])
def test_the_checks_run_before_the_tests_and_a_failed_check_fails_the_run_by_name(ci_copy, failing):
    (ci_copy / ".ci" / "checks").write_text(_FAKE_CHECKS.format(bash=shutil.which("bash")))
    result = run_ci(ci_copy, SLIM_MHA_CI_CHECKS="1", FAKE_FAILING_CHECKS=failing)
    assert "checks ran with .venv/bin/python" in result.stdout
    assert result.stdout.index("step 'checks'") < result.stdout.index("step 'local'")  # before the test rows
    if failing:
        assert result.returncode == 1
        assert "checks  checks: FAILED: lint types  (see .ci-logs/checks.log)" in result.stdout
    else:
        assert result.returncode == 0, result.stdout
        assert re.search(r"checks  ok: lint, format, types, build  \(\d+ s\)", result.stdout)


def test_the_real_checks_script_names_every_check_it_runs():
    """.ci/checks runs each check and names it; the tools it calls are the dev extra's."""
    text = (ROOT / ".ci" / "checks").read_text()
    for command in ("-m ruff check", "-m ruff format --check", "-m mypy", "-m build", "-m twine check"):
        assert command in text
    dev = re.search(r'^dev = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert dev and all(f'"{tool}==' in dev.group(1) for tool in ("ruff", "mypy", "build", "twine"))
