"""`sprout services`: configure and run Sprout's background services.

    setup                 guided: checks the host, asks for the model endpoint "default" and its key
                          variable (and the RL driver's tasks directory), shows a diff and asks before
                          changing any existing file
    init                  the same files without questions (flags / environment for the values);
                          --endpoint NAME=URL --endpoint-key-env NAME=VAR add more named endpoints
                          --proxy-model NAME --proxy-provider-model PROVIDER/MODEL [--proxy-api-base URL]
                          [--proxy-key-env VAR] configure the bundled LiteLLM proxy (litellm.yaml), for a
                          provider that does not serve plain Chat Completions; endpoint "default" points at it
                          --rl-driver-tasks-dir DIR [--rl-driver-port PORT] configure Sprout's RL driver
                          (rl-driver.json), which serves
                          Miles' /rollout-groups for the Harbor tasks in DIR, each sample a Run Store job
    up SERVICE...         start services (litellm-proxy, runstore-api, runstore-worker, rl-driver) and wait
                          until healthy
    down [SERVICE...]     stop services (a worker drains: finishes or releases its jobs)
    status                pid, port, health and uptime of each service
    logs SERVICE          the service's log (-f to follow)
    env                   `export SPROUT_RUNSTORE_URL=... SPROUT_RUNSTORE_TOKEN=...` for eval; with the proxy
                          also `export OPENAI_BASE_URL=... OPENAI_API_KEY=...` for worker run, eval, the RL
                          driver; with the RL driver also `export SPROUT_RL_DRIVER_URL=...
                          SPROUT_RL_DRIVER_TOKEN=...` for Miles' rollout function
"""

import argparse
import os
import shlex
import subprocess
from pathlib import Path

from pydantic import BaseModel, ValidationError
from rich.table import Table

from ..checkout import RUNTIME_LAUNCHER
from ..console import console
from ..errors import SproutError, UsageError
from ..jobs.endpoints import ConfiguredEndpoint, check_name
from ..services import supervisor
from ..services.config import (
    DEFAULT_KEY_ENV,
    PROXY_KEY_ENV,
    ProxyConfig,
    RLDriverService,
    ServicesConfig,
    config_dir,
    load,
    proxy_key,
    rl_driver_token,
    token,
)
from ..settings import settings

PROXY_FLAGS = {"model_name": "proxy_model", "provider_model": "proxy_provider_model", "api_base": "proxy_api_base",
               "key_env": "proxy_key_env", "port": "proxy_port"}
RL_DRIVER_FLAGS = {"tasks_dir": "rl_driver_tasks_dir", "port": "rl_driver_port",
                   "review_endpoint": "rl_driver_review_endpoint", "review_model": "rl_driver_review_model",
                   "review_key_env": "rl_driver_review_key_env"}
SECTIONS: dict[type[BaseModel], tuple[str, dict[str, str]]] = {ProxyConfig: ("litellm-proxy", PROXY_FLAGS), RLDriverService: ("rl-driver", RL_DRIVER_FLAGS)}


def _section[S: (ProxyConfig, RLDriverService)](model: type[S], values: dict) -> S:
    """A service's section of services.json; a bad value is one error line naming its flag."""
    service, flags = SECTIONS[model]
    try:
        return model(**values)
    except ValidationError as e:
        first = e.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a rule across fields, which the message names
            raise SproutError(f"{service}: {message}") from None
        flag = "--" + flags.get(str(first["loc"][0]), str(first["loc"][0])).replace("_", "-")
        raise SproutError(f"{service}: {flag}: {message}") from None


def _section_from[S: (ProxyConfig, RLDriverService)](args, model: type[S], base: S | None, removed: bool) -> S | None:
    """`base` with its --flags applied (`removed`: --no-proxy, --no-rl-driver); the proxy's key variable
    '' means no key; the RL driver's tasks directory is stored resolved."""
    if removed:
        return None
    _, flags = SECTIONS[model]
    given = {field: getattr(args, flag) for field, flag in flags.items() if getattr(args, flag) is not None}
    if not given:
        return base
    if "key_env" in given:
        given["key_env"] = given["key_env"] or None
    if given.get("tasks_dir"):
        given["tasks_dir"] = str(Path(given["tasks_dir"]).expanduser().resolve())
    return _section(model, {**(base.model_dump() if base else {}), **given})


