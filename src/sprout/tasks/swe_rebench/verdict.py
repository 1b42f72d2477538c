"""The official verdict on a test log, stdlib only: the user's parsers file (the official
lib/agent/log_parsers.py, pinned by sha256), timing suffixes stripped from test names, and the exact
and lenient rules. Sprout's grader imports it; `to-harbor` copies this file into a task's tests/ and its
verifier runs it as a script in the instance's image (any python3 from 3.8):

    python3 verdict.py --spec swe_rebench.json --parsers log_parsers.py --log stdout --log stderr \
        --reward /logs/verifier/reward.json --details /logs/verifier/swe_rebench_verdict.json
"""

from __future__ import annotations
import __future__

import argparse
import dataclasses
import difflib
import hashlib
import inspect
import json
import re
import sys
import threading
import types
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, Iterator  # noqa: UP035 - python3.8 in verifier containers

try:
    from ..errors import TaskError as _ErrorBase
except ImportError:  # run as a script in a verifier container, outside Sprout
    _ErrorBase = Exception  # type: ignore[misc, assignment]

# Timing suffixes test runners put in test names, stripped as scripts/eval.py strips them (in this order):
TIMING_PATTERNS = [
    re.compile(r"\s*\[\s*\d+(?:\.\d+)?\s*(?:ms|s)\s*\]\s*$", re.IGNORECASE),  # " [1.34 ms]" at the end
    re.compile(r"\s+in\s+\d+(?:\.\d+)?\s+(?:msec|sec)\b", re.IGNORECASE),  # " in 29.08 msec" anywhere
    re.compile(r"\s*\(\s*\d+(?:\.\d+)?\s*(?:ms|s)\s*\)\s*$", re.IGNORECASE),  # " (1.234s)" at the end
]

Parser = Callable[[str], Dict[str, str]]


class SweGradeError(_ErrorBase):
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
    if sha256 is not None and _hex(sha256) != actual:
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
            # postponed annotations: the official parsers annotate `-> dict[str, str]`, which python3.8 (a
            # verifier image's) cannot evaluate
            code = compile(source, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
            exec(code, module.__dict__)  # noqa: S102 - the user's pinned file
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
            added[name].__path__ = []
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


# ---------------------------------------------------------------- the log


LOG_NOT_UTF8 = "log_not_utf8"  # the zero reason of a log the official harness cannot decode


def official_log(parts: list[tuple[str, bytes]]) -> tuple[str, str | None]:
    """The test log as the official harness reads it (`subprocess.run(..., text=True)`): each part (stdout,
    then stderr: `(name, bytes)`) decoded as strict UTF-8, with universal newlines ("\\r\\n" and a lone
    "\\r" become "\\n") before any parser sees it. Returns (log, None), or, when a part is not UTF-8,
    (the log with replacement characters, why): the official harness then records an error, and the
    instance is not resolved whatever the tests did."""
    texts: list[str] = []
    problem = None
    for name, data in parts:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            text = data.decode("utf-8", "replace")
            problem = problem or (f"the test output ({name}) is not UTF-8 (byte {e.start}: "
                                  f"{data[e.start:e.start + 1]!r}): the official harness cannot decode it")
        texts.append(text.replace("\r\n", "\n").replace("\r", "\n"))
    return "".join(texts), problem


# ---------------------------------------------------------------- verdicts


def strip_timing(name: str) -> str:
    """A test name without the timing the runner put in it (`test_x [1.3 ms]`, `t in 29 msec`, `t (1.2s)`)."""
    for pattern in TIMING_PATTERNS:
        name = pattern.sub("", name)
    return name.strip()


@dataclasses.dataclass
class Verdict:
    rule: str  # exact | lenient
    resolved: bool  # by `rule`
    exact: bool  # the official rule: the PASSED names are exactly FAIL_TO_PASS ∪ PASS_TO_PASS
    lenient: bool  # every expected test PASSED (other tests may pass or fail)
    passed: list[str]  # sorted, timing stripped
    fail_to_pass_missing: list[str]  # FAIL_TO_PASS tests not PASSED (failed, skipped or absent)
    pass_to_pass_failed: list[str]  # PASS_TO_PASS tests not PASSED
    unexpected_passed: list[str]  # PASSED but not expected: breaks the exact rule only


def verdict(statuses: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str],
            rule: str = "exact") -> Verdict:
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


def _hex(sha256: str) -> str:
    """A pin as hex, given as `hex` or `sha256:hex`."""
    sha256 = sha256.lower()
    return sha256[len("sha256:"):] if sha256.startswith("sha256:") else sha256


# ---------------------------------------------------------------- in a verifier container


def main(argv: list[str] | None = None) -> int:
    """Writes Harbor's reward.json (`reward` by the spec's rule, `resolved_exact`, `resolved_lenient`) and the
    verdict's details; exit 2 (no reward written) when the log cannot be judged."""
    p = argparse.ArgumentParser(description="the official SWE-rebench V2 verdict on a test log")
    p.add_argument("--spec", type=Path, required=True, help="JSON: log_parser, FAIL_TO_PASS, PASS_TO_PASS, rule")
    p.add_argument("--parsers", type=Path, required=True)
    p.add_argument("--parsers-sha256")
    p.add_argument("--log", type=Path, action="append", required=True, help="log parts, joined in this order")
    p.add_argument("--reward", type=Path, required=True)
    p.add_argument("--details", type=Path, required=True)
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    try:
        parser = load_parsers(args.parsers, args.parsers_sha256).get(spec["log_parser"])
        log, problem = official_log([(part.name, part.read_bytes()) for part in args.log if part.is_file()])
        judged = verdict(dict(parser(log)), spec["FAIL_TO_PASS"], spec["PASS_TO_PASS"], spec["rule"])
    except Exception as e:  # noqa: BLE001 - no verdict, with its reason, and no reward
        print(f"swe-rebench verdict: no verdict: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    counts = problem is None  # an undecodable log resolves nothing, as in the official harness
    details = dataclasses.asdict(judged)
    if problem:
        details.update(zero_reason=LOG_NOT_UTF8, error=problem)
    args.details.write_text(json.dumps(details, indent=2))
    args.reward.write_text(json.dumps({"reward": float(judged.resolved and counts),
                                       "resolved_exact": float(judged.exact and counts),
                                       "resolved_lenient": float(judged.lenient and counts)}))
    print(f"swe-rebench verdict: resolved={judged.resolved and counts} (rule {judged.rule}; exact={judged.exact}, "
          f"lenient={judged.lenient})" + (f"; not resolved: {problem}" if problem else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
