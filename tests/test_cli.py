"""The `sprout` command as a user runs it: its version, its exit codes (0 done, 1 failed, 2 usage), every
subcommand's help, and the seed's `python -m` forms, which are aliases of its subcommands."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from sprout import __version__
from sprout.cli import parser
from sprout.cli.aliases import SEED_FORMS, _runstore_api, _sandbox
from sprout.errors import UsageError
from tests.conftest import REPO

pytestmark = pytest.mark.python_only  # needs no podman (pytest -m python_only)

SPROUT = Path(sys.executable).parent / "sprout"  # the console script the install made


def sprout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SPROUT), *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_version_is_the_package_version():
    done = sprout("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"sprout {__version__}")


# What only running a command needs: the store, the job stack, the agent's and Harbor's packages, LiteLLM.
RUN_TIME_MODULES = ("sprout.sandbox.store", "sprout.jobs.payloads", "sprout.worker.serve", "sprout.agent.runner",
                    "sprout.tasks.grade", "sprout.services.files", "harbor", "minisweagent", "litellm")


def test_building_the_parser_imports_none_of_what_commands_run():
    """`sprout --help` and a usage error answer at once: each subcommand imports its library when it runs."""
    probe = ("import sys; from sprout.cli import parser; parser(); "
             f"print(' '.join(m for m in {RUN_TIME_MODULES!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["evaluate"], "the following arguments are required: --task-dir"),
    (["sandbox", "gc", "--older-than", "soon"], "invalid float value: 'soon'"),
])
def test_a_usage_error_exits_2_with_the_usage(args, message):
    done = sprout(*args)
    assert done.returncode == 2 and message in done.stderr and "usage: sprout" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_failed_command_exits_1_with_one_line(tmp_path: Path):
    done = sprout("report", "snapshots", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"error: no journal at {tmp_path / 'missing.jsonl'}"]


def _commands(p: argparse.ArgumentParser, words: list[str]) -> list[list[str]]:
    """Every command and subcommand of `p`, as the words that name it."""
    found = [words]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _commands(child, [*words, name])
    return found


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]):
    commands = _commands(parser(), [])
    assert {"evaluate", "gate", "doctor", "run", "worker", "rl-driver", "swe-rebench"} <= {c[0] for c in commands if c}
    for words in commands:
        with pytest.raises(SystemExit) as done:
            parser().parse_args([*words, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and out.startswith(f"usage: {' '.join(['sprout', *words])}"), words


@pytest.mark.parametrize("module", sorted(SEED_FORMS))
def test_a_seed_form_is_its_subcommand(module: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLUMNS", "100")  # the help's width, here and in the alias's process
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    prefix, _ = SEED_FORMS[module]
    with pytest.raises(SystemExit):
        parser().parse_args([*prefix, "--help"])
    assert done.stdout == capsys.readouterr().out


def test_seed_spellings_are_translated():
    assert _sandbox(["--store", "/s", "gc", "--older-than", "2"]) == ["gc", "--store", "/s", "--older-than", "7200.0"]
    assert _runstore_api(["--kinds", "sprout.worker.jobs", "--db", "x"]) == ["--db", "x"]
    assert _runstore_api(["--kinds=sprout.worker.jobs"]) == []
    with pytest.raises(UsageError, match="--kinds 'my.kinds': the Run Store serves Sprout's job kinds"):
        _runstore_api(["--kinds", "my.kinds"])


def test_a_refused_seed_spelling_exits_2_with_one_line():
    done = subprocess.run([sys.executable, "-m", "sprout.runstore.api", "--kinds", "my.kinds"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
