"""Checkpoint diffs on real sandboxes: what an agent's commands changed between two checkpoints, found by
btrfs send and by a walk of both trees (which must agree), shown by `sprout checkpoint diff`; links and
special files the agent planted are reported, never followed or opened by the host."""

import json
import subprocess
import sys

import pytest

from sprout.sandbox import CheckpointNotFound, Store, StoreError
from sprout.sandbox.diff import CheckpointDiff
from tests.conftest import PYTHON_IMAGE, REPO, removing_what_is_made

BEFORE = """set -e
mkdir -p /work/keep /work/gone/deep /work/cfg
printf 'alpha\\nbeta\\ngamma\\n' > /work/notes.txt
echo same > /work/touched.txt
echo run > /work/run.sh && chmod 644 /work/run.sh
echo mine > /work/owned && echo x > /work/gone/deep/y && echo c > /work/cfg/settings
ln -s /work/notes.txt /work/link
echo will-be-dir > /work/shape
head -c 4096 /dev/urandom > /work/blob.bin
"""
AFTER = r"""set -e
printf 'alpha\nBETA\ngamma\n' > /work/notes.txt
touch -d '2001-01-01' /work/touched.txt
chmod 755 /work/run.sh
chown 1234:1234 /work/owned
rm -r /work/gone
ln -sfn /etc/passwd /work/link
rm /work/shape && mkdir /work/shape && echo inside > /work/shape/file
head -c 4096 /dev/urandom > /work/blob.bin
echo new > /work/keep/new.txt
printf 'n' > "/work/keep/line
break"
rm -r /work/cfg && ln -s / /work/cfg
ln -s /etc/shadow /work/leak
mkfifo /work/pipe
"""
EXPECTED = [
    "M /work/blob.bin (content)", "M /work/cfg (type)", "D /work/cfg/settings", "D /work/gone", "D /work/gone/deep",
    "D /work/gone/deep/y", "A /work/keep/line\\nbreak", "A /work/keep/new.txt", "A /work/leak",
    "M /work/link (target)", "M /work/notes.txt (content)", "M /work/owned (owner)", "A /work/pipe",
    "M /work/run.sh (mode)", "M /work/shape (type)", "A /work/shape/file",
]


@pytest.fixture(scope="module")
def two_checkpoints(base_store):
    with removing_what_is_made(base_store) as store:
        sandbox = store.create_sandbox(PYTHON_IMAGE, network=False)
        assert sandbox.exec(BEFORE).exit_code == 0
        before = sandbox.checkpoint(label="before")
        result = sandbox.exec(AFTER)
        assert result.exit_code == 0, result.output
        after = sandbox.checkpoint(label="after")
        yield store, before, after


