"""A Sprout sandbox as a Harbor 0.22 environment, so Harbor's own Verifier, OracleAgent and Trial run on it.

Harbor users select it by import path:
    harbor run -p TASK -a oracle -e sprout.tasks.harbor_env:SproutEnvironment --ek runtime_bin=runtime/sprout-runtime
(`--ek store_root=DIR` picks another store). Sprout's own runners use
`SproutEnvironment.for_task(task, paths, store=..., checkpoint=cp)` to work in a new branch of a
checkpoint, or `sandbox=sb` to wrap an existing sandbox, which it then never stops.

Differences from Harbor's Docker environment, by design:
- exec returns stdout and stderr merged in `stdout` (`stderr` is None), as the SDK captures them;
- commands run as the image's user unless `user=` (or the default user Harbor sets) names another;
- log directories are not bind mounts (capabilities.mounted is False): Harbor downloads them;
  other bind mounts, docker-compose, GPUs/TPUs and Windows are refused;
- network policies switch per phase on the live sandbox (dynamic_network_policy); a host allowlist is
  enforced as no network at all (sprout.tasks.network);
- `storage_mb` is not enforced (btrfs quotas stay off for fast snapshots).
Harbor's multi-step trials run on it (they only exec and transfer files); Sprout's own runners, which
grade one final checkpoint, refuse multi-step tasks (sprout.tasks.loading).
"""

import asyncio
import tempfile
import time
from pathlib import Path

from harbor.environments.base import BaseEnvironment
from harbor.environments.base import ExecResult as HarborExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import COMPOSE_FILE_NAME, require_agent_environment_definition
from harbor.models.task.config import NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import resolve_effective_verifier_env_config
from harbor.models.trial.config import ResourceMode
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths

from ..sandbox import Checkpoint, Image, Sandbox, SandboxStateError, SproutError, Store
from .cancellable import exec_async
from .errors import UnsupportedTaskError
from .images import ensure_image
from .network import network_plan, online
from .pull import PullPolicy


class CommandTimeoutError(RuntimeError):
    """exec's timeout_sec passed (Harbor's Docker environment raises a RuntimeError then too)."""


