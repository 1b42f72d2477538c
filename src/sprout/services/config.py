"""The files `services setup` and `init` write under ~/.config/sprout (SPROUT_CONFIG_DIR overrides).

    services.json            Run Store address and database, worker slots, the named model endpoints
                             (URL and key variable *name*; key values never go into files)
    secrets/tokens.json      hashed API tokens with their scopes (0600)
    secrets/{admin,worker,submitter}.token   the tokens themselves (0600)
    litellm.yaml             the LiteLLM proxy's model list, when a proxy is configured (the provider key
                             as os.environ/VAR, never its value)
    secrets/litellm-master.key   the proxy's master key, the key its clients send (0600)
    rl-driver.json           the RL driver's config (sprout.rl_driver.config), when the driver is configured;
                             its ledger is rl-driver.sqlite3 here, or the Run Store's PostgreSQL
    secrets/rl-driver.token  the bearer token the RL driver's callers send (0600)
    run/<service>.json, logs/<service>.log   pid files and logs of running services
"""

import json
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..jobs.endpoints import KEY_ENV_PATTERN, ConfiguredEndpoint, check_name
from ..settings import settings

SECRET_MODE = 0o600
SCOPES = ("admin", "worker", "submitter")
DEFAULT_KEY_ENV = "SPROUT_MODEL_API_KEY"  # the "default" endpoint's key variable unless told otherwise
PROXY_KEY_ENV = "LITELLM_MASTER_KEY"  # the proxy's master key in its services' environment (never in files)
PROXY_KEY_FILE = "litellm-master.key"
RL_DRIVER_TOKEN_ENV = "SPROUT_RL_DRIVER_TOKEN"  # the RL driver's bearer token in its environment
RL_DRIVER_TOKEN_FILE = "rl-driver.token"
RL_DRIVER_CONFIG = "rl-driver.json"


def config_dir() -> Path:
    return settings().config_path()


class ProxyConfig(BaseModel):
    """The bundled LiteLLM proxy: one model, served as plain Chat Completions at `url`, whatever API the
    provider speaks. The provider's key stays in the variable `key_env`."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(min_length=1)  # what the agent asks for (--model)
    provider_model: str = Field(pattern=r"^[A-Za-z0-9_.-]+/.+$")  # LiteLLM's provider/model, e.g. anthropic/...
    api_base: str = ""  # the provider's base URL; empty: LiteLLM's default for the provider
    key_env: str | None = Field(None, pattern=KEY_ENV_PATTERN)  # the variable holding the provider's key
    host: str = "127.0.0.1"
    port: int = Field(4000, ge=1, le=65535)

    @field_validator("key_env")
    @classmethod
    def _own_variable(cls, key_env: str | None) -> str | None:
        if key_env in ("OPENAI_API_KEY", PROXY_KEY_ENV):  # `services env` sets OPENAI_API_KEY to the proxy's key
            raise ValueError(f"{key_env} is the proxy's own key for its clients; keep the provider's key in "
                             "another variable (e.g. PROVIDER_API_KEY)")
        return key_env

    @field_validator("api_base")
    @classmethod
    def _base(cls, api_base: str) -> str:
        if api_base and not api_base.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, got {api_base!r}")
        return api_base.rstrip("/")

    @property
    def url(self) -> str:
        """The base URL clients use (OPENAI_BASE_URL)."""
        return f"http://{self.host}:{self.port}/v1"


class RLDriverService(BaseModel, extra="forbid"):
    """Sprout's RL driver (service rl-driver): serves Miles' /rollout-groups for the Harbor tasks in
    `tasks_dir`, each sample a Run Store job (the workers call the policy URL a request names with no key)."""

    tasks_dir: str = Field(min_length=1)  # Harbor task directories; a task_id is a directory name
    host: str = "127.0.0.1"
    port: int = Field(11001, ge=1, le=65535)
    #: The reviewer of search groups (miles.review): a Chat Completions base URL, its model and key
    #: variable; without them the driver serves plain groups only.
    review_endpoint: str | None = None
    review_model: str | None = None
    review_key_env: str | None = None

    @model_validator(mode="after")
    def _review_endpoint_and_model(self) -> "RLDriverService":
        if (self.review_endpoint is None) != (self.review_model is None):
            raise ValueError("a reviewer needs both --rl-driver-review-endpoint and --rl-driver-review-model")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ServicesConfig(BaseModel):
    runstore_host: str = "127.0.0.1"
    runstore_port: int = 8470
    runstore_db: str = ""  # default: sqlite file in the config dir
    worker_slots: int = 2
    worker_drain_s: float = 120.0  # on `down`, how long running jobs may finish before they are stopped
    worker_host_id: str = socket.gethostname()
    worker_ship_listen: str = "127.0.0.1:0"  # where the worker serves this host's checkpoints to others
    endpoints: dict[str, ConfiguredEndpoint] = {}  # the model endpoints jobs may name (workers' keys)
    runtime_bin: str = ""
    proxy: ProxyConfig | None = None  # the bundled LiteLLM proxy (service litellm-proxy), if configured
    rl_driver: RLDriverService | None = None  # Sprout's RL driver (service rl-driver), if configured

    @model_validator(mode="before")
    @classmethod
    def _legacy_endpoint(cls, data: Any) -> Any:
        """Files from before named endpoints: model_endpoint and model_key_env are endpoint "default"."""
        if not isinstance(data, dict) or not ({"model_endpoint", "model_key_env"} & data.keys()):
            return data
        data = dict(data)
        url, key_env = data.pop("model_endpoint", ""), data.pop("model_key_env", DEFAULT_KEY_ENV)
        endpoints = dict(data.get("endpoints") or {})
        if url and "default" not in endpoints:
            endpoints["default"] = {"url": url, "key_env": key_env or None}
        return {**data, "endpoints": endpoints}

    @model_validator(mode="after")
    def _names(self) -> "ServicesConfig":
        for name in self.endpoints:
            check_name(name)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.runstore_host}:{self.runstore_port}"

    def db_url(self, directory: Path) -> str:
        return self.runstore_db or f"sqlite:///{directory / 'runstore.db'}"

    @property
    def runstore_on_postgres(self) -> bool:
        return self.runstore_db.partition("://")[0].partition("+")[0] in ("postgresql", "postgres")


def load(directory: Path | None = None) -> ServicesConfig:
    path = (directory or config_dir()) / "services.json"
    if not path.exists():
        from ..errors import SproutError

        raise SproutError(f"no services config at {path}: run `sprout services init` (or `setup`)")
    try:
        return ServicesConfig.model_validate_json(path.read_text())
    except ValidationError as e:
        from ..errors import SproutError

        first = e.errors()[0]
        raise SproutError(f"{path}: {'.'.join(map(str, first['loc'])) or 'file'}: {first['msg']}") from None


def render(config: ServicesConfig) -> str:
    return json.dumps(config.model_dump(), indent=2) + "\n"


def proxy_key(directory: Path | None = None) -> str | None:
    """The proxy's master key, or None before `init`/`setup` made it."""
    path = (directory or config_dir()) / "secrets" / PROXY_KEY_FILE
    return path.read_text().strip() if path.exists() else None


