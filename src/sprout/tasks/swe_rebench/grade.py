"""Grading SWE-rebench V2 instances as the official harness does (SWE-rebench/SWE-rebench-V2,
scripts/eval.py), in a fresh sandbox of the instance's image, never the agent's.

The official steps: in `/<repo name>`, `git reset --hard HEAD`; the agent's patch and then the
`test_patch` applied with `git apply -v --3way --recount --ignore-space-change --whitespace=nowarn`;
each `install_config.test_cmd` run in one `bash -c` script under `set -e` (never `install`); the log
(stdout, then stderr) parsed by the instance's named parser from the user's parsers file; timing
suffixes stripped from the parsed and the expected test names; resolved when the sorted PASSED names
equal FAIL_TO_PASS + PASS_TO_PASS (the exact rule).

The log is read as the official harness reads it (verdict.official_log): strict UTF-8 (a log that is
not resolves nothing: `log_not_utf8`) and universal newlines. Where Sprout differs, on purpose (the
table in docs/swe-rebench.md; a grade's `differences` name the ones that applied): the tests run
under a timeout; a patch that does not apply ends the grade (`patch_failed`) rather than parsing an
empty log (the same verdict); an empty agent diff is not applied (the official harness refuses an
empty patch) so the tests still run and report; expected names are compared as a set.

`swebench` 5.0.2 (harness/grading.py: get_eval_tests_report, get_resolution_status) has the lenient
rule's shape, FULL resolution, with other semantics: XFAIL counts as passed, a SKIPPED PASS_TO_PASS test
counts as kept, and a truncated parametrized id matches by prefix. `lenient` here asks every expected test
to be PASSED; the two agree on maps of PASSED, FAILED, ERROR, absent and SKIPPED FAIL_TO_PASS tests (a
test checks this). It is not imported here: importing swebench.harness.grading imports its whole harness
(docker, modal, datasets); it is a test dependency only.
"""

import re
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ...sandbox import Checkpoint, Sandbox, Store
from ..pull import PullPolicy, ensure_present, pull_policy
from .instances import Instance, repo_dir
from .verdict import Parser, Parsers, SweGradeError, official_log, verdict

Rule = Literal["exact", "lenient"]
ZeroReason = Literal["not_resolved", "patch_failed", "timeout", "log_not_utf8", "grade_failed"]
# Where this grade went another way than the official harness would, on purpose (docs/swe-rebench.md):
Difference = Literal["empty_patch_ran_tests", "patch_failed_ran_nothing", "tests_timed_out"]
MAX_LOG_CHARS = 64_000
GIT_APPLY = "git apply -v --3way --recount --ignore-space-change --whitespace=nowarn"
GRADE_ENV = {"_JAVA_OPTIONS": "-Djava.net.preferIPv6Addresses=false"}  # as the official `docker run -e`
WORK = "/tmp/sprout-swe-grade"  # patches, the test script and its output, outside the repository
SETUP_TIMEOUT_S = 600.0
MAX_READ_BYTES = 256 << 20  # a log or diff read back from a sandbox
GIT = "git -c safe.directory='*'"

# ---------------------------------------------------------------- diffs

_HEADER = re.compile(r'^diff --git (?:"a/(?P<qa>(?:[^"\\]|\\.)*)"|a/(?P<a>\S+)) (?:"b/(?P<qb>(?:[^"\\]|\\.)*)"|b/(?P<b>.+))$')


def diff_paths(diff: str) -> set[str]:
    """The paths (both sides) a git diff's `diff --git a/X b/Y` headers name."""
    paths: set[str] = set()
    for line in diff.splitlines():
        if not line.startswith("diff --git "):
            continue
        rest = line[len("diff --git "):]
        half = (len(rest) - 5) // 2  # unquoted "a/P b/P" with spaces in P: split in the middle
        if len(rest) % 2 == 1 and rest.startswith("a/") and rest == f"a/{rest[2:2 + half]} b/{rest[2:2 + half]}":
            paths.add(rest[2:2 + half])
            continue
        match = _HEADER.match(line)
        if match:
            paths.add(_unquote(match["qa"]) if match["qa"] is not None else match["a"])
            paths.add(_unquote(match["qb"]) if match["qb"] is not None else match["b"])
    return paths


