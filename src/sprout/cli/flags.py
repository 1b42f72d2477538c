"""Every flag that more than one command takes, defined once: its name, type, metavar and help text.

Conventions, the same for every command: a list is space-separated (`--tasks a b`; a list of names also
takes the seed's comma form, `--tasks a,b`, through `names_list`); a duration is in seconds; `-o/--output` names what
a command writes; `--store` and `--runtime-bin` are flags of the command that uses them (never of a group).
Exit status: 0 done, 1 failed, 2 usage (a flag the parser refuses, or flags that cannot go together).
"""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..agent import defaults
from ..errors import UsageError
from ..sandbox import backends
from ..tasks.pull import PULL_HELP, PULL_POLICIES


def names_list(text: str) -> list[str]:
    """An argparse type for list items: `a,b` is two items (the seed's form), `a` one."""
    return [item for item in (part.strip() for part in text.split(",")) if item]


def flatten(values: list[list[str]] | None) -> list[str] | None:
    """The items of a `names_list` flag given with nargs="+", in order."""
    return None if values is None else [item for group in values for item in group]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


FLAGS: dict[str, Flag] = {
    # ---------------------------------------------------------------- the store and sandboxes
    "store": Flag(("--store",), {"type": Path, "metavar": "DIR",
                                 "help": "the btrfs store (default: $SPROUT_STORE, else ~/sprout-btrfs)"}),
    "runtime_bin": Flag(("--runtime-bin",), {"type": Path, "metavar": "PATH", "help": (
        "run commands in containers through this confined runtime (default: $SPROUT_RUNTIME_BIN, else "
        "`podman exec`; ops/setup_podman.sh writes runtime/sprout-runtime)")}),
    "backend": Flag(("--backend",), {"choices": backends.names(), "default": backends.DEFAULT,
                                     "help": backends.help_text()}),
    "pull": Flag(("--pull",), {"choices": PULL_POLICIES, "default": None, "help": PULL_HELP}),
    # ---------------------------------------------------------------- the agent and its model
    "model": Flag(("--model",), {"required": True, "help": "the agent's model, as its endpoint serves it"}),
    "model_endpoint": Flag(("--model-endpoint",), {"metavar": "URL", "help": (
        "the Chat Completions base URL of the agent's model (default: $OPENAI_BASE_URL); over a Run Store it is "
        "called with no key")}),
    "model_key_env": Flag(("--model-key-env",), {"metavar": "VAR", "help": (
        "the variable holding the model's API key (default OPENAI_API_KEY); its value is never recorded")}),
    "model_endpoint_name": Flag(("--model-endpoint-name",), {"metavar": "NAME", "help": (
        "over a Run Store: a model endpoint configured on the workers (services.json), called with their key "
        "(default: default, unless --model-endpoint is given)")}),
    "model_class": Flag(("--model-class",), {"choices": ["tools", "text"], "default": "tools", "help": (
        "tools: tool calls with mini-swe-agent's mini.yaml (default); text: ```mswea_bash_command blocks, for "
        "endpoints without tool support")}),
    "model_retries": Flag(("--model-retries",), {"type": int, "default": 4, "metavar": "N", "help": (
        "tries per agent model call, with exponential backoff when no answer came or on 408/409/425/429/5xx "
        "(default 4; another 4xx is not asked again)")}),
    "step_limit": Flag(("--step-limit",), {"type": int, "default": defaults.STEP_LIMIT, "metavar": "N", "help": (
        f"model calls per rollout (a branch of turn k gets the rest; default {defaults.STEP_LIMIT})")}),
    "token_limit": Flag(("--token-limit",), {"type": int, "default": defaults.TOKEN_LIMIT, "metavar": "N", "help": (
        f"prompt and completion tokens per rollout (default {defaults.TOKEN_LIMIT:,}; 0: none)")}),
    "wall_time_limit": Flag(("--wall-time-limit",), {"type": int, "metavar": "SECONDS", "help": (
        f"seconds per rollout (default {defaults.WALL_TIME_S}; an evaluation's default is the task's "
        "[agent].timeout_sec)")}),
    "command_timeout": Flag(("--command-timeout",), {"type": int, "default": defaults.COMMAND_TIMEOUT_S,
                                                     "metavar": "SECONDS", "help": (
        f"seconds per agent command; on timeout its whole process tree is killed (default "
        f"{defaults.COMMAND_TIMEOUT_S})")}),
    # ---------------------------------------------------------------- datasets
    "tasks_dir": Flag(("--tasks-dir",), {"type": Path, "required": True, "metavar": "DIR",
                                         "help": "the dataset: a directory of Harbor task directories"}),
    "tasks": Flag(("--tasks",), {"type": names_list, "nargs": "+", "metavar": "NAME",
                                 "help": "only these tasks (directory names; default: all)"}),
    "task_ids_file": Flag(("--task-ids-file",), {"type": Path, "metavar": "IDS", "help": (
        "only the tasks named in this file (one directory name a line, # comments), e.g. SWE-bench Pro's "
        "v2/hard51_ids.txt; recorded in the output")}),
    "exclude_flaky": Flag(("--exclude-flaky",), {"type": Path, "metavar": "SUMMARY", "help": (
        "leave out the tasks this gate summary (the summary.json of `sprout gate --trials K`) found flaky; "
        "recorded")}),
    "dataset_digest": Flag(("--dataset-digest",), {"required": True, "metavar": "SHA256", "help": (
        "the Harbor dataset digest (sha256:...) of the tasks directory; must match what it is now")}),
    "preparation_manifest": Flag(("--preparation-manifest",), {"type": Path, "required": True, "metavar": "FILE",
                                                               "help": "the manifest `sprout prepare` wrote; must "
                                                                       "list the task with its digest"}),
    # ---------------------------------------------------------------- output and the Run Store
    "json": Flag(("--json",), {"action": "store_true", "help": "machine-readable output (JSON)"}),
    "quiet": Flag(("--quiet",), {"action": "store_true", "help": "no per-turn lines"}),
    "runstore_url": Flag(("--url",), {"metavar": "URL", "help": (
        "the Run Store API (default: $SPROUT_RUNSTORE_URL, which `sprout services env` exports)")}),
    "token_file": Flag(("--token-file",), {"type": Path, "metavar": "FILE", "help": (
        "a file holding the Run Store token (default: $SPROUT_RUNSTORE_TOKEN)")}),
}


