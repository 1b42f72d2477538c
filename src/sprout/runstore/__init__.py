"""The Run Store: the queue of jobs that workers on many hosts claim under leases.

* ``store.RunStore``: the store itself, over SQLite or PostgreSQL (needs the ``runstore`` extra).
* ``api.create_app``: its HTTP API; ``sprout runstore serve`` serves it.
* ``client.RunStoreClient``: the HTTP client, with the store's methods and models.
* ``kinds``: the job kinds a store accepts (it is told them when opened) and their payload models.

The queue knows nothing of agents or tasks: the jobs themselves (rollout, grade, review, gate) are
``sprout.jobs``; the worker loop, its handlers and checkpoint shipping are ``sprout.worker``.
Importing the package loads only the models, the errors and the kinds registry (nothing else of
Sprout); the store, API and client are imported from their modules.
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
from .kinds import JobKinds, Payload
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
    "JobKinds",
    "Payload",
]
