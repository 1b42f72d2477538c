"""Harbor task directories for SWE-rebench V2 instances, for evaluation with `sprout.eval` (and the RL
driver's `--tasks-dir`): the agent works in the instance's image; the verifier is separate, as
DeepSWE's: a `[[verifier.collect]]` step writes the agent's diff against `base_commit` to
/logs/artifacts/model.patch, and `tests/test.sh` grades it in a fresh container of the instance's image
with the official steps (the same scripts as `grade`) and the official verdict (verdict.py, copied into
tests/ with the user's parsers file, run by the image's python3). `solution/` applies the reference
`patch`, so the gate's oracle resolves the task.

An image without python3 cannot parse its log there: its verifier writes no reward (a grade without a
verdict, saying why); grade such instances with `sprout swe-rebench grade`.
"""

import json
import re
import shlex
import shutil
from pathlib import Path

from harbor.models.task.config import TaskConfig

from .grade import GIT, GRADE_ENV, Rule, diff_script, git_apply, official_scripts
from .instances import Instance, repo_dir, task_prompt
from .verdict import Parsers

PATCH = "/logs/artifacts/model.patch"
VERDICT_SCRIPT = Path(__file__).with_name("verdict.py")  # stdlib only: it runs in the instance image
LOGS = "/logs/verifier"
COLLECT_TIMEOUT_S = 300.0
SETUP_SLACK_S = 600.0  # the verifier's timeout beyond the tests': reset, apply, parse
BUILD_TIMEOUT_S = 1800.0  # the verifier's image: FROM the instance image (pulled when absent) + tests/
ZERO = '{"reward": 0.0, "resolved_exact": 0.0, "resolved_lenient": 0.0}'


def task_dir_name(instance: Instance) -> str:
    """The instance id as a directory name (the task id Sprout and the RL driver know it by)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", instance.instance_id)


def write_task(instance: Instance, parsers: Parsers, out: Path, *, dataset_sha256: str, rule: Rule = "exact",
               timeout_s: float = 1800.0, verifier_network: bool = True) -> Path:
    """Writes the instance's task directory under `out` (replacing one there) and returns it."""
    task = out / task_dir_name(instance)
    if task.exists():
        shutil.rmtree(task)
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text(task_prompt(instance) + "\n")
    (task / "task.toml").write_text(_config(instance, parsers, dataset_sha256, timeout_s, verifier_network))
    _write_tests(task / "tests", instance, parsers, rule, timeout_s)
    if instance.patch.strip():
        (task / "solution").mkdir()
        (task / "solution" / "patch.diff").write_text(instance.patch)
        _script(task / "solution" / "solve.sh", f"cd {shlex.quote(repo_dir(instance))} || exit 1",
                f"{GIT} update-index -q --refresh  # a fresh copy's stat data differs; --3way needs it current",
                git_apply("/solution/patch.diff"))
    return task


def _config(instance: Instance, parsers: Parsers, dataset_sha256: str, timeout_s: float, network: bool) -> str:
    collect = (f"mkdir -p /logs/artifacts && cd {shlex.quote(repo_dir(instance))}\n"  # whole or not at all:
               + diff_script(instance, f"{PATCH}.partial") + f"\nmv {PATCH}.partial {PATCH}")
    config = TaskConfig.model_validate({
        "schema_version": "1.3",
        "task": {"name": f"swe-rebench-v2/{task_dir_name(instance)}",
                 "description": f"{instance.repo} at {instance.base_commit[:12]}"},
        "metadata": {"benchmark": "swe-rebench-v2", "instance_id": instance.instance_id, "repo": instance.repo,
                     "base_commit": instance.base_commit, "dataset_sha256": dataset_sha256,
                     "grader_revision": parsers.grader_revision},
        "verifier": {"environment_mode": "separate", "network_mode": "public" if network else "no-network",
                     "environment": {"build_timeout_sec": BUILD_TIMEOUT_S},  # built from tests/Dockerfile
                     "timeout_sec": timeout_s + SETUP_SLACK_S,
                     "collect": [{"service": "main", "command": collect, "timeout_sec": COLLECT_TIMEOUT_S}]},
        "environment": {"docker_image": instance.image_name},
    })
    return config.model_dump_toml()


def _write_tests(tests: Path, instance: Instance, parsers: Parsers, rule: Rule, timeout_s: float) -> None:
    """The verifier's image (the instance's, with tests/ at /tests) and what it runs."""
    (tests / "Dockerfile").write_text(f"FROM {instance.image_name}\nCOPY . /tests\n")
    (tests / "test_patch.diff").write_text(instance.test_patch)
    for name, text in official_scripts(instance, PATCH, "/tests/test_patch.diff").items():
        (tests / name).write_text(text)
    shutil.copyfile(VERDICT_SCRIPT, tests / "verdict.py")
    shutil.copyfile(parsers.path, tests / "log_parsers.py")
    constants = parsers.path.parent / "swe_constants.py"
    if constants.is_file():
        shutil.copyfile(constants, tests / "swe_constants.py")
    spec = {"instance_id": instance.instance_id, "log_parser": instance.install_config.log_parser,
            "FAIL_TO_PASS": instance.FAIL_TO_PASS, "PASS_TO_PASS": instance.PASS_TO_PASS, "rule": rule}
    (tests / "swe_rebench.json").write_text(json.dumps(spec, indent=2) + "\n")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in GRADE_ENV.items())
    out, err, seconds = f"{LOGS}/tests.stdout", f"{LOGS}/tests.stderr", max(1, round(timeout_s))
    _script(
        tests / "test.sh",
        f"# SWE-rebench V2 {instance.instance_id}: the official steps in a fresh container of its image;",
        "# no reward (an error, not a 0) when the grade cannot run.",
        f"zero() {{ echo \"swe-rebench: $1: reward 0\"; echo '{ZERO}' > {LOGS}/reward.json; exit 0; }}",
        "fail() { echo \"swe-rebench: $1: no verdict\"; exit 1; }",
        "python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2> /dev/null || fail 'no python3 (3.8 or "
        "later) in this image to parse the log; grade it with sprout swe-rebench grade'",
        f"[ -f {PATCH} ] || fail 'no collected diff (the collect step failed)'",
        f"cd {shlex.quote(repo_dir(instance))} || fail 'no repository directory'",
        f"bash /tests/setup.sh >> {out} 2>> {err}; code=$?  # in the log, as the official harness keeps it",
        "[ $code = 3 ] && zero \"the agent's diff did not apply\"",
        "[ $code = 4 ] && zero 'the test patch did not apply'",
        f"[ $code = 0 ] || {{ tail -n 20 {out} {err}; fail 'the reset failed'; }}",
        f"env {env} timeout -k 30 {seconds} bash /tests/tests.sh >> {out} 2>> {err}; code=$?",
        f"[ $code = 124 ] || [ $code = 137 ] && zero 'the test commands timed out after {seconds}s'",
        "[ $code = 126 ] || [ $code = 127 ] && fail 'the test commands could not start (timeout or bash missing)'",
        f"exec python3 /tests/verdict.py --spec /tests/swe_rebench.json --parsers /tests/log_parsers.py "
        f"--parsers-sha256 {parsers.sha256} --log {out} --log {err} "
        f"--reward {LOGS}/reward.json --details {LOGS}/swe_rebench_verdict.json",
    )


def _script(path: Path, *lines: str) -> None:
    path.write_text("\n".join(["#!/bin/bash", *lines]) + "\n")
    path.chmod(0o755)
