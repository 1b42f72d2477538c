"""Sprout's settings: every `SPROUT_*` environment variable it reads, in one model.

`settings()` reads the environment when it is called (never when a module is imported), so a variable
set by a test, a service or a shell before a call is what that call sees. A value that cannot be read
(a word where a number goes) is one SproutError naming the variable. docs/configuration.md is generated
from this model (`python -m sprout.settings`), so the page and the code cannot drift.
"""

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import SproutError

PullPolicy = Literal["missing", "always", "never"]


class Settings(BaseSettings):
    """The variables, grouped by what they configure; each field is `SPROUT_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="SPROUT_", extra="ignore", frozen=True)

    # ---------------------------------------------------------------- the store and sandboxes
    store: Path = Field(Path("~/sprout-btrfs"), description="The btrfs store: images, sandboxes, checkpoints "
                        "and their metadata. On a filesystem that is not btrfs, a loop file is mounted there.")
    store_image: Path | None = Field(None, description="The store's loop file, mounted again after a reboot "
                                     "(default: the store's path with `.img`).")
    runtime_bin: Path | None = Field(None, description="The confined runtime that runs commands in containers "
                                     "(setns, fast); unset: `podman exec`. The set-up script writes "
                                     "`runtime/sprout-runtime` in the checkout.")
    host_slots: int | None = Field(None, ge=1, description="Rollouts and grades that run at once on this host, "
                                   "shared by every evaluation, gate and RL driver on it (default: "
                                   "max(4, 2 x CPUs)).")
    host_trust: bool = Field(True, description="Whether sandboxes get the host's CA bundle and proxy variables "
                             "(needed where outbound TLS goes through an intercepting proxy).")
    host_ca_bundle: Path | None = Field(None, description="The CA bundle sandboxes trust (default: "
                                        "`$SSL_CERT_FILE`, else the usual system paths).")
    max_copy_out_bytes: int = Field(1 << 30, ge=1, description="The largest file copied out of a sandbox "
                                    "(a verifier's output, a reward file).")
    oci_runtime: str = Field("runc", description="The OCI runtime podman runs sandboxes with (crun fails on "
                             "cgroup v1 hosts).")
    cgroup_manager: str = Field("cgroupfs", description="podman's cgroup manager for sandboxes.")
    start_timeout: float = Field(120.0, gt=0, description="Seconds one `podman run` of a sandbox may take.")
    podman_network: str = Field("podman", description="The podman network sandboxes with network are on.")
    microvm_accel: Literal["auto", "kvm", "tcg"] = Field("auto", description="The microVM backend's "
                                                         "accelerator: KVM where kvm_intel or kvm_amd is "
                                                         "loaded, else TCG (emulation).")

    # ---------------------------------------------------------------- images
    pull_policy: PullPolicy = Field("missing", description="When task images are pulled: `missing` (only "
                                    "images this host lacks), `always`, or `never` (offline).")
    pull_timeout: float = Field(1800.0, gt=0, description="Seconds one image pull may take.")

    # ---------------------------------------------------------------- the Run Store and services
    runstore_url: str | None = Field(None, description="The Run Store API; with `SPROUT_RUNSTORE_TOKEN`, "
                                     "evaluations, gates and the RL driver run their work as jobs there "
                                     "(`sprout services env` exports both).")
    runstore_token: str | None = Field(None, description="A bearer token for the Run Store (a secret: never "
                                       "printed or recorded).")
    job_tries: int = Field(3, ge=1, le=1000, description="How many times a Run Store job is run when its "
                           "handler fails (an error of the job itself) before it is failed.")
    job_worker_losses: int = Field(10, ge=1, le=1000, description="How many workers a Run Store job may lose "
                                   "(killed, preempted or cut off while they held it: its lease expired) before "
                                   "it is failed as lost to infrastructure; a job that keeps killing the workers "
                                   "that take it is stopped so.")
    endpoints: str = Field("", description="A worker's model endpoints, JSON `{name: {url, key_env}}` (written "
                           "by `sprout services`); a job names one of these, never a key.")
    config_dir: Path = Field(Path("~/.config/sprout"), description="Where `sprout services` keeps its "
                             "configuration, secrets, logs and pid files.")
    model_endpoint: str | None = Field(None, description="The default model endpoint `sprout services init` "
                                       "configures (else `$OPENAI_BASE_URL`).")

    def store_path(self) -> Path:
        return self.store.expanduser()

    def config_path(self) -> Path:
        return self.config_dir.expanduser()


#: Variables Sprout reads that are not settings of its own: their *names* are configuration (a key
#: variable an endpoint names), or they configure the set-up script or the tests.
OTHER_VARIABLES: dict[str, str] = {
    "SPROUT_MODEL_API_KEY": "The key of the model endpoint `sprout services init` configures by default "
                            "(its name is what services.json records, never its value).",
    "SPROUT_RL_DRIVER_TOKEN": "The bearer token Miles sends the RL driver (the driver's `driver_token_env` "
                              "names it; `sprout services env` exports it).",
    "SPROUT_RL_DRIVER_URL": "The RL driver's URL, exported by `sprout services env` for Miles.",
    "SPROUT_DEMO_KEY": "The key `sprout demo` gives its scripted model.",
    "SPROUT_MICROVM": "ops/setup_podman.sh: 1 sets up the microVM backend too (as --microvm does).",
    "SPROUT_BENCH_KEY": "bench/agent_overhead.py: the key its scripted model server asks for.",
    "SPROUT_STORE_SIZE": "ops/setup_podman.sh: the size of the store's sparse loop file (default 40G).",
    "SPROUT_STORE_MIN_FREE_GB": "ops/setup_podman.sh: the loop file grows when the store has less free "
                                "(default 10).",
    "SPROUT_PYTHON": "ops/setup_podman.sh: the Python 3.12 to build .venv with (default: found via pyenv).",
    "SPROUT_CGROUP_FAVORDYNMODS": "ops/setup_podman.sh: 0 leaves the cgroup2 mount's options alone (default 1: "
                                  "it remounts it with favordynmods, so commands join their cgroups without "
                                  "waiting).",
    "SPROUT_TASKS_DIR": "examples/qwen/run.py: the Harbor tasks directory it benchmarks.",
    "SPROUT_TEST_POSTGRES_URL": "The tests: the PostgreSQL server of the Run Store tests "
                                "(ops/postgres_for_tests.sh prints it).",
    "SPROUT_PG_DIR": "ops/postgres_for_tests.sh: where its throwaway cluster lives (also SPROUT_PG_PORT, "
                     "SPROUT_PG_USER, SPROUT_PG_PASSWORD, SPROUT_PG_DB).",
}


def settings() -> Settings:
    """The settings as the environment gives them now (read again whenever a SPROUT_ variable changed)."""
    return _settings_from(tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("SPROUT_"))))


@functools.lru_cache(maxsize=16)
def _settings_from(_variables: tuple[tuple[str, str], ...]) -> Settings:
    """Settings are read ~5 times per sandbox started; building them takes ~3 ms, so each distinct
    environment is read once (Settings is frozen: a cached one cannot be changed by its user)."""
    try:
        return Settings()
    except ValidationError as e:
        first = e.errors()[0]
        name = "SPROUT_" + str(first["loc"][0]).upper() if first["loc"] else "a SPROUT_ variable"
        raise SproutError(f"{name}={first.get('input')!r} cannot be used: {first['msg']}") from None


def configuration_markdown() -> str:
    """docs/configuration.md: every variable, from this module (a test keeps the page equal to it)."""
    lines = ["# Configuration", "",
             "Sprout reads these environment variables (the model `sprout.settings.Settings`; this page is generated "
             "from it by `python -m sprout.settings`). Each is read when it is used, never when a module is "
             "imported; a value that cannot be read is one error naming the variable.", "",
             "| variable | default | what it sets |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = "unset" if field.default is None else f"`{field.default}`"
        lines.append(f"| `SPROUT_{name.upper()}` | {default} | {field.description} |")
    lines += ["", "## Other variables", "",
              "Read by Sprout under names its configuration gives, or by the set-up script, the example and the "
              "tests:", "", "| variable | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {text} |" for name, text in OTHER_VARIABLES.items()]
    lines += ["", "Keys are never settings: a model endpoint names the *variable* that holds its key "
              "(`--model-key-env`, `key_env` in services.json, `api_key_env` in the RL driver's config), and "
              "only the process that calls the endpoint reads it. Sandboxes also get the host's proxy variables "
              "(`HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY`, `ALL_PROXY`, lower case too) and its CA bundle (`SSL_CERT_FILE`) "
              "unless `SPROUT_HOST_TRUST` is off."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(configuration_markdown(), end="")