def _unquote(text: str) -> str:
    """A git-quoted path's text (C escapes, octal bytes as UTF-8)."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1").decode(
            "utf-8", "replace")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return text


def touched_test_paths(agent_diff: str, test_patch: str) -> list[str]:
    """The files of `test_patch` that the agent's diff also changes."""
    return sorted(diff_paths(agent_diff) & diff_paths(test_patch))


def agent_diff(source: Sandbox | Checkpoint, instance: Instance, *, timeout_s: float = 300) -> str:
    """The agent's change against `base_commit`, untracked files included, binary-safe: in a throwaway
    branch of a checkpoint, or in a running sandbox through a temporary git index (its own index and
    work tree stay as they were; git only adds the blobs to its object store)."""
    if isinstance(source, Checkpoint):
        branch = source.branch(label=f"swe-diff {instance.instance_id}")
        try:
            return _diff_in(branch, instance, timeout_s)
        finally:
            branch.destroy()
    return _diff_in(source, instance, timeout_s)


def diff_script(instance: Instance, out: str) -> str:
    """A bash script, run in the repository, that writes the agent's diff against `base_commit` to `out`
    through a temporary git index."""
    base = shlex.quote(instance.base_commit)
    return "\n".join([
        "set -e",
        "idx=$(mktemp); trap 'rm -f \"$idx\"' EXIT; rm -f \"$idx\"",
        f'gitdir=$({GIT} rev-parse --absolute-git-dir); if [ -f "$gitdir/index" ]; then cp "$gitdir/index" "$idx"; fi',
        f'GIT_INDEX_FILE="$idx" {GIT} add -A',
        f'GIT_INDEX_FILE="$idx" {GIT} diff --cached --binary {base} > {shlex.quote(out)}',
    ])


def _diff_in(sandbox: Sandbox, instance: Instance, timeout_s: float) -> str:
    out = f"/tmp/sprout-swe-diff-{secrets.token_hex(6)}.patch"
    result = sandbox.exec(diff_script(instance, out), cwd=repo_dir(instance), timeout=timeout_s)
    try:
        if result.exit_code != 0:
            raise SweGradeError(f"instance {instance.instance_id}: taking the agent's diff failed "
                                f"(exit {result.exit_code}): {result.output.strip()[-2000:]}")
        data = _read_back(sandbox, out)
    finally:
        sandbox.exec(["rm", "-f", out], timeout=60)
    return data.decode("utf-8", "surrogateescape")


def _read_back(sandbox: Sandbox, path: str) -> bytes:
    """The bytes of a regular file in the sandbox (b"" when absent), read in chunks, at most MAX_READ_BYTES."""
    with sandbox.files() as files:
        return files.read_file(path, MAX_READ_BYTES) or b""


# ---------------------------------------------------------------- grading


class SweGrade(BaseModel):
    instance_id: str
    reward: float | None  # 1.0 resolved, 0.0 not, None when the grade could not run
    resolved: bool | None  # by `rule`; None when the grade could not run
    resolved_exact: bool | None
    resolved_lenient: bool | None
    rule: Rule
    zero_reason: ZeroReason | None  # why reward is not 1.0
    statuses: dict[str, str]  # as the parser reported them
    fail_to_pass_missing: list[str]
    pass_to_pass_failed: list[str]
    unexpected_passed: list[str]
    touched_test_paths: list[str]
    log_tail: str
    error: str | None
    duration_s: float
    timings: dict[str, float]  # seconds per phase: image, start, apply (staging too), tests, parse, destroy
    grader_revision: str
    test_exit_code: int | None = None
    differences: list[Difference] = []  # the intended differences from the official harness that applied


