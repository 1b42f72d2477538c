"""Grading SWE-rebench V2 instances as the official harness does (SWE-rebench/SWE-rebench-V2,
scripts/eval.py), in a fresh sandbox of the instance's image, never the agent's.

The official steps: in `/<repo name>`, `git reset --hard HEAD`; the agent's patch and then the
`test_patch` applied with `git apply -v --3way --recount --ignore-space-change --whitespace=nowarn`;
each `install_config.test_cmd` run in one `bash -c` script under `set -e` (never `install`); the log
(stdout, then stderr) parsed by the instance's named parser from the user's parsers file; timing
suffixes stripped from the parsed and the expected test names; resolved when the sorted PASSED names
equal FAIL_TO_PASS + PASS_TO_PASS (the exact rule).

Where Sprout differs, on purpose: the tests run under a timeout (the official harness has none); a
patch that does not apply ends the grade with reward 0 (`patch_failed`) rather than running nothing
and parsing an empty log (the same verdict); an empty agent diff is not applied (the official
harness refuses an empty patch) so the tests still run and report; expected names are compared as a
set (a name listed twice, or in both lists, can never match the official sorted list).

`swebench` (harness/grading.py: test_passed/test_failed, get_eval_tests_report, get_resolution_status)
has the lenient rule's shape but other semantics: XFAIL counts as passed, and an expected test that is
SKIPPED is neither a success nor a failure there (it drops out of the rate, so it does not stop FULL
resolution); a missing one fails, as here. `lenient` here asks every expected test to be PASSED; the two
agree on status maps holding only PASSED/FAILED/ERROR. swebench is not used: it is not installed here,
and importing swebench.harness.grading runs swebench/harness/__init__.py, which imports run_evaluation
(docker, modal, datasets).
"""

import difflib
import hashlib
import inspect
import re
import secrets
import shlex
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ..sandbox import Checkpoint, Sandbox, Store, rootfs
from . import transfer
from .errors import TaskError
from .pull import PullPolicy, ensure_present, pull_policy
from .swe_rebench import Instance, repo_dir

Rule = Literal["exact", "lenient"]
ZeroReason = Literal["not_resolved", "patch_failed", "timeout", "grade_failed"]
MAX_LOG_CHARS = 64_000
GIT_APPLY = "git apply -v --3way --recount --ignore-space-change --whitespace=nowarn"
GRADE_ENV = {"_JAVA_OPTIONS": "-Djava.net.preferIPv6Addresses=false"}  # as the official `docker run -e`
WORK = "/tmp/sprout-swe-grade"  # patches, the test script and its output, outside the repository
SETUP_TIMEOUT_S = 600.0
MAX_READ_BYTES = 256 << 20  # a log or diff read back from a sandbox
GIT = "git -c safe.directory='*'"

# Timing suffixes test runners put in test names, stripped as scripts/eval.py strips them (in this order):
TIMING_PATTERNS = [
    re.compile(r"\s*\[\s*\d+(?:\.\d+)?\s*(?:ms|s)\s*\]\s*$", re.IGNORECASE),  # " [1.34 ms]" at the end
    re.compile(r"\s+in\s+\d+(?:\.\d+)?\s+(?:msec|sec)\b", re.IGNORECASE),  # " in 29.08 msec" anywhere
    re.compile(r"\s*\(\s*\d+(?:\.\d+)?\s*(?:ms|s)\s*\)\s*$", re.IGNORECASE),  # " (1.234s)" at the end
]

Parser = Callable[[str], dict[str, str]]


class SweGradeError(TaskError):
    """A grade that cannot run: parsers file missing or wrong, parser name unknown, ..."""


# ---------------------------------------------------------------- parsers


class TestStatus(str, Enum):
    """The statuses parsers report (the official lib/agent/swe_constants.py has the same four)."""

    __test__ = False
    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    ERROR = "ERROR"


