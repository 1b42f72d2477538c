"""A container's seccomp filter compiled from runc's own record of it, with libseccomp as runc compiles it.

As root the runtime loads the filter read off the container's init (sprout.sandbox.confinement), byte for
byte. A rootless user cannot read it (PTRACE_SECCOMP_GET_FILTER needs CAP_SYS_ADMIN in the initial
namespace), but runc's state (`state.json`, which the user owns) keeps the configuration runc compiled
it from. This module turns that configuration into the BPF program runc loaded, making the same libseccomp
calls in the same order (runc links the same libseccomp): the default action, the architectures, then
one rule per syscall entry, skipping names this libseccomp does not know and rules that repeat the
default action, and splitting a rule whose conditions test one argument twice into one rule each.

runc puts a stub before that program which answers ENOSYS for syscalls newer than any the configuration
names. Where the default action is that same answer (podman's default profile), the stub changes no
verdict, so the program alone filters exactly as runc's does; `reproduce` compiles only such filters.
"""

import ctypes
import ctypes.util
import errno
import os
import tempfile
from collections.abc import Sequence
from functools import cache

from .errors import SandboxStateError

# libcontainer's enums (configs.Action, configs.Operator) -> libseccomp's values (SCMP_ACT_*, SCMP_CMP_*):
# Kill, Errno, Trap, Allow, Trace, Log, (Notify: not compiled), KillThread, KillProcess
_ACTIONS = {1: 0x00000000, 2: 0x00050000, 3: 0x00030000, 4: 0x7FFF0000, 5: 0x7FF00000, 6: 0x7FFC0000,
            8: 0x00000000, 9: 0x80000000}
_WITH_ERRNO = {2, 5}  # their value carries an errno (EPERM when the configuration gives none)
_CMP = {1: 4, 2: 1, 3: 6, 4: 5, 5: 2, 6: 3, 7: 7}  # EqualTo..MaskEqualTo -> EQ, NE, GT, GE, LT, LE, MASKED_EQ
_ARCHES = {"amd64": "x86_64", "x86": "x86", "x32": "x32", "arm64": "aarch64", "arm": "arm", "ppc64le": "ppc64le",
           "s390x": "s390x", "riscv64": "riscv64", "mips64": "mips64", "mips64el": "mipsel64"}


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@cache
def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise SandboxStateError("libseccomp is not installed (it comes with runc): cannot compile the sandbox's "
                                "seccomp filter")
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(action: int, errno_ret: int | None) -> int:
    if action not in _ACTIONS:
        raise SandboxStateError(f"the sandbox's seccomp configuration has an action Sprout cannot compile ({action})")
    return _ACTIONS[action] | (((errno.EPERM if errno_ret is None else errno_ret) & 0xFFFF) if action in _WITH_ERRNO else 0)


def _check(result: int, doing: str) -> None:
    if result < 0:
        raise SandboxStateError(f"libseccomp could not {doing}: {os.strerror(-result)}")


def compile_filter(config: dict) -> bytes:
    """The BPF program (struct sock_filter entries) runc compiled from `config`, runc's state's
    `config.seccomp`."""
    lib = _libseccomp()
    default = _action(config["default_action"], config.get("default_errno_ret"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise SandboxStateError("libseccomp could not start a filter")
    try:
        for arch in config.get("architectures") or []:
            token = lib.seccomp_arch_resolve_name(_ARCHES.get(arch, arch).encode())
            if token == 0:
                raise SandboxStateError(f"libseccomp does not know the architecture {arch}")
            result = lib.seccomp_arch_add(ctx, token)
            if result != -errno.EEXIST:  # the native one is there already
                _check(result, f"add the architecture {arch}")
        for call in config.get("syscalls") or []:
            _add_rule(lib, ctx, call, default)
        with tempfile.TemporaryFile() as out:
            _check(lib.seccomp_export_bpf(ctx, out.fileno()), "export the filter")
            out.seek(0)
            return out.read()
    finally:
        lib.seccomp_release(ctx)


def _add_rule(lib: ctypes.CDLL, ctx: int, call: dict, default: int) -> None:
    action = _action(call["action"], call.get("errnoRet"))
    number = lib.seccomp_syscall_resolve_name(call["name"].encode())
    if number == -1 or action == default:  # unknown to this libseccomp (runc skips it too), or the default
        return
    conditions = [_ArgCmp(arg["index"], _CMP[arg["op"]], arg["value"], arg.get("value_two", 0))
                  for arg in call.get("args") or []]
    indexes = [c.arg for c in conditions]
    groups: Sequence[list[_ArgCmp]] = ([[c] for c in conditions] if len(set(indexes)) < len(indexes)
                                       else [conditions])
    for group in groups:
        array = (_ArgCmp * len(group))(*group)
        _check(lib.seccomp_rule_add_array(ctx, action, number, len(group), array),
               f"add the rule for {call['name']}")


def reproduce(config: dict | None) -> bytes | None:
    """The filter runc loaded from `config` (runc's state's `config.seccomp`), None when this module
    cannot reproduce it exactly: a default action other than ENOSYS (runc's stub would then differ)."""
    if config is None or config["default_action"] != 2 or config.get("default_errno_ret") != errno.ENOSYS:
        return None
    return compile_filter(config)
