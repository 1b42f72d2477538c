"""The files `services setup` and `init` write under ~/.config/sprout (SPROUT_CONFIG_DIR overrides).

    services.json            Run Store address and database, worker slots, the named model endpoints
                             (URL and key variable *name*; key values never go into files)
    secrets/tokens.json      hashed API tokens with their scopes (0600)
    secrets/{admin,worker,submitter}.token   the tokens themselves (0600)
    run/<service>.json, logs/<service>.log   pid files and logs of running services
"""

import json
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError, model_validator

from ..runstore.endpoints import ConfiguredEndpoint, check_name

SECRET_MODE = 0o600
SCOPES = ("admin", "worker", "submitter")
DEFAULT_KEY_ENV = "SPROUT_MODEL_API_KEY"  # the "default" endpoint's key variable unless told otherwise


def config_dir() -> Path:
    return Path(os.environ.get("SPROUT_CONFIG_DIR", Path.home() / ".config" / "sprout")).expanduser()


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


def load(directory: Path | None = None) -> ServicesConfig:
    path = (directory or config_dir()) / "services.json"
    if not path.exists():
        from ..sandbox.errors import SproutError

        raise SproutError(f"no services config at {path}: run `python -m sprout.services init` (or `setup`)")
    try:
        return ServicesConfig.model_validate_json(path.read_text())
    except ValidationError as e:
        from ..sandbox.errors import SproutError

        first = e.errors()[0]
        raise SproutError(f"{path}: {'.'.join(map(str, first['loc'])) or 'file'}: {first['msg']}") from None


def render(config: ServicesConfig) -> str:
    return json.dumps(config.model_dump(), indent=2) + "\n"


def token(scope: str, directory: Path | None = None) -> str:
    return ((directory or config_dir()) / "secrets" / f"{scope}.token").read_text().strip()


def write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SECRET_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(path.with_suffix(".tmp"), path)
