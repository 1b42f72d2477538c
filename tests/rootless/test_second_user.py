"""A second user beside the first (issue 29): .ci/rootless sets up two throwaway users and runs these as
the second while the first runs its rootless tests. Each has its own store, podman and user namespace:
the second cannot read the first's store (the set-up makes it private), and its sandboxes, checkpoints,
branches and `gc` see and touch only its own while the first's run.

    SPROUT_CI_FIRST_USER=NAME SPROUT_CI_FIRST_STORE=PATH .venv/bin/python -m pytest -m second_user
"""

import json
import os
import pwd
import subprocess
import time
from pathlib import Path

import pytest

from sprout import rootless
from sprout.sandbox import Store
from sprout.sandbox.podman import command as podman_command
from sprout.sandbox.store import STORE_LABEL
from tests.conftest import DEBIAN_IMAGE, removing_what_is_made

pytestmark = pytest.mark.second_user
BESIDE_S = float(os.environ.get("SPROUT_CI_BESIDE_S", "60"))  # how long to work beside the first user


@pytest.fixture(autouse=True)
def _second_user() -> None:
    assert rootless.entered(), "run these as a second user without root (.ci/rootless does)"
    assert os.environ["SPROUT_CI_FIRST_USER"] != pwd.getpwuid(rootless.user_id()).pw_name, "run as another user"


def test_the_first_users_store_and_its_loop_file_are_closed_to_this_user():
    store = Path(os.environ["SPROUT_CI_FIRST_STORE"])
    assert store.is_dir() and Path(f"{store}.img").is_file()  # there, and this user can tell
    with pytest.raises(PermissionError):
        os.listdir(store)
    with pytest.raises(PermissionError):
        open(f"{store}.img", "rb").close()


def test_sandboxes_checkpoints_branches_and_gc_beside_the_first_user(base_store: Store):
    with removing_what_is_made(base_store) as store:
        mine_before = {s.id for s in store.sandboxes()}
        deadline, rounds = time.monotonic() + BESIDE_S, 0
        while rounds < 3 or time.monotonic() < deadline:
            sandbox = store.create_sandbox(DEBIAN_IMAGE)
            sandbox.exec(f"echo {rounds} > /root/n")
            checkpoint = sandbox.checkpoint()
            branch = checkpoint.branch()
            assert branch.exec("cat /root/n").output.strip() == str(rounds)
            assert {s.id for s in store.sandboxes()} == mine_before | {sandbox.id, branch.id}
            assert store.gc() == []  # nothing here is an orphan, and nothing of the first user's is seen
            listed = subprocess.run([*podman_command(), "ps", "--all", "--format", "json"], capture_output=True,
                                    text=True, check=True)
            stores = {labels[STORE_LABEL] for c in json.loads(listed.stdout or "[]")
                      if STORE_LABEL in (labels := c.get("Labels") or {})}  # not the network keeper: no store's
            assert stores <= {str(store.root)}, stores  # this user's podman holds this user's sandboxes only
            branch.destroy()
            sandbox.destroy()
            store.remove_checkpoint(checkpoint.id, force=True)
            rounds += 1