class SproutEnvironment(BaseEnvironment):
    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: TrialPaths,
                 task_env_config, *, store: Store | None = None, store_root: str | Path | None = None,
                 runtime_bin: str | Path | None = None, sandbox: Sandbox | None = None,
                 checkpoint: Checkpoint | None = None, pull: PullPolicy | None = None, image: Image | None = None,
                 **kwargs):
        """`store`/`store_root`/`runtime_bin` choose the store (default: $SPROUT_STORE, $SPROUT_RUNTIME_BIN).
        By default start() makes a sandbox from the task's image; with `checkpoint` it makes a branch
        of that checkpoint instead (both are destroyed by stop()); with `sandbox` it attaches to that
        running sandbox, which stays the caller's. `image`: the task's store image when the caller has it
        already (else it is pulled or built as `pull` says)."""
        self.store = store or Store(Path(store_root) if store_root else None,
                                    runtime_bin=Path(runtime_bin) if runtime_bin else None)
        self._sandbox = sandbox
        self._checkpoint = checkpoint
        self._owns_sandbox = sandbox is None
        self._pull, self._image = pull, image
        self._identity: tuple[int, int, str] | None = None  # uid, gid, name of the sandbox's user
        super().__init__(environment_dir=Path(environment_dir), environment_name=environment_name,
                         session_id=session_id, trial_paths=trial_paths, task_env_config=task_env_config,
                         **kwargs)

    @classmethod
    def for_task(cls, task: Task, trial_paths: TrialPaths, *, store: Store, sandbox: Sandbox | None = None,
                 checkpoint: Checkpoint | None = None, session_id: str | None = None, logger=None,
                 pull: PullPolicy | None = None, image: Image | None = None) -> "SproutEnvironment":
        """The agent's environment a Harbor Trial would make for `task`, for Sprout's own runners: on the
        [environment] network baseline, switchable to the agent's and (shared mode) verifier's phases."""
        plan = network_plan(task)
        phases = [plan.agent_phase] + ([plan.verifier_phase] if plan.verifier_env_baseline is None else [])
        return cls(environment_dir=task.paths.environment_dir, environment_name=task.short_name,
                   session_id=session_id or f"{task.short_name}__sprout", trial_paths=trial_paths,
                   task_env_config=task.config.environment.model_copy(deep=True), logger=logger,
                   network_policy=plan.agent_env_baseline, phase_network_policies=phases,
                   store=store, sandbox=sandbox, checkpoint=checkpoint, pull=pull, image=image)

    @classmethod
    def for_verifier(cls, task: Task, trial_paths: TrialPaths, *, store: Store, session_id: str, logger=None,
                     pull: PullPolicy | None = None) -> "SproutEnvironment":
        """A separate verifier's environment (environment_mode = "separate"): its image is built from
        tests/Dockerfile (context tests/) or is [verifier.environment].docker_image."""
        config = resolve_effective_verifier_env_config(task.config, None)
        if config is None:
            raise UnsupportedTaskError(f"task {task.short_name}: its verifier is not a separate environment")
        plan = network_plan(task)
        return cls(environment_dir=task.paths.tests_dir, environment_name=f"{task.short_name}-verifier",
                   session_id=session_id, trial_paths=trial_paths, task_env_config=config.model_copy(deep=True),
                   logger=logger, network_policy=plan.verifier_env_baseline, phase_network_policies=[plan.verifier_phase],
                   store=store, pull=pull)

    @staticmethod
    def type() -> str:
        return "sprout"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True, dynamic_network_policy=True)

    def validate_network_policy_support(self, network_policy: NetworkPolicy | None = None) -> None:
        """Every mode is accepted: an allowlist is enforced as no network at all (sprout.tasks.network)."""

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await asyncio.to_thread(self.sandbox.set_network, online(network_policy))

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True)

    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists():
            raise UnsupportedTaskError(f"task {self.environment_name}: docker-compose environments are not "
                                       "supported by Sprout sandboxes (one container per task)")
        logs = EnvironmentPaths.for_os(self.os)
        harbor_logs = {str(p) for p in (logs.agent_dir, logs.user_agent_dir, logs.verifier_dir, logs.artifacts_dir)}
        extra = [m.get("target") for m in self._mounts if m.get("target") not in harbor_logs]
        if extra:  # Harbor's own log mounts are downloaded instead (capabilities.mounted is False)
            raise UnsupportedTaskError(f"task {self.environment_name}: bind mounts ({', '.join(map(str, extra))}) "
                                       "are not supported by Sprout sandboxes")
        if self._sandbox is None and self._checkpoint is None:
            require_agent_environment_definition(self.environment_dir,
                                                 docker_image=self.task_env_config.docker_image)

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise SandboxStateError(f"environment {self.session_id} has no sandbox (start it first)")
        return self._sandbox

    def sandbox_options(self) -> dict:
        """create_sandbox() options from the task: memory_mb, cpus, network (on when any phase is), and
        [environment.env] in the container, so every phase sees it, the agent's commands too."""
        memory_mb = self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT)
        policies = [self._network_policy, *self._phase_network_policies]
        return {"memory": f"{memory_mb}m" if memory_mb else None,
                "cpus": self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT),
                "network": any(online(p) for p in policies), "label": self.session_id,
                "env": self._startup_env()}

    async def start(self, force_build: bool) -> None:
        if self.task_env_config.storage_mb and self._sandbox is None:
            self.logger.warning("storage_mb is not enforced by Sprout sandboxes")
        if self._sandbox is None and self._checkpoint is not None:
            self._sandbox = await asyncio.to_thread(self._checkpoint.branch, **self.sandbox_options())
        elif self._sandbox is None:
            image = self._image if self._image is not None and not force_build else (await asyncio.to_thread(
                ensure_image, self.store, self.environment_dir, self.task_env_config, name=self.environment_name,
                rebuild_before=time.time() if force_build else None, pull=self._pull)).image
            self._sandbox = await asyncio.to_thread(self.store.create_sandbox, image, **self.sandbox_options())
        elif not self._sandbox.running:
            raise SandboxStateError(f"sandbox {self._sandbox.id} is not running")
        await self._apply_network_policy(self._network_policy)  # the baseline, whatever phase it was left in
        paths = EnvironmentPaths.for_os(self.os)
        targets = {*self._mount_targets(writable_only=True),
                   *(str(p) for p in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir))}
        uid, gid, _ = await self._user()
        await self._transfer("ensure_dirs", sorted(targets), (uid, gid))
        if self._owns_sandbox and self._checkpoint is None:
            await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Destroys the sandbox it created (or, with delete=False, stops it and keeps its disk)."""
        if self._sandbox is None or not self._owns_sandbox:
            return
        sandbox = self._sandbox
        if delete:
            await asyncio.to_thread(sandbox.destroy)
            self._sandbox = None
        else:
            await asyncio.to_thread(sandbox.stop)
            self.logger.info(f"kept the disk of sandbox {sandbox.id} (sprout sandbox start {sandbox.id})")

    async def _user(self) -> tuple[int, int, str]:
        if self._identity is None:
            result = await exec_async(self.sandbox, "id -u; id -g; id -un 2>/dev/null || id -u", timeout=30)
            uid, gid, name = result.output.split()[:3]
            self._identity = int(uid), int(gid), name
        return self._identity

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> HarborExecResult:
        result = await exec_async(self.sandbox, command, cwd=cwd or self.task_env_config.workdir,
                                  env=self._merge_env(env), timeout=timeout_sec or None, user=self._resolve_user(user))
        if result.timed_out:
            raise CommandTimeoutError(f"Command timed out after {timeout_sec} seconds")
        callback = self._output_callback()
        if callback is not None and result.output:
            await callback(result.output, "stdout")
        return HarborExecResult(stdout=result.output, stderr=None, return_code=result.exit_code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        uid, gid, _ = await self._user()
        await self._transfer("upload_file", Path(source_path), target_path, (uid, gid))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        uid, gid, _ = await self._user()
        await self._transfer("upload_dir", Path(source_dir), target_dir, (uid, gid))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._transfer("download_file", source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._transfer("download_dir", source_dir, Path(target_dir))

    async def _transfer(self, operation: str, *args: object) -> None:
        """One operation of the sandbox's files (sprout.sandbox.files), off the event loop."""
        def run() -> None:
            with self.sandbox.files() as files:
                getattr(files, operation)(*args)

        await asyncio.to_thread(run)


def start_task_sandbox(store: Store, task: Task, label: str, *, image: Image | None = None,
                       pull: PullPolicy | None = None) -> Sandbox:
    """A sandbox of the task's image started as Harbor starts the agent's environment: the task's
    limits, log directories, the environment upload and the healthcheck, then switched to the agent
    phase's network. Without `image`, the task's image is pulled or built first when this store lacks it."""
    with tempfile.TemporaryDirectory(prefix="sprout-attempt-") as tmp:
        env = SproutEnvironment.for_task(task, TrialPaths(Path(tmp)), store=store, pull=pull, image=image,
                                         session_id=f"{task.short_name}__attempt-{label}")

        async def start() -> None:
            try:
                await env.start(force_build=False)
                await env.run_healthcheck()
                await env.set_network_policy(network_plan(task).agent_phase)
            except BaseException:
                await env.stop(delete=True)
                raise

        try:
            asyncio.run(start())
        except SproutError:
            raise
        except Exception as e:  # e.g. Harbor's HealthcheckError
            raise SproutError(f"task {task.short_name}: its sandbox did not start: {type(e).__name__}: {e}") from None
        return env.sandbox