def sprout(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sprout", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_every_kind_of_change_is_found_by_btrfs_and_by_a_walk_alike(two_checkpoints):
    store, before, after = two_checkpoints
    diff = store.diff(before.id, after.id)
    assert diff.method == "btrfs-send" and [c.line() for c in diff.changes] == EXPECTED
    walked = store.diff(before.id, after.id, walk=True)
    assert walked.method == "walk" and walked.changes == diff.changes
    changes = {c.path: c for c in diff.changes}
    assert changes["/work/notes.txt"].diff == ("--- a/work/notes.txt\n+++ b/work/notes.txt\n@@ -1,3 +1,3 @@\n"
                                               " alpha\n-beta\n+BETA\n gamma\n")
    assert changes["/work/blob.bin"].binary and changes["/work/blob.bin"].diff is None
    assert changes["/work/keep/new.txt"].diff == "--- /dev/null\n+++ b/work/keep/new.txt\n@@ -0,0 +1 @@\n+new\n"
    link = changes["/work/link"]
    assert (link.before.target, link.after.target) == ("/work/notes.txt", "/etc/passwd")
    assert (changes["/work/run.sh"].before.mode, changes["/work/run.sh"].after.mode) == ("0644", "0755")
    assert changes["/work/owned"].after.owner == "1234:1234"
    assert (changes["/work/shape"].before.kind, changes["/work/shape"].after.kind) == ("file", "dir")
    assert changes["/work/pipe"].after.kind == "fifo" and changes["/work/pipe"].diff is None
    assert "/work/touched.txt" not in changes  # only its time changed


def test_links_the_agent_planted_are_never_followed_by_the_host(two_checkpoints):
    store, before, after = two_checkpoints
    changes = {c.path: c for c in store.diff(before.id, after.id).changes}
    leak = changes["/work/leak"]
    assert leak.after.kind == "symlink" and leak.after.target == "/etc/shadow" and leak.diff is None
    # /work/cfg is now a link to /: nothing below it is read, in the checkpoint or on the host
    assert not [path for path in changes if path.startswith("/work/cfg/") and path != "/work/cfg/settings"]
    assert changes["/work/cfg"].after.target == "/" and "root:" not in json.dumps(
        [c.model_dump() for c in changes.values()])


def test_a_summary_counts_and_names_the_changes(two_checkpoints):
    store, before, after = two_checkpoints
    summary = store.diff(before.id, after.id, content=False).summary()
    assert (summary.added, summary.changed, summary.removed, summary.since) == (5, 7, 4, before.id)
    assert summary.paths == EXPECTED and summary.more == 0
    assert summary.line().startswith("5 added, 7 changed, 4 removed: M /work/blob.bin (content); ")
    assert store.diff(after.id, after.id).changes == []
    backwards = {c.path: c.change for c in store.diff(after.id, before.id).changes}
    assert backwards["/work/gone/deep/y"] == "added" and backwards["/work/keep/new.txt"] == "removed"


def test_the_command_lists_patches_and_json(two_checkpoints):
    store, before, after = two_checkpoints
    listed = sprout("checkpoint", "diff", before.id, after.id, "--store", str(store.root))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith(f"{before.id} -> {after.id}: 5 added, 7 changed, 4 removed (btrfs send, ")
    assert [line.split()[:2] for line in lines[1:]] == [entry.split()[:2] for entry in EXPECTED]
    assert "  M  /work/run.sh" in listed.stdout and "mode 0644 -> 0755" in listed.stdout
    patch = sprout("checkpoint", "diff", before.id, after.id, "--store", str(store.root), "--patch")
    assert "-beta\n+BETA\n" in patch.stdout and "Binary file /work/blob.bin differs" in patch.stdout
    as_json = sprout("checkpoint", "diff", before.id, after.id, "--store", str(store.root), "--json")
    parsed = CheckpointDiff.model_validate_json(as_json.stdout)
    assert [c.line() for c in parsed.changes] == EXPECTED


def test_what_cannot_be_diffed_is_one_clear_error(two_checkpoints, tmp_path):
    store, before, after = two_checkpoints
    missing = sprout("checkpoint", "diff", before.id, "ck-000000000000", "--store", str(store.root))
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"error: no checkpoint 'ck-000000000000' in the store at {store.root}"]
    with pytest.raises(CheckpointNotFound):
        store.diff("ck-000000000000", after.id)
    with removing_what_is_made(Store(store.root)) as other:
        foreign = other.create_sandbox("docker.io/library/debian:bookworm", network=False)
        checkpoint = foreign.checkpoint()
        with pytest.raises(StoreError, match="not of one lineage"):
            store.diff(before.id, checkpoint.id)
    usage = sprout("checkpoint", "diff", before.id)
    assert usage.returncode == 2 and "TARGET" in usage.stderr


def test_against_the_image_only_the_commands_work_shows(two_checkpoints):
    """What podman's start puts in the rootfs (mount points, its init) is no command's work; a symlink's
    target is not a path of the tree (btrfs send names it beside the link)."""
    store, before, _ = two_checkpoints
    diff = store.diff(before.image_key, before.id)
    assert [c.line() for c in diff.changes] == [f"A /work{rel}" for rel in (
        "", "/blob.bin", "/cfg", "/cfg/settings", "/gone", "/gone/deep", "/gone/deep/y", "/keep", "/link",
        "/notes.txt", "/owned", "/run.sh", "/shape", "/touched.txt")]
    assert diff.summary().since == before.image_key
