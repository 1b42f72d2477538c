"""The files `sprout services` writes in its configuration directory: services.json, the API tokens (made
once, kept), litellm.yaml and the proxy's master key, rl-driver.json and the driver's token. Each write says
on one line what it did (ok: already so; done: written; skip: left as it was)."""

import difflib
import json
import secrets
from collections.abc import Callable
from pathlib import Path

from ..runstore.auth import hash_token, new_token
from .config import (
    PROXY_KEY_FILE,
    RL_DRIVER_CONFIG,
    RL_DRIVER_TOKEN_FILE,
    SCOPES,
    ServicesConfig,
    load,
    proxy_key,
    render,
    render_litellm,
    render_rl_driver,
    rl_driver_token,
    write_secret,
)

Confirm = Callable[[Path, str], bool]  # shown a file's diff, says whether to replace it


def write_all(directory: Path, config: ServicesConfig, *, confirm: Confirm | None, force: bool) -> list[str]:
    """services.json, the tokens and, if the services.json now on disk has a proxy or an RL driver, their
    files."""
    lines = [_write_config(directory, config, confirm=confirm, force=force), *_write_secrets(directory)]
    on_disk = load(directory)
    return lines + _write_proxy_files(directory, on_disk) + _write_rl_driver_files(directory, on_disk)



def _write_config(directory: Path, config: ServicesConfig, *, confirm: Confirm | None, force: bool) -> str:
    path = directory / "services.json"
    new = render(config)
    if path.exists():
        old = path.read_text()
        if old == new:
            return f"ok    {path}"
        diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(path), f"{path} (new)"))
        if confirm is not None:
            if not confirm(path, diff):
                return f"skip  {path} (kept as it is)"
        elif not force:
            return f"skip  {path} differs from the flags; kept (pass --force to replace it)"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
    return f"done  {path}"



def _write_secrets(directory: Path) -> list[str]:
    """API tokens: made once, kept afterwards (rotating them would lock out running workers)."""
    folder = directory / "secrets"
    if all((folder / f"{scope}.token").exists() for scope in SCOPES) and (folder / "tokens.json").exists():
        return [f"ok    {folder}/ (tokens kept)"]
    table = {}
    for scope in SCOPES:
        value = new_token()
        write_secret(folder / f"{scope}.token", value + "\n")
        table[hash_token(value)] = scope
    write_secret(folder / "tokens.json", json.dumps(table, indent=2) + "\n")
    return [f"done  {folder}/ ({', '.join(SCOPES)} tokens, mode 0600; the API stores only their hashes)"]



def _write_proxy_files(directory: Path, config: ServicesConfig) -> list[str]:
    """litellm.yaml from services.json, and the proxy's master key, made once (LiteLLM refuses to start
    without one; clients send it, `services env` exports it)."""
    if config.proxy is None:
        return []
    lines = [_write_rendered(directory / "litellm.yaml", render_litellm(config.proxy))]
    key_path = directory / "secrets" / PROXY_KEY_FILE
    if proxy_key(directory) is None:
        write_secret(key_path, f"sk-{secrets.token_hex(32)}\n")
        lines.append(f"done  {key_path} (the proxy's master key, mode 0600)")
    else:
        lines.append(f"ok    {key_path} (kept)")
    return lines



def _write_rendered(path: Path, text: str) -> str:
    """Writes a file rendered from services.json unless it already holds exactly that; the setup line."""
    if path.exists() and path.read_text() == text:
        return f"ok    {path}"
    path.write_text(text)
    return f"done  {path}"



def _write_rl_driver_files(directory: Path, config: ServicesConfig) -> list[str]:
    """rl-driver.json from services.json, and the driver's bearer token, made once (like the API tokens:
    rotating it would lock out a running trainer)."""
    if config.rl_driver is None:
        return []
    lines = [_write_rendered(directory / RL_DRIVER_CONFIG, render_rl_driver(config, directory))]
    token_path = directory / "secrets" / RL_DRIVER_TOKEN_FILE
    if rl_driver_token(directory) is None:
        write_secret(token_path, new_token() + "\n")
        lines.append(f"done  {token_path} (the RL driver's bearer token, mode 0600)")
    else:
        lines.append(f"ok    {token_path} (kept)")
    if not Path(config.rl_driver.tasks_dir).is_dir():
        lines.append(f"note  {config.rl_driver.tasks_dir} (the RL driver's tasks directory) "
                     "does not exist yet")
    return lines



