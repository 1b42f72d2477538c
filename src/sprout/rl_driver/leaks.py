"""The leak gate of a repair turn: the hidden terms (what the grader knows and the agent was never shown)
that a reviewer's inserted turn names although the history before its point did not show them.

Hidden terms, as the contract counts them: each test file's path (at least 6 characters) and its basename
when that is not a generic name, and each FAIL_TO_PASS test name (at least 8 characters) and the
non-numeric `[A-Za-z0-9_]+` parts of it with at least 8 characters. A Harbor task's test files are the
files of its `tests/` directory, at the path Harbor copies them to (`/tests/...`) and relative to the task
(`tests/...`); a SWE-rebench V2 instance's are the files its test patch changes.
"""

import re
from pathlib import PurePosixPath

from ..tasks import load_task
from .config import ServedTask

GENERIC_BASENAMES = frozenset({
    "__init__.py", "conftest.py", "setup.py", "setup.cfg", "pyproject.toml", "test.py", "tests.py", "test.sh",
    "run_tests.sh", "utils.py", "helpers.py", "main.py", "index.js", "index.ts", "test.js", "test.ts", "main.go",
    "main_test.go", "mod.rs", "lib.rs", "main.rs", "Makefile", "README.md", "package.json", "Cargo.toml",
    "go.mod", "pom.xml", "build.gradle", "CMakeLists.txt",
})
_WORD = re.compile(r"[A-Za-z0-9_]+")


def hidden_terms(test_paths: list[str], fail_to_pass: list[str]) -> list[str]:
    terms: set[str] = set()
    for path in test_paths:
        if len(path) >= 6:
            terms.add(path)
        name = PurePosixPath(path).name
        if len(name) >= 6 and name not in GENERIC_BASENAMES:
            terms.add(name)
    for test in fail_to_pass:
        if len(test) >= 8:
            terms.add(test)
        terms.update(part for part in _WORD.findall(test) if len(part) >= 8 and not part.isdigit())
    return sorted(terms)


def leak_terms(turn_text: str, history_text: str, terms: list[str]) -> list[str]:
    """The terms `turn_text` names that `history_text` does not."""
    return sorted(term for term in terms if term in turn_text and term not in history_text)


def task_terms(task: ServedTask) -> list[str] | None:
    """The served task's hidden terms; None when they cannot be known (nothing to check against)."""
    if task.swe is not None:
        from ..tasks.swe_rebench.grade import diff_paths
        from ..tasks.swe_rebench.rollout import instance_of

        instance = instance_of(task.swe)
        return hidden_terms(sorted(diff_paths(instance.test_patch)), list(instance.FAIL_TO_PASS))
    if task.task_dir is None:
        return None
    tests = load_task(task.task_dir).paths.tests_dir
    if not tests.is_dir():
        return None
    relative = [f.relative_to(tests).as_posix() for f in sorted(tests.rglob("*")) if f.is_file()]
    return hidden_terms([f"/tests/{r}" for r in relative] + [f"tests/{r}" for r in relative], [])


def message_text(messages: list[dict]) -> str:
    """Everything a conversation showed: contents, reasoning and tool-call arguments."""
    parts = []
    for message in messages:
        parts += [str(message.get("content") or ""), str(message.get("reasoning_content") or "")]
        parts += [str((call.get("function") or {}).get("arguments") or "") for call in message.get("tool_calls") or []]
    return "\n".join(parts)