def _at_proxy(proxy: ProxyConfig) -> ConfiguredEndpoint:
    """The endpoint that reaches the proxy: its URL, with its master key (set in the services' environment)."""
    return ConfiguredEndpoint(url=proxy.url, key_env=PROXY_KEY_ENV)


def _config_from(args, base: ServicesConfig) -> ServicesConfig:
    values = base.model_dump()
    values["endpoints"] = _endpoints_from(args, base.endpoints)
    proxy = _section_from(args, ProxyConfig, base.proxy, args.no_proxy)
    values["proxy"] = proxy
    values["rl_driver"] = _section_from(args, RLDriverService, base.rl_driver, args.no_rl_driver)
    default_given = args.model_endpoint or any(e.partition("=")[0] == "default" for e in args.endpoint or [])
    if proxy and proxy != base.proxy and not default_given:  # the proxy just set up is what the agent calls
        values["endpoints"]["default"] = _at_proxy(proxy)
    elif base.proxy and not proxy and values["endpoints"].get("default") == _at_proxy(base.proxy):
        del values["endpoints"]["default"]
    for field, value in (("runstore_port", args.port), ("runstore_db", args.db), ("worker_slots", args.slots),
                         ("runtime_bin", args.runtime_bin), ("worker_ship_listen", getattr(args, "ship_listen", None)),
                         ("worker_host_id", getattr(args, "host_id", None)),
                         ("worker_drain_s", getattr(args, "drain_timeout", None))):
        if value not in (None, ""):
            values[field] = value
    return ServicesConfig(**values)


def _pairs(values: list[str] | None, flag: str, form: str) -> dict[str, str]:
    """NAME=VALUE flags as a dict; one error line for anything else."""
    pairs = {}
    for item in values or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SproutError(f"{flag} wants {form}, got {item!r}")
        pairs[name] = value
    return pairs


def _endpoint(name: str, url: str, key_env: str | None) -> ConfiguredEndpoint:
    try:
        return ConfiguredEndpoint(url=url, key_env=key_env or None)
    except ValidationError as e:
        first = e.errors()[0]
        raise SproutError(f"endpoint {name!r}: {first['loc'][0]}: {first['msg']}") from None


def _endpoints_from(args, base: dict[str, ConfiguredEndpoint]) -> dict[str, ConfiguredEndpoint]:
    """`base` with --endpoint NAME=URL (an empty URL removes NAME) and --endpoint-key-env NAME=VAR
    (empty VAR: no key) applied; --model-endpoint/--model-key-env are the same for "default". A new
    endpoint has no key variable, except "default", whose key is in $SPROUT_MODEL_API_KEY."""
    urls = _pairs(args.endpoint, "--endpoint", "NAME=URL")
    keys = _pairs(args.endpoint_key_env, "--endpoint-key-env", "NAME=VAR")
    if args.model_endpoint:
        urls.setdefault("default", args.model_endpoint)
    if args.model_key_env:
        keys.setdefault("default", args.model_key_env)
    endpoints = dict(base)
    for name, url in urls.items():
        try:
            check_name(name)
        except ValueError as e:
            raise SproutError(f"--endpoint: {e}") from None
        if not url:
            endpoints.pop(name, None)
            continue
        old = endpoints.get(name)
        key_env = old.key_env if old else (DEFAULT_KEY_ENV if name == "default" else None)
        endpoints[name] = _endpoint(name, url, keys.get(name, key_env))
    for name, key_env in keys.items():
        if name not in endpoints:
            raise SproutError(f"--endpoint-key-env {name}={key_env}: no endpoint {name!r}; add it with "
                              f"--endpoint {name}=URL")
        endpoints[name] = _endpoint(name, endpoints[name].url, key_env)
    return endpoints


def _defaults() -> ServicesConfig:
    url = settings().model_endpoint or os.environ.get("OPENAI_BASE_URL", "")
    return ServicesConfig(endpoints={"default": _endpoint("default", url, DEFAULT_KEY_ENV)} if url else {},
                          runtime_bin=str(RUNTIME_LAUNCHER) if RUNTIME_LAUNCHER.exists() else "")


def _ask(question: str, default: str) -> str:
    """The answer, or `default` for an empty one or when the input has ended (answers fed from a file)."""
    try:
        answer = input(f"{question} [{default}]: ").strip()
    except EOFError:
        print()
        return default
    return answer or default


