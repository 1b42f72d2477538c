"""The Run Store: jobs (rollout, grade, review, gate) that workers on many hosts claim under leases.

* ``store.RunStore``: the store itself, over SQLite or PostgreSQL (needs the ``runstore`` extra).
* ``api.create_app``: its HTTP API; ``python -m sprout.runstore.api`` serves it.
* ``client.RunStoreClient``: the HTTP client, with the store's methods and models.

* ``worker``: the worker; ``handlers`` runs each job kind with the sandbox, agent, tasks and method
  layers, ``shipping`` moves checkpoints between worker hosts.

Importing the package loads only the models, the errors and the kinds registry (nothing else of
Sprout); the store, API, client and worker are imported from their modules.
"""

from .errors import (
    ApiError,
    BodyTooLarge,
    Forbidden,
    HostNotFound,
    InvalidPayload,
    InvalidRequest,
    InvalidTransition,
    JobNotFound,
    LeaseLost,
    RunStoreError,
    StoreOpenError,
    Unauthorized,
    UnknownKind,
)
from .kinds import register_kind, registered_kinds
from .models import Claim, Event, EventType, Host, Job, JobPage, JobSpec, JobState

__all__ = [
    "ApiError",
    "BodyTooLarge",
    "Claim",
    "Event",
    "EventType",
    "Forbidden",
    "Host",
    "HostNotFound",
    "InvalidPayload",
    "InvalidRequest",
    "InvalidTransition",
    "Job",
    "JobNotFound",
    "JobPage",
    "JobSpec",
    "JobState",
    "LeaseLost",
    "RunStoreError",
    "StoreOpenError",
    "Unauthorized",
    "UnknownKind",
    "register_kind",
    "registered_kinds",
]
