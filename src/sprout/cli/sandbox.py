"""`sprout sandbox`: images, sandboxes and checkpoints from the shell (the SDK's own objects)."""

import argparse
import time
from datetime import datetime
from typing import TYPE_CHECKING

from rich.table import Table

from ..console import console, human_bytes
from ..errors import UsageError
from ..sandbox.diff import TEXT_CAP, FileChange
from . import flags

if TYPE_CHECKING:
    from ..sandbox import Store


def _store(args: argparse.Namespace, **options) -> "Store":
    """The store the command names (imported here: building the parser imports none of the library)."""
    from ..sandbox import Store

    return Store(args.store, runtime_bin=args.runtime_bin, **options)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def cmd_images(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.action == "bootstrap":
        from ..sandbox import images

        started = time.monotonic()
        stand_ins = 0
        for recipe in images.RECIPES:
            done = images.bootstrap(recipe, store.root / "cache" / "bootstrap", log=console.print)
            image = store.import_image(recipe.tags[0])
            stand_ins += len(done.stand_ins)
            console.print(f"ok   {recipe.tags[0]} -> {image.key}: {len(done.pulled)} pulled, {len(done.kept)} kept, "
                          f"{len(done.stand_ins)} stand-ins", markup=False)
        note = f"; {stand_ins} names are offline stand-ins (run this again where a registry is reachable)" \
            if stand_ins else ""
        console.print(f"base images ready in {time.monotonic() - started:.1f}s{note}", markup=False)
        return 0
    if args.action == "import":
        if not args.name:
            raise UsageError("images import needs an image NAME")
        image = store.import_image(args.name)
        console.print(f"{image.key}  {', '.join(image.names)}")
        return 0
    table = Table("key", "image id", "names", "workdir", "user")
    for image in store.images():
        table.add_row(image.key, image.image_id[:12], "\n".join(image.names), image.config.workdir,
                      image.config.user or "(root)")
    console.print(table)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    sandbox = _store(args, backend=args.backend).create_sandbox(
        args.image, memory=args.memory, pids=args.pids, cpus=args.cpus, network=args.network, label=args.label,
        host_trust=False if args.no_host_trust else None)
    console.print(sandbox.id)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command and args.command[0] == "--" else args.command
    if not command:
        raise UsageError("exec needs a COMMAND after the sandbox id")
    env = dict(item.partition("=")[::2] for item in args.env)
    result = _store(args).sandbox(args.sandbox).exec(" ".join(command) if len(command) == 1 else command,
                                                     cwd=args.cwd, env=env, timeout=args.timeout)
    console.out(result.output, end="")
    return result.exit_code


def cmd_checkpoint(args: argparse.Namespace) -> int:
    checkpoint = _store(args).sandbox(args.sandbox).checkpoint(label=args.label, memory=args.memory)
    console.print(f"{checkpoint.id}  ({checkpoint.duration_ms:.1f} ms)")
    return 0


def cmd_branch(args: argparse.Namespace) -> int:
    console.print(_store(args).checkpoint(args.checkpoint).branch(label=args.label).id)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.what in ("sandboxes", "all"):
        table = Table("sandbox", "state", "image", "from checkpoint", "last checkpoint", "created", "label",
                      title="sandboxes")
        for sb in store.sandboxes():
            table.add_row(sb.id, sb.state, sb.image_key, sb.base_checkpoint or "-", sb.last_checkpoint or "-",
                          _when(sb.created), sb.label or "")
        console.print(table)
    if args.what in ("checkpoints", "all"):
        table = Table("checkpoint", "sandbox", "parent", "label", "created", "ms", "exclusive", "exists",
                      title="checkpoints")
        for cp in store.checkpoints(args.sandbox):
            size = store.size_of(cp) if args.sizes else None
            table.add_row(cp.id, cp.sandbox_id, cp.parent or "-", cp.label or "", _when(cp.created),
                          f"{cp.duration_ms:.1f}" if cp.duration_ms else "-",
                          human_bytes(size) if args.sizes else "-", "yes" if cp.exists else "[red]MISSING[/red]")
        console.print(table)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.id.startswith("ck-"):
        cp = store.checkpoint(args.id)
        console.print_json(data={"id": cp.id, "sandbox": cp.sandbox_id, "image": cp.image_key,
                                 "parent": cp.parent, "label": cp.label, "created": _when(cp.created),
                                 "duration_ms": cp.duration_ms, "path": str(cp.path), "exists": cp.exists,
                                 "exclusive_bytes": store.size_of(cp),
                                 "branches": [b.id for b in store.branches_of(cp.id)]})
        return 0
    sb = store.sandbox(args.id)
    console.print_json(data={"id": sb.id, "backend": sb.backend, "state": sb.state, "image": sb.image_key,
                             "container": sb.container, "base_checkpoint": sb.base_checkpoint,
                             "last_checkpoint": sb.last_checkpoint, "limits": sb.limits,
                             "path": str(sb.path), "exec_profile": str(sb.profile_path),
                             "checkpoints": [c.id for c in store.checkpoints(sb.id)]})
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _store(args)
    for item in args.ids:
        if item.startswith("ck-"):
            store.remove_checkpoint(item, force=args.force)
        else:
            store.remove_sandbox(item, force=args.force)
        console.print(f"removed {item}")
    return 0


def cmd_start_stop(args: argparse.Namespace) -> int:
    sandbox = _store(args).sandbox(args.sandbox)
    sandbox.start() if args.sandbox_command == "start" else sandbox.stop()
    console.print(f"{sandbox.id} {sandbox.state}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    removed = _store(args).gc(older_than_s=args.older_than, dry_run=args.dry_run)
    for line in removed:
        console.print(("would remove " if args.dry_run else "removed ") + line)
    console.print(f"{len(removed)} item(s){' (dry run)' if args.dry_run else ''}")
    return 0


def _change_detail(change: FileChange) -> str:
    before, after = change.before, change.after
    if change.change != "changed" or before is None or after is None:
        node = after or before
        return f"{node.kind} {node.mode} {human_bytes(node.size)}" if node else ""
    parts = {"type": f"type {before.kind} -> {after.kind}", "mode": f"mode {before.mode} -> {after.mode}",
             "owner": f"owner {before.owner} -> {after.owner}", "target": f"target {before.target} -> {after.target}",
             "content": f"content {human_bytes(before.size)} -> {human_bytes(after.size)}"}
    return "; ".join(parts[what] for what in change.what)


def cmd_checkpoint_diff(args: argparse.Namespace) -> int:
    diff = _store(args).diff(args.base, args.target, content=args.patch or args.json, walk=args.walk)
    if args.json:
        console.out(diff.model_dump_json(indent=2), highlight=False)
        return 0
    how = "btrfs send" if diff.method == "btrfs-send" else "a walk of both trees"
    console.out(f"{diff.base} -> {diff.target}: {diff.summary().counts()} ({how}, "
                f"{diff.elapsed_ms:.1f} ms)", highlight=False)
    width = max((len(c.path) for c in diff.changes), default=0)
    for change in diff.changes:  # paths are the agent's: printed as they are, never as markup
        console.out(f"  {change.line()[0]}  {change.path:<{width}}  {_change_detail(change)}", highlight=False)
    for change in diff.changes if args.patch else []:
        if change.diff:
            console.out(change.diff, end="", highlight=False)
        elif change.binary:
            console.out(f"Binary file {change.path} differs\n", end="", highlight=False)
    return 0


def add_checkpoint(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("checkpoint", help="what changed between checkpoints", description=(
        "Checkpoints of a sandbox's lineage (`sprout sandbox checkpoint` makes one)."))
    commands = group.add_subparsers(dest="checkpoint_command", required=True, metavar="COMMAND")
    text = ("files added (A), changed (M) and removed (D) from BASE to TARGET: type, mode, owner, symlink target "
            "and content, found by an incremental btrfs send (a walk of both trees where that is not allowed; a "
            "microVM's disks are walked by guests booted on them, some seconds)")
    s = commands.add_parser("diff", help="files added, changed and removed between two checkpoints",
                            description=text)
    flags.add(s, "store", "runtime_bin")
    s.add_argument("base", metavar="BASE", help="a checkpoint (ck-...), or the image key (im-...) its lineage began from")
    s.add_argument("target", metavar="TARGET", help="a checkpoint of the same lineage (ck-...)")
    s.add_argument("-p", "--patch", action="store_true",
                   help=f"also a unified diff of each text file up to {TEXT_CAP >> 10} KiB (larger or binary "
                        "files: a line saying they differ)")
    s.add_argument("--json", action="store_true", help="the whole diff, with the unified diffs, as JSON")
    s.add_argument("--walk", action="store_true", help="find the changes by walking both trees, not by btrfs send")
    s.set_defaults(func=cmd_checkpoint_diff)


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("sandbox", help="images, sandboxes, checkpoints and branches", description=(
        "Sprout sandboxes: images are read-only btrfs subvolumes, a sandbox is a writable snapshot run by its "
        "backend, a checkpoint is a read-only snapshot of a sandbox, a branch is a new sandbox from one."))
    commands = group.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND")

    def command(name: str, text: str, func) -> argparse.ArgumentParser:
        s = commands.add_parser(name, help=text, description=text)
        flags.add(s, "store", "runtime_bin")
        s.set_defaults(func=func)
        return s

    s = command("images", "list images; `bootstrap` the offline base images; `import NAME` from podman", cmd_images)
    s.add_argument("action", nargs="?", choices=["ls", "bootstrap", "import"], default="ls")
    s.add_argument("name", nargs="?", help="the podman image to import")
    s = command("create", "create and start a sandbox from an image", cmd_create)
    s.add_argument("image", help="a store key or a podman image name (imported when missing)")
    s.add_argument("--memory", help="memory limit, e.g. 2g (default 4g)")
    s.add_argument("--pids", type=int, help="process limit (default 4096)")
    s.add_argument("--cpus", type=float, help="CPU limit")
    network = s.add_mutually_exclusive_group()
    network.add_argument("--network", action="store_true", default=None,
                         help="on podman's network (the default for a container; a microVM has none unless asked)")
    network.add_argument("--no-network", dest="network", action="store_false", help="only loopback")
    s.add_argument("--no-host-trust", action="store_true",
                   help="neither the host's CA bundle nor its proxy variables (default: $SPROUT_HOST_TRUST)")
    s.add_argument("--label", help="a name to find it by")
    flags.add(s, "backend")
    s = command("exec", "run a command in a sandbox; the exit status is the command's", cmd_exec)
    s.add_argument("sandbox")
    s.add_argument("--cwd", help="directory inside the sandbox (default: the image's WORKDIR)")
    s.add_argument("--env", action="append", default=[], metavar="K=V", help="a variable for the command (repeatable)")
    s.add_argument("--timeout", type=float, metavar="SECONDS", help="on timeout the whole process tree is killed")
    s.add_argument("command", nargs=argparse.REMAINDER, help="a shell string, or -- ARGV...")
    s = command("checkpoint", "a read-only snapshot of a sandbox", cmd_checkpoint)
    s.add_argument("sandbox")
    s.add_argument("--label", help="a name to find it by")
    s.add_argument("--memory", action="store_true",
                   help="microVMs: save the memory too, so branches resume its running processes")
    s = command("branch", "a new running sandbox from a checkpoint", cmd_branch)
    s.add_argument("checkpoint")
    s.add_argument("--label", help="a name to find it by")
    s = command("ls", "list sandboxes and checkpoints", cmd_ls)
    s.add_argument("what", nargs="?", choices=["all", "sandboxes", "checkpoints"], default="all")
    s.add_argument("--sandbox", help="only this sandbox's checkpoints")
    s.add_argument("--sizes", action="store_true", help="measure each checkpoint's exclusive size (slower)")
    s = command("inspect", "details of a sandbox (sb-...) or a checkpoint (ck-...), as JSON", cmd_inspect)
    s.add_argument("id")
    s = command("rm", "delete sandboxes or checkpoints", cmd_rm)
    s.add_argument("ids", nargs="+", metavar="ID")
    s.add_argument("--force", action="store_true",
                   help="stop a running sandbox first / delete a checkpoint that has live branches")
    for name, text in (("start", "restart a stopped sandbox on its subvolume"),
                       ("stop", "stop a sandbox, keep its disk")):
        command(name, text, cmd_start_stop).add_argument("sandbox")
    s = command("gc", "remove what nothing references", cmd_gc)
    s.add_argument("--older-than", type=float, metavar="SECONDS",
                   help="also remove checkpoints older than this with no branch or child, and unused images")
    s.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