def build[M: BaseModel](config_class: type[M], /, **values: Any) -> M:
    """A library config built from flags; a value it refuses is one usage error naming its flag."""
    try:
        return config_class(**values)
    except ValidationError as e:
        first = e.errors()[0]
        flag = "--" + str(first["loc"][-1]).replace("_", "-") if first["loc"] else "the flags"
        if first["type"] in ("greater_than_equal", "greater_than"):
            bound = (first.get("ctx") or {}).get("ge", (first.get("ctx") or {}).get("gt"))
            raise UsageError(f"{flag} must be {'at least' if first['type'] == 'greater_than_equal' else 'more than'} "
                             f"{bound}") from None
        raise UsageError(f"{flag}: {first['msg']}") from None


def add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str,
        **overrides: Any) -> None:
    """Adds the named flags (FLAGS keys) to `parser`; `overrides` (default=..., required=..., help=...)
    apply to the one flag named, for a command whose meaning differs."""
    if overrides and len(names) != 1:
        raise ValueError("overrides apply to one flag")
    for name in names:
        flag = FLAGS[name]
        parser.add_argument(*flag.names, dest=name, **(flag.options | overrides))


def output(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str, *, required: bool = True,
           default: Path | None = None) -> None:
    """`-o/--output`: what this command writes (`what`, e.g. "the manifest to write (JSON)")."""
    parser.add_argument("-o", "--output", type=Path, required=required and default is None, default=default,
                        metavar="PATH", help=what)
