"""Errors of the Run Store, shared by the store, the HTTP API and the client.

Each error a caller can cause has one class and one clear message; the API maps
the class to an HTTP status (``status``) and the client maps it back by name.
"""

from __future__ import annotations

from ..errors import SproutError


class RunStoreError(SproutError):
    """Base class of every Run Store error (a SproutError: the command line prints it as one line)."""

    status = 500


class StoreOpenError(RunStoreError):
    """The database URL is unusable or the database cannot be reached."""


class UnknownKind(RunStoreError):
    status = 422


class InvalidPayload(RunStoreError):
    status = 422


class JobNotFound(RunStoreError):
    status = 404


class HostNotFound(RunStoreError):
    """No worker has registered that host."""

    status = 404


class LeaseLost(RunStoreError):
    """The lease named by (job, lease_token) is not current: expired, stolen or ended."""

    status = 409


class InvalidTransition(RunStoreError):
    """The job's state does not allow the operation (e.g. cancelling a succeeded job)."""

    status = 409


class Unauthorized(RunStoreError):
    status = 401


class Forbidden(RunStoreError):
    status = 403


class InvalidRequest(RunStoreError):
    """The request is malformed: a value of the wrong type or out of range."""

    status = 422


class BodyTooLarge(RunStoreError):
    """The request body is over the API's limit (``--max-body-bytes``)."""

    status = 413


class ApiError(RunStoreError):
    """An HTTP error the client has no specific class for."""


ERRORS_BY_NAME: dict[str, type[RunStoreError]] = {
    cls.__name__: cls
    for cls in (
        UnknownKind,
        InvalidPayload,
        JobNotFound,
        HostNotFound,
        LeaseLost,
        InvalidTransition,
        Unauthorized,
        Forbidden,
        InvalidRequest,
        BodyTooLarge,
    )
}