def _ask_number(question: str, default: int, lowest: int, highest: int) -> int:
    """Asks until the answer is a whole number from `lowest` to `highest` (empty: `default`)."""
    while True:
        answer = _ask(question, str(default))
        try:
            number = int(answer)
        except ValueError:
            number = None
        if number is not None and lowest <= number <= highest:
            return number
        console.print(f"  {answer!r} is not a whole number from {lowest} to {highest}; try again", markup=False)


def _confirm(path: Path, diff: str) -> bool:
    """Shows what would change in `path` and asks (no answer: no)."""
    console.print(diff, markup=False)
    try:
        answer = input(f"replace {path}? [y/N] ").strip().lower()
    except EOFError:
        print()
        answer = "n"
    return answer in ("y", "yes")


def cmd_setup(args) -> int:
    from ..services.files import write_all  # here: it imports the Run Store's models
    from ..worker.doctor import run_checks

    directory = config_dir()
    console.print("host checks (sprout doctor):")
    checks = run_checks()
    for check in checks:
        console.print(f"  {'PASS' if check.ok else 'FAIL'}  {check.name:<12} {check.detail}", markup=False)
    base = load(directory) if (directory / "services.json").exists() else _defaults()
    old = base.endpoints.get("default")
    at_proxy = base.proxy is not None and old == _at_proxy(base.proxy)
    url = _ask('model endpoint "default": an OpenAI-compatible Chat Completions base URL, or "proxy" if your '
               "provider speaks another API (the bundled LiteLLM proxy serves it as Chat Completions)",
               "proxy" if at_proxy else (old.url if old else "http://127.0.0.1:8000/v1"))
    proxy = base.proxy
    if url == "proxy":
        proxy = _ask_proxy(base.proxy)
        key_env, endpoint, needs_key = proxy.key_env, _at_proxy(proxy), "litellm-proxy"
    else:
        key_env = _ask("name of the environment variable holding its API key on the workers ('none': no key)",
                       (old.key_env or "none") if old and not at_proxy else DEFAULT_KEY_ENV)
        key_env = "" if key_env == "none" else key_env
        endpoint, needs_key = _endpoint("default", url, key_env), "runstore-worker"
    endpoints = {**base.endpoints, "default": endpoint}
    port = _ask_number("Run Store API port", base.runstore_port, 1, 65535)
    slots = _ask_number("worker slots (jobs at once on this host)", base.worker_slots, 1, 4096)
    rl_driver = _ask_rl_driver(base.rl_driver)
    config = base.model_copy(update={"endpoints": endpoints, "runstore_port": port,
                                     "worker_slots": slots, "proxy": proxy, "rl_driver": rl_driver})
    for line in write_all(directory, config, confirm=_confirm, force=False):
        console.print(line, markup=False)
    if key_env and key_env not in os.environ:
        console.print(f"note: {key_env} is not set in this shell; export it before `up {needs_key}`")
    return 0 if all(c.ok for c in checks) else 1


def _ask_rl_driver(old: RLDriverService | None) -> RLDriverService | None:
    """The RL driver's tasks directory (asked until it is a directory, 'none' or empty); its other
    settings are kept, or the defaults (`init --rl-driver-*` changes them)."""
    question = "Harbor tasks directory for the RL driver " + ("('none': no RL driver)" if old else
                                                              "(empty: no RL driver)")
    default = old.tasks_dir if old else "none"
    while True:
        answer = _ask(question, default)
        if answer == "none":
            return None
        path = Path(answer).expanduser().resolve()
        if path.is_dir() or answer == default:  # the configured one is kept even if it is gone (up says so)
            return _section(RLDriverService, {**(old.model_dump() if old else {}), "tasks_dir": str(path)})
        console.print(f"  {answer!r} is not a directory; try again ('none': no RL driver)", markup=False)


def _ask_proxy(old: ProxyConfig | None) -> ProxyConfig:
    """The LiteLLM proxy's model, provider, base URL, key variable and port, asked one by one."""
    model = _ask("model name the agent asks for (--model)", old.model_name if old else "default")
    provider_model = _ask("provider model for LiteLLM (openai/..., anthropic/..., hosted_vllm/..., ...)",
                          old.provider_model if old else "anthropic/claude-sonnet-4-5")
    api_base = _ask("the provider's base URL ('none': LiteLLM's default for the provider)",
                    (old.api_base or "none") if old else "none")
    key_env = _ask("name of the environment variable holding the provider's key ('none': no key)",
                   (old.key_env or "none") if old else "PROVIDER_API_KEY")
    port = _ask_number("proxy port", old.port if old else 4000, 1, 65535)
    return _section(ProxyConfig, {"model_name": model, "provider_model": provider_model, "port": port,
                   "api_base": "" if api_base == "none" else api_base,
                   "key_env": None if key_env == "none" else key_env})


