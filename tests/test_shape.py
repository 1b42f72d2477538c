"""What the code's shape promises (docs/architecture.md), checked on the source itself: the generated pages
match what generates them, every SPROUT_* variable is a setting or documented, no module reads one itself,
no function is longer than a reader can hold, no backend name is compared outside the backends."""

import ast
import re
from pathlib import Path

import pytest

from sprout import settings as settings_module
from sprout.cli.reference import reference_markdown
from sprout.settings import OTHER_VARIABLES, Settings, configuration_markdown
from tests.conftest import REPO

pytestmark = pytest.mark.python_only

SOURCE = REPO / "src" / "sprout"
MAX_FUNCTION_LINES = 80


def python_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_generated_pages_are_up_to_date():
    assert (REPO / "docs" / "configuration.md").read_text() == configuration_markdown(), \
        "regenerate it: .venv/bin/python -m sprout.settings > docs/configuration.md"
    assert (REPO / "docs" / "cli.md").read_text() == reference_markdown(), \
        "regenerate it: .venv/bin/python -m sprout.cli.reference > docs/cli.md"


def test_every_sprout_variable_is_a_setting_or_documented():
    settings = {f"SPROUT_{name.upper()}" for name in Settings.model_fields}
    documented = settings | set(OTHER_VARIABLES)
    pg = {"SPROUT_PG_PORT", "SPROUT_PG_USER", "SPROUT_PG_PASSWORD", "SPROUT_PG_DB"}  # with SPROUT_PG_DIR
    used: dict[str, str] = {}
    for path in [*python_files(SOURCE, REPO / "examples", REPO / "bench"), *(REPO / "ops").glob("*.sh")]:
        for name in re.findall(r"SPROUT_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()):
            used.setdefault(name, str(path.relative_to(REPO)))
    undocumented = {name: where for name, where in used.items() if name not in documented | pg}
    assert undocumented == {}, "add these to sprout.settings (a field, or OTHER_VARIABLES)"


def test_no_module_reads_a_sprout_variable_itself():
    """Only sprout.settings reads SPROUT_* (when called, never at import)."""
    readers = []
    for path in python_files(SOURCE):
        if path == Path(settings_module.__file__):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"(environ|getenv)\b.*SPROUT_", line) and "setdefault" not in line:
                readers.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert readers == []


def test_no_function_is_longer_than_a_reader_can_hold():
    long = []
    for path in python_files(SOURCE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_no_backend_name_is_compared_outside_the_backends():
    backends = SOURCE / "sandbox" / "backends"
    compared = []
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?["'](container|microvm)["']|["'](container|microvm)["']\s*(==|!=)""")
    for path in python_files(SOURCE):
        if backends in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if pattern.search(line):
                compared.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert compared == []