class _Failed(Exception):
    def __init__(self, reason: ZeroReason, message: str):
        super().__init__(message)
        self.reason = reason


def grade_instance(store: Store, instance: Instance, diff: str, parsers: Parsers, *, timeout_s: float,
                   rule: Rule = "exact", pull: PullPolicy | None = None, network: bool = True,
                   log_path: Path | None = None) -> SweGrade:
    """Grades the agent's `diff` in a fresh sandbox of `instance.image_name` (made present as the pull
    policy says), destroyed afterwards. `timeout_s` bounds the test commands; `network`: the official
    harness runs with the host's network. `log_path` keeps the whole test log."""
    started = time.monotonic()
    touched = touched_test_paths(diff, instance.test_patch)
    result: dict = {"statuses": {}, "log": "", "exit": None, "timings": {}}
    reason: ZeroReason | None
    try:
        parser = parsers.get(instance.install_config.log_parser)
        _run(store, instance, diff, parser, timeout_s, pull, network, result)
        judged = verdict(result["statuses"], instance.FAIL_TO_PASS, instance.PASS_TO_PASS, rule)
        error, reason = None, None if judged.resolved else "not_resolved"
    except _Failed as e:
        judged = verdict(result["statuses"], instance.FAIL_TO_PASS, instance.PASS_TO_PASS, rule)
        error, reason = str(e), e.reason
    except Exception as e:  # noqa: BLE001 - a grade that cannot run has no verdict, with its message
        judged, error, reason = None, f"{type(e).__name__}: {' '.join(str(e).split())}", "grade_failed"
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(result["log"], errors="replace")
    counts = reason in (None, "not_resolved")
    resolved = None if judged is None else judged.resolved and counts
    return SweGrade(
        instance_id=instance.instance_id, reward=None if resolved is None else float(resolved), resolved=resolved,
        resolved_exact=(judged.exact and counts) if judged else None,
        resolved_lenient=(judged.lenient and counts) if judged else None, rule=rule, zero_reason=reason,
        statuses=result["statuses"], fail_to_pass_missing=judged.fail_to_pass_missing if judged else [],
        pass_to_pass_failed=judged.pass_to_pass_failed if judged else [],
        unexpected_passed=judged.unexpected_passed if judged else [], touched_test_paths=touched,
        log_tail=result["log"][-MAX_LOG_CHARS:], error=error, duration_s=time.monotonic() - started,
        timings=result["timings"], grader_revision=parsers.grader_revision, test_exit_code=result["exit"],
        differences=_differences(diff, reason))


def _differences(diff: str, reason: ZeroReason | None) -> list[Difference]:
    """Which of the intended differences from the official harness decided how this grade went: it
    refuses an empty patch (an error, every PASS_TO_PASS test reported failed) where Sprout runs the
    tests; under `set -e` it parses the empty log of a patch that did not apply where Sprout stops with
    `patch_failed` (the same verdict); it has no timeout."""
    found: list[Difference] = []
    if not diff.strip() and reason not in ("patch_failed", "grade_failed"):
        found.append("empty_patch_ran_tests")
    if reason == "patch_failed":
        found.append("patch_failed_ran_nothing")
    if reason == "timeout":
        found.append("tests_timed_out")
    return found


