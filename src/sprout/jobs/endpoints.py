"""Model endpoints in jobs: a job names one of the workers' configured endpoints, or gives a plain URL.

A job's endpoint is ``{"name": NAME}`` or ``{"url": URL}``, never a key or a key variable:

- a name is one of the worker's own configured endpoints (``endpoints`` in services.json, passed to
  the worker as JSON in ``$SPROUT_ENDPOINTS``); its URL and key come from the worker's configuration.
  The API refuses a name it was not started with (``--endpoints``, from the same services.json) at
  submit, so nothing is sent anywhere for an unknown name.
- a URL (the RL driver's policy endpoints, a keyless vLLM) is called with no worker key at all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from typing import Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..agent.models import Endpoint
from ..errors import SproutError
from ..settings import settings

ENDPOINTS_ENV = "SPROUT_ENDPOINTS"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
KEY_ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


class EndpointRef(BaseModel):
    """The model endpoint a job uses: exactly one of `name` (a worker's configured endpoint) or `url`
    (called with no key). Validated with context {"endpoints": names}, a name must be one of those."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=NAME_PATTERN)
    url: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)

    @model_validator(mode="after")
    def _one_known(self, info: ValidationInfo) -> Self:
        if (self.name is None) == (self.url is None):
            raise ValueError('give exactly one of "name" (an endpoint configured on the workers) or "url"')
        known = (info.context or {}).get("endpoints")
        if self.name is not None and known is not None and self.name not in known:
            raise ValueError(f"no endpoint named {self.name!r} is configured on this Run Store (configured: "
                             f"{', '.join(sorted(known)) or 'none'}; see `sprout services init --endpoint`)")
        return self


class ConfiguredEndpoint(BaseModel):
    """A named endpoint in a worker's own configuration: its URL and the *name* of the variable that
    holds its key on the worker (None: no key). Key values never go into files or jobs."""

    model_config = ConfigDict(extra="forbid")

    url: str
    key_env: str | None = Field(None, pattern=KEY_ENV_PATTERN)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)


ENDPOINT_MAP = TypeAdapter(dict[str, ConfiguredEndpoint])


def check_name(name: str) -> str:
    """`name` if it is a valid endpoint name, else ValueError."""
    if not re.match(NAME_PATTERN, name):
        raise ValueError(f"invalid endpoint name {name!r}: use letters, digits, '.', '-' and '_'")
    return name


def worker_endpoints() -> dict[str, ConfiguredEndpoint]:
    """This worker's configured endpoints, from $SPROUT_ENDPOINTS (JSON {name: {url, key_env}})."""
    raw = settings().endpoints.strip()
    if not raw:
        return {}
    try:
        data = ENDPOINT_MAP.validate_json(raw)
        return {check_name(name): value for name, value in data.items()}
    except (ValueError, ValidationError) as e:
        raise SproutError(f"${ENDPOINTS_ENV} is not a valid endpoint map {{name: {{url, key_env}}}}: "
                          f"{_first_problem(e)}") from None


def _first_problem(error: ValueError) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"
    return str(error)


def render_endpoints(endpoints: Mapping[str, ConfiguredEndpoint]) -> str:
    """The $SPROUT_ENDPOINTS value for `endpoints`."""
    return json.dumps({name: e.model_dump() for name, e in endpoints.items()})


def resolve(ref: EndpointRef | Mapping, configured: Mapping[str, ConfiguredEndpoint] | None = None) -> Endpoint:
    """The Endpoint a worker calls for a job's `ref`: a configured name with that configuration's URL
    and key variable, or a plain URL with no key. Raises SproutError (nothing is called) for a name
    this worker does not have, or whose key variable is not set here."""
    ref = ref if isinstance(ref, EndpointRef) else EndpointRef.model_validate(ref)
    if ref.url is not None:
        return Endpoint(ref.url, None)
    configured = worker_endpoints() if configured is None else configured
    found = configured.get(ref.name or "")
    if found is None:
        raise SproutError(f"on this worker: no endpoint named {ref.name!r} is configured (configured: "
                          f"{', '.join(sorted(configured)) or 'none'}; `services init --endpoint NAME=URL`)")
    if found.key_env is not None and found.key_env not in os.environ:
        raise SproutError(f"on this worker: endpoint {ref.name!r} takes its key from {found.key_env}, which is "
                          "not set in the worker's environment (export it before `services up runstore-worker`)")
    return Endpoint(found.url, found.key_env, name=ref.name)


def known_names(names: Collection[str]) -> frozenset[str]:
    """`names` checked as endpoint names (for the API's --endpoints)."""
    return frozenset(check_name(n) for n in names)


def endpoint_ref(endpoint: Endpoint) -> EndpointRef:
    """How a job names `endpoint`: by name (a workers' configured endpoint, whose URL and key are the
    workers'), else by its plain URL, which workers call with no key. Never a key or a key variable."""
    return EndpointRef(name=endpoint.name) if endpoint.name else EndpointRef(url=endpoint.url)
