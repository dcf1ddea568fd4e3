"""An S3 server's answers read once, by code, into weightcast's error types.

botocore raises :class:`~botocore.exceptions.ClientError` for every answer the server gave
(its ``Error.Code`` and HTTP status) and its own exception classes for answers that never
came. :func:`store_error` maps both, in one table each, to what the caller does next:
retry (:class:`StoreUnavailable`), stop with one line (:class:`StoreAccessDenied`), wait for
room (:class:`StoreFull`), try the version later (:class:`ObjectMissing`) or refuse it
(:class:`WeightsError`). An answer the client cannot use as it came (:class:`UnusableReply`,
raised by :mod:`weightcast.store.s3` as it checks every answer, or botocore's parser failing
on one) is an outage like a lost connection: it may pass.
"""

from __future__ import annotations

from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.parsers import ResponseParserError
from urllib3.exceptions import HTTPError, ProtocolError

from weightcast.contract.errors import (
    ObjectMissing,
    StoreAccessDenied,
    StoreFull,
    StoreUnavailable,
    WeightcastError,
    WeightsError,
)


class UnusableReply(WeightcastError):
    """An answer of the store's that cannot be used as it came: a size missing, negative or
    no number, a body longer than its cap or nested past reason, shorter or longer than it
    said, later than the request's deadline, a listing that goes round in circles. Raised
    below :meth:`~weightcast.store.s3.S3Store.call`, which turns it, like botocore's own
    errors, into a :class:`StoreUnavailable` retried within the budget."""


S3_REPLIES: dict[str, type[WeightcastError]] = {
    "AccessDenied": StoreAccessDenied,
    "AllAccessDisabled": StoreAccessDenied,
    "AuthorizationHeaderMalformed": StoreAccessDenied,
    "ExpiredToken": StoreAccessDenied,
    "InvalidAccessKeyId": StoreAccessDenied,
    "InvalidBucketName": StoreAccessDenied,
    "InvalidToken": StoreAccessDenied,
    "NoSuchBucket": StoreAccessDenied,
    "SignatureDoesNotMatch": StoreAccessDenied,
    "EntityTooLarge": StoreFull,
    "QuotaExceeded": StoreFull,
    "XMinioStorageFull": StoreFull,
    "InternalError": StoreUnavailable,
    "RequestTimeout": StoreUnavailable,
    "ServiceUnavailable": StoreUnavailable,
    "SlowDown": StoreUnavailable,
    "Throttling": StoreUnavailable,
    "ThrottlingException": StoreUnavailable,
    "NoSuchKey": ObjectMissing,
    "NoSuchUpload": WeightsError,
    "NotFound": ObjectMissing,
    "PreconditionFailed": WeightsError,
    "InvalidRange": WeightsError,
}
"""S3 error codes (the ``Error.Code`` of the answer) and the type each becomes."""

HTTP_STATUSES: dict[int, type[WeightcastError]] = {
    403: StoreAccessDenied,
    404: ObjectMissing,
    412: WeightsError,
    416: WeightsError,
    429: StoreUnavailable,
    507: StoreFull,
}
"""For answers whose code is not in :data:`S3_REPLIES` (a HEAD's answer has no body): the
HTTP status. Any other 5xx is an outage, and so is a redirect (the client follows none:
the endpoint or a proxy before it is misconfigured, which may pass)."""

NO_ANSWER = (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
    ProtocolError,
    HTTPError,
    ConnectionError,
    TimeoutError,
    UnusableReply,
    ResponseParserError,
)
"""What botocore and urllib3 raise when the server did not answer, or stopped mid-answer, and
what an answer that cannot be used raises."""

WHAT_NEXT: dict[type[WeightcastError], str] = {
    StoreAccessDenied: "check the bucket name and the credentials (AWS_ACCESS_KEY_ID, "
    "AWS_PROFILE, ~/.aws) this process uses",
    StoreFull: "free room in the bucket or raise its quota",
    StoreUnavailable: "check that the S3 server is running and reachable",
    ObjectMissing: "not in the store (yet): is the publisher running, with this bucket?",
    WeightsError: "the object is changed or not what the manifest says",
}


def store_error(exc: BaseException, what: str) -> WeightcastError | None:
    """``exc`` as the error weightcast raises for it, its message saying ``what`` was being
    done and what to do next; None for an exception that is no answer of the store's."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        kind = S3_REPLIES.get(code) or HTTP_STATUSES.get(status)
        if kind is None and (status >= 500 or 300 <= status < 400):
            kind = StoreUnavailable
        if kind is None:
            kind = WeightsError
        detail = f"{code or status}: {error.get('Message', '') or 'no message'}"
    elif isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        kind, detail = StoreAccessDenied, str(exc)
    elif isinstance(exc, NO_ANSWER):
        kind, detail = StoreUnavailable, f"{type(exc).__name__}: {exc}"
    else:
        return None
    return kind(f"{what}: {detail}; {WHAT_NEXT[kind]}")
