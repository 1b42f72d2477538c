"""`sprout datasets get NAME@REF -o DIR`: a benchmark fetched as its users already fetch it, pinned.

Registry datasets (e.g. terminal-bench/terminal-bench-2-1@2.1.0, datacurve/deep-swe-1-1@1.1) come
through Harbor's own dataset client, as `harbor download` fetches them: from the Harbor registry, or a
legacy registry.json (--registry-url, --registry-path). scaleapi/swe-bench-pro@v2.0.0 is a git checkout
of its repository at that tag (--git-url for a mirror): its v2/ directory, every file its SHA256SUMS
lists checked, hard51_ids.txt among them; the tasks are then DIR/tasks and the HARD-51 ids
DIR/hard51_ids.txt. The tasks directory gets a dataset.toml naming the dataset (so `sprout prepare`
records its name and Harbor's digest) and sprout-dataset.json (the name, the ref, the source, the
commit a tag resolved to, the digest), which `prepare` records too.
"""

import argparse
from pathlib import Path

from ..console import console
from . import flags


def cmd_get(args: argparse.Namespace) -> int:
    from ..eval.datasets import get_dataset

    record = get_dataset(args.dataset, args.output, registry_url=args.registry_url, registry_path=args.registry_path,
                         git_url=args.git_url, overwrite=args.overwrite)
    at = f" ({record.revision[:12]})" if record.revision else ""
    checked = f"; {len(record.checked)} files checked against SHA256SUMS" if record.checked else ""
    console.print(f"{record.name}@{record.ref}{at}: {record.tasks} tasks in {record.tasks_dir}, digest "
                  f"{record.digest}{checked}", markup=False)
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("datasets", help="fetch a benchmark, pinned: Harbor's registry client or a git tag",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = group.add_subparsers(dest="datasets_command", required=True, metavar="COMMAND")
    s = commands.add_parser("get", help="fetch NAME@REF into a directory", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("dataset", metavar="NAME@REF", help="the dataset and its version or tag")
    flags.output(s, "the directory to write (it must be empty, unless --overwrite)")
    s.add_argument("--registry-url", metavar="URL", help="a legacy registry.json by URL (default: the Harbor registry)")
    s.add_argument("--registry-path", type=Path, metavar="FILE", help="a legacy registry.json on disk")
    s.add_argument("--git-url", metavar="URL", help="SWE-bench Pro's repository, or a mirror of it (default: "
                   "https://github.com/scaleapi/SWE-bench_Pro-os)")
    s.add_argument("--overwrite", action="store_true", help="replace what the directory holds")
    s.set_defaults(func=cmd_get)