def _run(store: Store, instance: Instance, diff: str, parser: Parser, timeout_s: float,
         pull: PullPolicy | None, network: bool, result: dict) -> None:
    """The official steps in a fresh sandbox; fills `result` (statuses, log, exit, timings) as far as it got."""
    what = f"instance {instance.instance_id}'s image"
    lap = _Laps(result["timings"])
    ensure_present(store, instance.image_name, pull_policy(pull), what=what)
    image = store.import_image(instance.image_name)
    lap("image")
    sandbox = store.create_sandbox(image, network=network, label=f"swe-grade {instance.instance_id}")
    lap("start")
    try:
        with tempfile.TemporaryDirectory(prefix="sprout-swe-grade-") as tmp:
            _stage(sandbox, Path(tmp), instance, diff)
        workdir = repo_dir(instance)
        setup = sandbox.exec(f"bash {WORK}/setup.sh >>{WORK}/stdout 2>>{WORK}/stderr", cwd=workdir,
                             env=GRADE_ENV, timeout=SETUP_TIMEOUT_S)
        if setup.timed_out or setup.exit_code != 0:
            result["log"] = _log(sandbox)[0]
            if setup.timed_out or setup.exit_code not in (3, 4):
                raise SweGradeError(f"`git reset --hard HEAD` in {workdir} failed or timed out "
                                    f"(exit {setup.exit_code}): {result['log'].strip()[-1000:]}")
            which = "the agent's diff" if setup.exit_code == 3 else "the test_patch"
            raise _Failed("patch_failed", f"{which} did not apply")
        lap("apply")
        tests = sandbox.exec(f"bash {WORK}/tests.sh >>{WORK}/stdout 2>>{WORK}/stderr", cwd=workdir,
                             env=GRADE_ENV, timeout=timeout_s)
        (result["log"], unreadable), result["exit"] = _log(sandbox), tests.exit_code
        lap("tests")
        result["statuses"] = dict(parser(result["log"]))
        lap("parse")
        if tests.timed_out:
            raise _Failed("timeout", f"the test commands timed out after {timeout_s:g}s")
        if unreadable:
            raise _Failed("log_not_utf8", unreadable)
    finally:
        sandbox.destroy()
        lap("destroy")


class _Laps:
    """Seconds per phase, each from the end of the one before."""

    def __init__(self, into: dict[str, float]):
        self.into, self.mark = into, time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase], self.mark = round(now - self.mark, 3), now


def git_apply(patch: str) -> str:
    """The official `git apply` of a patch file."""
    return f"{GIT} {GIT_APPLY.removeprefix('git ')} {shlex.quote(patch)}"


def official_scripts(instance: Instance, patch: str | None, test_patch: str) -> dict[str, str]:
    """The official steps as two bash scripts run in the repository: `setup.sh` (reset, then the agent's
    patch file when there is one and it is not empty, then the test patch file; exit 3 or 4 when that patch does not apply)
    and `tests.sh` (the instance's test commands under `set -e`)."""
    setup = ["set -e", f"{GIT} reset --hard HEAD"]
    if patch is not None:
        setup.append(f"if [ -s {shlex.quote(patch)} ]; then {git_apply(patch)} || exit 3; fi")
    setup.append(f"{git_apply(test_patch)} || exit 4")
    return {"setup.sh": "\n".join(setup) + "\n",
            "tests.sh": "\n".join(["set -e", *instance.install_config.test_cmd]) + "\n"}


def _stage(sandbox: Sandbox, tmp: Path, instance: Instance, diff: str) -> None:
    """Writes the patches and the two scripts into the sandbox under WORK (world-writable)."""
    scripts = official_scripts(instance, f"{WORK}/patch.diff" if diff.strip() else None, f"{WORK}/test_patch.diff")
    staged = {"patch.diff": diff, "test_patch.diff": instance.test_patch, **scripts, "stdout": "", "stderr": ""}
    with sandbox.files() as files:
        files.ensure_dirs([WORK], (0, 0))
        for name, text in staged.items():
            local = tmp / name
            local.write_bytes(text.encode("utf-8", "surrogateescape"))
            local.chmod(0o666)
            files.upload_file(local, f"{WORK}/{name}", (0, 0))


def _log(sandbox: Sandbox) -> tuple[str, str | None]:
    """The log as the official harness reads it (all of stdout, then all of stderr; see official_log) and,
    when it could not decode it, why."""
    return official_log([(name, _read_back(sandbox, f"{WORK}/{name}")) for name in ("stdout", "stderr")])
