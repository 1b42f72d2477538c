"""Copying files into and out of sandboxes of both backends (Sandbox.files, sprout.sandbox.files): a
container's through its rootfs on the host, a microVM's through its guest agent, with the same results and
refusals."""

import hashlib
import os
import time
from pathlib import Path

import pytest

from sprout.sandbox import Sandbox, Store, TransferError
from tests.conftest import PYTHON_IMAGE

OWNER = (1234, 2345)
backends = pytest.mark.parametrize("store", ["runtime", "microvm"], indirect=True)


class Files:
    """The sandbox's files, each call in a transfer of its own (Sandbox.files())."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def __getattr__(self, operation: str):
        def call(*args):
            with self.sandbox.files() as files:
                return getattr(files, operation)(*args)

        return call


def sandbox_of(store: Store) -> Sandbox:
    return store.create_sandbox(PYTHON_IMAGE, memory="512m")


def local_tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "bin" / "run.sh").chmod(0o755)
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(os.urandom(5 << 20))  # more than one 4 MiB request
    (root / "data" / "empty").write_bytes(b"")
    (root / "link").symlink_to("data/big.bin")
    return root


@backends
def test_uploads_and_downloads_give_the_same_files_owners_and_modes(store, tmp_path):
    tree = local_tree(tmp_path / "tree")
    sandbox = sandbox_of(store)
    Files(sandbox).ensure_dirs(["/logs/verifier"], OWNER)
    Files(sandbox).upload_dir(tree, "/opt/up", OWNER)
    Files(sandbox).upload_file(tree / "bin" / "run.sh", "/logs/verifier", OWNER)  # a directory: inside it

    stat = sandbox.exec("stat -c '%n %a %u %g' /logs/verifier /opt/up/bin/run.sh /opt/up/data/empty "
                        "/logs/verifier/run.sh; readlink /opt/up/link; /opt/up/bin/run.sh; "
                        "sha256sum < /opt/up/data/big.bin", user="0")
    assert stat.exit_code == 0, stat.output
    big_sha = hashlib.sha256((tree / "data" / "big.bin").read_bytes()).hexdigest()
    assert stat.output.splitlines() == [
        "/logs/verifier 777 1234 2345", "/opt/up/bin/run.sh 755 1234 2345", "/opt/up/data/empty 644 1234 2345",
        "/logs/verifier/run.sh 755 1234 2345", "data/big.bin", "ran", f"{big_sha}  -"]

    out = tmp_path / "out"
    Files(sandbox).download_dir("/opt/up", out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "bin", "bin/run.sh", "data", "data/big.bin", "data/empty", "link"]
    assert not (out / "link").is_symlink()  # the host gets the file a link points to
    assert (out / "link").read_bytes() == (tree / "data" / "big.bin").read_bytes()
    Files(sandbox).download_file("/opt/up/bin/run.sh", tmp_path)
    assert (tmp_path / "run.sh").read_text() == "#!/bin/sh\necho ran\n"
    assert Files(sandbox).read_file("/opt/up/data/empty", 10) == b""
    assert Files(sandbox).read_file("/opt/up/absent", 10) is None
    with pytest.raises(TransferError, match="larger than 10 bytes"):
        Files(sandbox).read_file("/opt/up/bin/run.sh", 10)


@backends
def test_what_the_sandbox_plants_neither_leaks_the_host_nor_blocks_the_copy(store, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    sandbox = sandbox_of(store)
    planted = sandbox.exec(f"mkdir -p /logs/sub && echo 1 > /logs/reward.txt && mkfifo /logs/fifo && "
                           f"ln -s {secret} /logs/leak && ln -s /etc /logs/dir-link && "
                           f"ln -s /logs/reward.txt /logs/sub/inside && ln -s {secret} /logs/written && "
                           f"ln -s /logs/reward.txt /logs/through", user="0")
    assert planted.exit_code == 0, planted.output

    out = tmp_path / "out"
    started = time.monotonic()
    Files(sandbox).download_dir("/logs", out)
    assert time.monotonic() - started < 10
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["reward.txt", "sub", "sub/inside", "through"]
    assert (out / "sub" / "inside").read_text() == "1\n"
    (tmp_path / "got").write_text("kept\n")
    for name in ("fifo", "leak", "dir-link", "absent"):
        with pytest.raises(TransferError):
            Files(sandbox).download_file(f"/logs/{name}", tmp_path / "got")
    assert (tmp_path / "got").read_text() == "kept\n"  # a refused copy leaves the target as it was
    with pytest.raises(TransferError, match="not a directory"):
        Files(sandbox).download_dir("/logs/reward.txt", out)

    local = tmp_path / "payload"
    local.write_text("from the host\n")
    with pytest.raises(TransferError, match="cannot write"):  # a link is followed inside the sandbox only
        Files(sandbox).upload_file(local, "/logs/written", OWNER)
    assert secret.read_text() == "host only\n"
    Files(sandbox).upload_file(local, "/logs/through", OWNER)
    assert sandbox.exec("cat /logs/reward.txt").output == "from the host\n"
    with pytest.raises(TransferError):
        Files(sandbox).ensure_dirs(["/logs/reward.txt/below"], OWNER)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "inside").write_text("over a link\n")
    with pytest.raises(TransferError):  # a directory's upload does not write through a link in the target
        Files(sandbox).upload_dir(tree, "/logs", OWNER)
    assert sandbox.exec("cat /logs/reward.txt").output == "from the host\n"


@backends
def test_a_link_to_a_directory_downloads_as_that_directory(store, tmp_path):
    sandbox = sandbox_of(store)
    made = sandbox.exec("mkdir -p /data/real && echo a > /data/real/a && ln -s /data/real /data/link", user="0")
    assert made.exit_code == 0, made.output
    Files(sandbox).download_dir("/data/link", tmp_path / "out")
    assert [(p.name, p.read_text()) for p in (tmp_path / "out").iterdir()] == [("a", "a\n")]
