"""`sprout runstore serve` (the Run Store's HTTP API) and `sprout runstore token` (a bearer token)."""

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..jobs.payloads import job_kinds
    from ..runstore.api import serve
    from ..runstore.auth import TokensFileError, load_tokens
    from ..runstore.errors import StoreOpenError
    from ..runstore.store import RunStore
    from .flags import flatten

    try:
        tokens = load_tokens(args.tokens)
        store = RunStore(args.db, job_kinds(flatten(args.endpoints) or []))
    except (TokensFileError, StoreOpenError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    serve(store, tokens, host=args.host, port=args.port, log_level=args.log_level,
          max_body_bytes=args.max_body_bytes)
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from ..errors import SproutError
    from ..runstore.auth import Scope, add_token

    try:
        print(add_token(args.tokens_file, Scope(args.scope)))
    except (OSError, ValueError) as exc:
        raise SproutError(f"cannot update {args.tokens_file}: {exc}") from None
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    from ..runstore.auth import Scope
    from ..runstore.guard import DEFAULT_MAX_BODY_BYTES
    from .flags import names_list

    group = sub.add_parser("runstore", help="the Run Store's API and its tokens (`sprout services` runs both for you)")
    commands = group.add_subparsers(dest="runstore_command", required=True, metavar="COMMAND")
    s = commands.add_parser("serve", help="serve the Run Store API", description=(
        "Serves the Run Store's HTTP API over a database, accepting Sprout's job kinds. Every route but /health "
        "and the docs needs `Authorization: Bearer <token>`."))
    s.add_argument("--db", required=True, help="a SQLite file path, sqlite:///PATH or postgresql+psycopg://...")
    s.add_argument("--tokens", required=True, type=Path, metavar="FILE",
                   help='the tokens file: JSON {"<sha256 hex>": "worker"|"submitter"|"admin"}')
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8470, help="port (default 8470)")
    s.add_argument("--endpoints", type=names_list, nargs="+", metavar="NAME",
                   help="model endpoint names the workers have configured (services.json); jobs may name only these")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"the largest request body accepted; bigger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    s.set_defaults(func=cmd_serve)
    s = commands.add_parser("token", help="create a token, store its hash in a tokens file, print the token")
    s.add_argument("tokens_file", type=Path, metavar="TOKENS_FILE")
    s.add_argument("--scope", choices=[scope.value for scope in Scope], required=True)
    s.set_defaults(func=cmd_token)