def cmd_init(args) -> int:
    from ..services.files import write_all  # here: it imports the Run Store's models

    directory = config_dir()
    base = load(directory) if (directory / "services.json").exists() else _defaults()
    config = _config_from(args, base)
    for line in write_all(directory, config, confirm=None, force=args.force):
        console.print(line, markup=False)
    return 0


def _services(names: list[str], config: ServicesConfig | None = None) -> list[str]:
    """The named services in start order; none named: those `config` runs."""
    unknown = [n for n in names if n not in supervisor.SERVICES]
    if unknown:
        raise UsageError(f"unknown service {', '.join(unknown)}; services: {', '.join(supervisor.SERVICES)}")
    if names or config is None:
        return [n for n in supervisor.SERVICES if n in names]
    return supervisor.configured(config)


def cmd_up(args) -> int:
    directory = config_dir()
    config = load(directory)
    for name in _services(args.services, config):
        try:
            console.print(supervisor.up(name, config, directory), markup=False)
        except RuntimeError as e:
            raise SproutError(str(e)) from None
    return 0


def cmd_down(args) -> int:
    directory = config_dir()
    config = load(directory)
    for name in reversed(_services(args.services, config)):
        console.print(supervisor.down(name, config, directory), markup=False)
    return 0


def cmd_status(args) -> int:
    directory = config_dir()
    config = load(directory)
    table = Table("service", "pid", "port", "health", "uptime", "detail")
    statuses = [supervisor.status(name, config, directory) for name in supervisor.configured(config)]
    for s in statuses:
        table.add_row(s.name, str(s.pid or "-"), str(s.port or "-"),
                      "[green]healthy[/green]" if s.healthy else ("[red]down[/red]" if s.pid is None else "[yellow]unhealthy[/yellow]"),
                      "-" if s.uptime_s is None else f"{s.uptime_s:.0f}s", s.detail)
    console.print(table)
    return 0 if all(s.healthy for s in statuses if s.pid) else 1


def cmd_logs(args) -> int:
    path = config_dir() / "logs" / f"{_services([args.service])[0]}.log"
    if not path.exists():
        raise SproutError(f"no log yet at {path}")
    return subprocess.call(["tail", "-n", str(args.lines), *(["-f"] if args.follow else []), str(path)])