class Parsers:
    """The user's parsers file, imported from its path: functions named `parse_log_<x>` (or any name)
    taking the log and returning {test name: status}, found by name in its `NAME_TO_PARSER` mapping,
    else as module attributes (the official get_parser's order)."""

    def __init__(self, path: Path, sha256: str, module: types.ModuleType):
        self.path, self.sha256, self.module = path, sha256, module

    @property
    def grader_revision(self) -> str:
        return f"sha256:{self.sha256}"

    def names(self) -> list[str]:
        mapping = getattr(self.module, "NAME_TO_PARSER", None)
        names = set(mapping) if isinstance(mapping, dict) else set()
        names |= {name for name, value in vars(self.module).items()
                  if name.startswith("parse") and callable(value)}
        return sorted(names)

    def get(self, name: str) -> Parser:
        mapping = getattr(self.module, "NAME_TO_PARSER", None)
        parser = mapping.get(name) if isinstance(mapping, dict) else None
        if parser is None:
            parser = getattr(self.module, name, None)
        if not callable(parser):
            close = difflib.get_close_matches(name, self.names(), n=5, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise SweGradeError(f"no log parser {name!r} in the parsers file {self.path} "
                                f"({self.grader_revision}){hint}")
        return _one_argument(parser)


_LOADED: dict[tuple[str, str], types.ModuleType] = {}
_IMPORT_LOCK = threading.Lock()  # sys.modules is patched while a parsers file is imported


def load_parsers(path: Path | str, sha256: str | None = None) -> Parsers:
    """Imports the parsers file at `path` (e.g. the official lib/agent/log_parsers.py), its sha256 checked
    when given (hex or `sha256:hex`). Its `from lib.agent.swe_constants import TestStatus` resolves to a
    swe_constants.py beside it, else to Sprout's TestStatus."""
    path = Path(path).absolute()
    if not path.is_file():
        raise SweGradeError(f"no parsers file at {path}")
    source = path.read_bytes()
    actual = hashlib.sha256(source).hexdigest()
    if sha256 is not None and sha256.lower().removeprefix("sha256:") != actual:
        raise SweGradeError(f"the parsers file {path} has sha256 {actual}, not the pinned {sha256}")
    key = (str(path), actual)
    with _IMPORT_LOCK:
        if key not in _LOADED:
            _LOADED[key] = _import(path, source, actual)
    return Parsers(path, actual, _LOADED[key])


def _import(path: Path, source: bytes, digest: str) -> types.ModuleType:
    name = f"sprout_swe_parsers_{digest[:16]}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    try:
        with _constants_module(path.parent / "swe_constants.py"):
            exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the user's pinned file
    except Exception as e:  # noqa: BLE001 - any failure of the user's file is reported as one error
        raise SweGradeError(f"the parsers file {path} failed to import: {type(e).__name__}: {e}") from None
    return module


@contextmanager
def _constants_module(beside: Path) -> Iterator[None]:
    """`lib`, `lib.agent` and `lib.agent.swe_constants` in sys.modules while the parsers file runs, unless
    they are there already; removed afterwards (the parsers keep what they imported)."""
    if "lib.agent.swe_constants" in sys.modules:
        yield
        return
    constants = types.ModuleType("lib.agent.swe_constants")
    if beside.is_file():
        exec(compile(beside.read_bytes(), str(beside), "exec"), constants.__dict__)  # noqa: S102
    else:
        constants.TestStatus = TestStatus  # type: ignore[attr-defined]
    added = {}
    for name in ("lib", "lib.agent"):
        if name not in sys.modules:
            added[name] = types.ModuleType(name)
            added[name].__path__ = []  # type: ignore[attr-defined]
    added["lib.agent.swe_constants"] = constants
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _one_argument(parser: Callable) -> Parser:
    """The official parsers take the log only; a swebench-style `(log, test_spec)` one gets None."""
    try:
        required = [p for p in inspect.signature(parser).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return parser
    if len(required) >= 2:
        return lambda log: parser(log, None)
    return parser


# ---------------------------------------------------------------- verdicts


def strip_timing(name: str) -> str:
    """A test name without the timing the runner put in it (`test_x [1.3 ms]`, `t in 29 msec`, `t (1.2s)`)."""
    for pattern in TIMING_PATTERNS:
        name = pattern.sub("", name)
    return name.strip()


class Verdict(BaseModel):
    rule: Rule
    resolved: bool  # by `rule`
    exact: bool  # the official rule: the PASSED names are exactly FAIL_TO_PASS ∪ PASS_TO_PASS
    lenient: bool  # every expected test PASSED (other tests may pass or fail)
    passed: list[str]  # sorted, timing stripped
    fail_to_pass_missing: list[str]  # FAIL_TO_PASS tests not PASSED (failed, skipped or absent)
    pass_to_pass_failed: list[str]  # PASS_TO_PASS tests not PASSED
    unexpected_passed: list[str]  # PASSED but not expected: breaks the exact rule only


def verdict(statuses: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str],
            rule: Rule = "exact") -> Verdict:
    """The verdict on parsed statuses (names stripped of timing on both sides, as the official harness
    does; a later name that strips to an earlier one wins); `rule` decides `resolved`."""
    stripped = {strip_timing(name): status for name, status in statuses.items()}
    passed = {name for name, status in stripped.items() if status == TestStatus.PASSED.value}
    f2p = {strip_timing(name) for name in fail_to_pass}
    p2p = {strip_timing(name) for name in pass_to_pass}
    exact = passed == f2p | p2p
    lenient = (f2p | p2p) <= passed
    return Verdict(rule=rule, resolved=exact if rule == "exact" else lenient, exact=exact, lenient=lenient,
                   passed=sorted(passed), fail_to_pass_missing=sorted(f2p - passed),
                   pass_to_pass_failed=sorted(p2p - passed), unexpected_passed=sorted(passed - f2p - p2p))


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


def _diff_in(sandbox: Sandbox, instance: Instance, timeout_s: float) -> str:
    out = f"/tmp/sprout-swe-diff-{secrets.token_hex(6)}.patch"
    base = shlex.quote(instance.base_commit)
    script = "\n".join([
        "set -e",
        "idx=$(mktemp); trap 'rm -f \"$idx\"' EXIT; rm -f \"$idx\"",
        f'gitdir=$({GIT} rev-parse --absolute-git-dir); [ -f "$gitdir/index" ] && cp "$gitdir/index" "$idx"',
        f'GIT_INDEX_FILE="$idx" {GIT} add -A',
        f'GIT_INDEX_FILE="$idx" {GIT} diff --cached --binary {base} > {out}',
    ])
    result = sandbox.exec(script, cwd=repo_dir(instance), timeout=timeout_s)
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
    with tempfile.TemporaryDirectory(prefix="sprout-swe-read-") as tmp:
        local = Path(tmp) / "file"
        return local.read_bytes() if rootfs.copy_out(sandbox.path, path, local, MAX_READ_BYTES) else b""


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
    grader_revision: str
    test_exit_code: int | None = None


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
    result: dict = {"statuses": {}, "log": "", "exit": None}
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
    counts = judged is not None and reason in (None, "not_resolved")
    resolved = judged.resolved if counts else (False if judged is not None else None)
    return SweGrade(
        instance_id=instance.instance_id, reward=None if resolved is None else float(resolved), resolved=resolved,
        resolved_exact=(judged.exact and counts) if judged else None,
        resolved_lenient=(judged.lenient and counts) if judged else None, rule=rule, zero_reason=reason,
        statuses=result["statuses"], fail_to_pass_missing=judged.fail_to_pass_missing if judged else [],
        pass_to_pass_failed=judged.pass_to_pass_failed if judged else [],
        unexpected_passed=judged.unexpected_passed if judged else [], touched_test_paths=touched,
        log_tail=result["log"][-MAX_LOG_CHARS:], error=error, duration_s=time.monotonic() - started,
        grader_revision=parsers.grader_revision, test_exit_code=result["exit"])


def _run(store: Store, instance: Instance, diff: str, parser: Parser, timeout_s: float,
         pull: PullPolicy | None, network: bool, result: dict) -> None:
    """The official steps in a fresh sandbox; fills `result` (statuses, log, exit) as far as it got."""
    what = f"instance {instance.instance_id}'s image"
    ensure_present(store, instance.image_name, pull_policy(pull), what=what)
    image = store.import_image(instance.image_name)
    sandbox = store.create_sandbox(image, network=network, label=f"swe-grade {instance.instance_id}")
    try:
        with tempfile.TemporaryDirectory(prefix="sprout-swe-grade-") as tmp:
            _stage(sandbox, Path(tmp), instance, diff)
        workdir = repo_dir(instance)
        setup = sandbox.exec(f"bash {WORK}/setup.sh >>{WORK}/stdout 2>>{WORK}/stderr", cwd=workdir,
                             env=GRADE_ENV, timeout=SETUP_TIMEOUT_S)
        if setup.timed_out or setup.exit_code != 0:
            result["log"] = _log(sandbox)
            if setup.timed_out or setup.exit_code not in (3, 4):
                raise SweGradeError(f"`git reset --hard HEAD` in {workdir} failed or timed out "
                                    f"(exit {setup.exit_code}): {result['log'].strip()[-1000:]}")
            which = "the agent's diff" if setup.exit_code == 3 else "the test_patch"
            raise _Failed("patch_failed", f"{which} did not apply")
        tests = sandbox.exec(f"bash {WORK}/tests.sh >>{WORK}/stdout 2>>{WORK}/stderr", cwd=workdir,
                             env=GRADE_ENV, timeout=timeout_s)
        result["log"], result["exit"] = _log(sandbox), tests.exit_code
        result["statuses"] = dict(parser(result["log"]))
        if tests.timed_out:
            raise _Failed("timeout", f"the test commands timed out after {timeout_s:g}s")
    finally:
        sandbox.destroy()


def _stage(sandbox: Sandbox, tmp: Path, instance: Instance, diff: str) -> None:
    """Writes the patches and the two scripts into the sandbox under WORK (world-writable)."""
    setup = ["set -e", f"{GIT} reset --hard HEAD"]
    if diff.strip():
        setup.append(f"{GIT} {GIT_APPLY.removeprefix('git ')} {WORK}/patch.diff || exit 3")
    setup.append(f"{GIT} {GIT_APPLY.removeprefix('git ')} {WORK}/test_patch.diff || exit 4")
    files = {"patch.diff": diff, "test_patch.diff": instance.test_patch, "setup.sh": "\n".join(setup) + "\n",
             "tests.sh": "\n".join(["set -e", *instance.install_config.test_cmd]) + "\n", "stdout": "", "stderr": ""}
    transfer.ensure_dirs(sandbox.path, [WORK], (0, 0))
    for name, text in files.items():
        local = tmp / name
        local.write_bytes(text.encode("utf-8", "surrogateescape"))
        local.chmod(0o666)
        transfer.upload_file(sandbox.path, local, f"{WORK}/{name}", (0, 0))


def _log(sandbox: Sandbox) -> str:
    """The log as the official harness builds it: all of stdout, then all of stderr."""
    return b"".join(_read_back(sandbox, f"{WORK}/{name}") for name in ("stdout", "stderr")).decode("utf-8", "replace")
