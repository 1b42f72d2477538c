"""The seed's `python -m` forms, each an alias of a `sprout` subcommand.

Each module below keeps an `if __name__ == "__main__": alias("<module>")` block; what the form runs, and
how its arguments are spelled now where the seed spelled them differently, is written here alone.
"""

from collections.abc import Callable

from ..errors import UsageError

Translate = Callable[[list[str]], list[str]]

SEED_KINDS = "sprout.worker.jobs"  # the seed's --kinds default: the module that registered Sprout's kinds


def _same(argv: list[str]) -> list[str]:
    return argv


def _worker(argv: list[str]) -> list[str]:
    """`python -m sprout.worker run|doctor|serve ...`: run and doctor are top-level commands now."""
    return ["worker", *argv] if argv[:1] == ["serve"] else argv


def _token(argv: list[str]) -> list[str]:
    """`python -m sprout.runstore.auth add TOKENS_FILE --scope S` as `sprout runstore token TOKENS_FILE ...`."""
    return argv[1:] if argv[:1] == ["add"] else argv


def _sandbox(argv: list[str]) -> list[str]:
    """`python -m sprout.sandbox [--store DIR] [--runtime-bin PATH] COMMAND ...` as `sprout sandbox COMMAND ...`:
    the store flags go after the command, and gc's --older-than, which counted hours there, becomes seconds."""
    leading: list[str] = []
    while argv and argv[0] in ("--store", "--runtime-bin") and len(argv) > 1:
        leading, argv = leading + argv[:2], argv[2:]
    argv = argv[:1] + leading + argv[1:]
    if argv[:1] == ["gc"] and "--older-than" in argv:
        at = argv.index("--older-than") + 1
        if at < len(argv):
            try:
                argv[at] = str(float(argv[at]) * 3600)
            except ValueError:
                pass  # the parser refuses it, with its own message
    return argv


def _runstore_api(argv: list[str]) -> list[str]:
    """`python -m sprout.runstore.api [--kinds sprout.worker.jobs] ...` as `sprout runstore serve ...`: the API
    is told Sprout's job kinds now, so the seed's one --kinds value is dropped and any other refused."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--kinds" or arg.startswith("--kinds="):
            value = arg.partition("=")[2] or next(args, "")
            if value != SEED_KINDS:
                from ..jobs.payloads import job_kinds

                raise UsageError(f"--kinds {value!r}: the Run Store serves Sprout's job kinds "
                                 f"({', '.join(job_kinds().names())}); --kinds {SEED_KINDS} is the only value left")
            continue
        out.append(arg)
    return out


#: module run with `python -m` -> (the `sprout` words it stands for, how its arguments are translated)
SEED_FORMS: dict[str, tuple[list[str], Translate]] = {
    "sprout.worker": ([], _worker),
    "sprout.sandbox": (["sandbox"], _sandbox),
    "sprout.services": (["services"], _same),
    "sprout.rl_driver": (["rl-driver"], _same),
    "sprout.tasks.swe_rebench": (["swe-rebench"], _same),
    "sprout.eval.prepare": (["prepare"], _same),
    "sprout.eval.gate": (["gate"], _same),
    "sprout.eval.evaluate": (["evaluate"], _same),
    "sprout.eval.benchmark": (["benchmark"], _same),
    "sprout.runstore.api": (["runstore", "serve"], _runstore_api),
    "sprout.runstore.auth": (["runstore", "token"], _token),
    "sprout.testing.scripted_model": (["scripted-model"], _same),
    "sprout.demo": (["demo"], _same),
    "ops.report": (["report"], _same),
    "ops.report_task": (["report", "task"], _same),
}