def cmd_env(args) -> int:
    directory = config_dir()
    config = load(directory)
    print(f"export SPROUT_RUNSTORE_URL={config.url} SPROUT_RUNSTORE_TOKEN={token('submitter', directory)}")
    if config.proxy:
        key = proxy_key(directory)
        if key is None:
            raise SproutError(f"no proxy master key in {directory}/secrets: run `sprout services init`")
        print(f"export OPENAI_BASE_URL={config.proxy.url} OPENAI_API_KEY={shlex.quote(key)}")
    if config.rl_driver:
        driver_token = rl_driver_token(directory)
        if driver_token is None:
            raise SproutError(f"no RL driver token in {directory}/secrets: "
                              "run `sprout services init`")
        print(f"export SPROUT_RL_DRIVER_URL={config.rl_driver.url} "
              f"SPROUT_RL_DRIVER_TOKEN={shlex.quote(driver_token)}")
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("services", help="configure and run the Run Store, its workers, the RL driver, the proxy",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = group.add_subparsers(dest="services_command", required=True, metavar="COMMAND")
    add_commands(commands)


def add_commands(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("setup", help="guided configuration").set_defaults(func=cmd_setup)
    s = sub.add_parser("init", help="write the configuration without questions")
    s.add_argument("--model-endpoint", metavar="URL",
                   help='the "default" endpoint: an OpenAI-compatible base URL (default $SPROUT_MODEL_ENDPOINT or '
                        "$OPENAI_BASE_URL); the same as --endpoint default=URL")
    s.add_argument("--model-key-env", metavar="VAR",
                   help='name of the variable holding the "default" endpoint\'s key on the workers (default '
                        "SPROUT_MODEL_API_KEY); the same as --endpoint-key-env default=VAR")
    s.add_argument("--endpoint", action="append", metavar="NAME=URL",
                   help="a named model endpoint jobs may use (repeatable; an empty URL removes NAME)")
    s.add_argument("--endpoint-key-env", action="append", metavar="NAME=VAR",
                   help="the variable holding NAME's key on the workers (repeatable; default: no key, except "
                        "SPROUT_MODEL_API_KEY for default; empty VAR: no key)")
    s.add_argument("--port", type=int, help="Run Store API port (default 8470)")
    s.add_argument("--db", help="Run Store database URL (default: SQLite in the config dir)")
    s.add_argument("--slots", type=int, help="worker slots (default 2)")
    s.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                   help="on `down`, how long a worker's running jobs may finish before they are stopped and "
                        "released (default 120)")
    s.add_argument("--runtime-bin", help="sprout-runtime for the worker's sandboxes")
    s.add_argument("--host-id", help="this host's name for job affinity (default: the hostname)")
    s.add_argument("--ship-listen", metavar="ADDR:PORT",
                   help="where the worker serves this host's checkpoints to other hosts (default 127.0.0.1:0; "
                        "0.0.0.0:PORT when workers on other hosts branch this host's checkpoints)")
    s.add_argument("--proxy-model", metavar="NAME",
                   help="configure the bundled LiteLLM proxy (service litellm-proxy) for a provider that does not "
                        "serve plain Chat Completions: NAME is the model the agent asks for (--model NAME)")
    s.add_argument("--proxy-provider-model", metavar="PROVIDER/MODEL",
                   help="the provider's model in LiteLLM's terms: openai/..., anthropic/..., hosted_vllm/..., ...")
    s.add_argument("--proxy-api-base", metavar="URL", help="the provider's base URL (default: LiteLLM's for it)")
    s.add_argument("--proxy-key-env", metavar="VAR",
                   help="the variable holding the provider's key where the proxy starts (litellm.yaml names it "
                        "as os.environ/VAR; empty: no key)")
    s.add_argument("--proxy-port", type=int, metavar="PORT", help="the proxy's port on 127.0.0.1 (default 4000)")
    s.add_argument("--no-proxy", action="store_true", help="remove the proxy from the configuration")
    s.add_argument("--rl-driver-tasks-dir", metavar="DIR",
                   help="configure Sprout's RL driver (service rl-driver): it serves Miles' /rollout-groups "
                        "for the Harbor tasks in DIR (a task_id is a directory name), each sample a Run "
                        "Store job")
    s.add_argument("--rl-driver-port", type=int, metavar="PORT", help="the RL driver's port on 127.0.0.1 "
                   "(default 11001)")
    s.add_argument("--rl-driver-review-endpoint", metavar="URL", help="the reviewer of search (GSML) groups: a "
                   "Chat Completions base URL (…/v1); with --rl-driver-review-model, the driver serves searches")
    s.add_argument("--rl-driver-review-model", metavar="NAME", help="the reviewer's model name")
    s.add_argument("--rl-driver-review-key-env", metavar="VAR", help="the variable holding the reviewer's key "
                   "where the driver starts (default: none)")
    s.add_argument("--no-rl-driver", action="store_true", help="remove the RL driver from the configuration")
    s.add_argument("--force", action="store_true", help="replace an existing services.json that differs")
    s.set_defaults(func=cmd_init)
    for name, func, text in (("up", cmd_up, "start services and wait until healthy"),
                             ("down", cmd_down, "stop services")):
        s = sub.add_parser(name, help=text)
        s.add_argument("services", nargs="*", metavar="SERVICE", help=", ".join(supervisor.SERVICES))
        s.set_defaults(func=func)
    sub.add_parser("status", help="pid, port, health, uptime").set_defaults(func=cmd_status)
    s = sub.add_parser("logs", help="a service's log")
    s.add_argument("service")
    s.add_argument("-n", "--lines", type=int, default=50)
    s.add_argument("-f", "--follow", action="store_true")
    s.set_defaults(func=cmd_logs)
    sub.add_parser("env", help="print the exports that point clients at the Run Store (and the proxy, the RL "
                   "driver)"
                   ).set_defaults(func=cmd_env)
    s = sub.add_parser("_supervise")  # internal: what `up` starts
    s.add_argument("service")
    s.set_defaults(func=lambda a: supervisor.supervise(a.service))