def render_litellm(proxy: ProxyConfig) -> str:
    """litellm.yaml for `proxy`; keys only as os.environ/VAR references, which LiteLLM resolves at start.
    Scalars are JSON strings, which YAML reads as double-quoted strings."""
    params = {"model": proxy.provider_model, "api_base": proxy.api_base or None,
              "api_key": f"os.environ/{proxy.key_env}" if proxy.key_env else None}
    lines = ["model_list:", f"  - model_name: {json.dumps(proxy.model_name)}", "    litellm_params:"]
    lines += [f"      {key}: {json.dumps(value)}" for key, value in params.items() if value]
    lines += ["general_settings:", f"  master_key: {json.dumps(f'os.environ/{PROXY_KEY_ENV}')}"]
    return "\n".join(lines) + "\n"


def rl_driver_token(directory: Path | None = None) -> str | None:
    """The RL driver's bearer token, or None before `init`/`setup` made it."""
    path = (directory or config_dir()) / "secrets" / RL_DRIVER_TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def render_rl_driver(config: ServicesConfig, directory: Path) -> str:
    """rl-driver.json (a sprout.rl_driver.config.DriverConfig) for `config.rl_driver`: samples as Run Store
    jobs (URL here, token in $SPROUT_RUNSTORE_TOKEN), callers' token in $SPROUT_RL_DRIVER_TOKEN; the ledger
    next to the Run Store's jobs when those are in PostgreSQL, else a SQLite file in `directory`."""
    from ..rl_driver.config import DriverConfig

    driver = config.rl_driver
    assert driver is not None
    directory = directory.expanduser().resolve()
    ledger = config.runstore_db if config.runstore_on_postgres else str(directory / "rl-driver.sqlite3")
    review = None if driver.review_endpoint is None else {
        "endpoint": driver.review_endpoint, "model": driver.review_model, "api_key_env": driver.review_key_env}
    return DriverConfig(host=driver.host, port=driver.port, tasks_dir=Path(driver.tasks_dir),
                        miles={"review": review} if review else {}, driver_token_env=RL_DRIVER_TOKEN_ENV, ledger=ledger,
                        data_dir=directory / "rl-driver", runstore_url=config.url,
                        runstore_token_env="SPROUT_RUNSTORE_TOKEN",
                        runtime_bin=Path(config.runtime_bin) if config.runtime_bin else None
                        ).model_dump_json(indent=2) + "\n"


def token(scope: str, directory: Path | None = None) -> str:
    return ((directory or config_dir()) / "secrets" / f"{scope}.token").read_text().strip()


def write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SECRET_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(path.with_suffix(".tmp"), path)
