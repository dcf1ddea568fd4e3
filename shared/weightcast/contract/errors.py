"""The errors weightcast raises on purpose, under one base class.

Each says what went wrong and what to do next. The ``weightcast`` command turns a
:class:`ConfigError` into one line and exit status 2 before any work starts, any other
:class:`WeightcastError` into one line and exit status 1; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class WeightcastError(Exception):
    """Base class of every error weightcast raises on purpose."""


class ConfigError(WeightcastError, ValueError):
    """A setting that cannot be used; the message names the setting and where it came from."""


class InvalidBatch(WeightcastError, ValueError):
    """A rollout batch that breaks the contract; ``reason`` says what to fix."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WeightsError(WeightcastError, ValueError):
    """A published version that must not be loaded: the message names the file and the
    problem (bad path, manifest, header, digest or shape)."""


class ObjectMissing(WeightsError):
    """An object of a registered version is not in the store (S3's 404): not damaged, absent.
    It may come: a publisher moved to a new bucket uploads the live versions it holds, so a
    node tries such a version again later instead of refusing it for good."""


class RecordError(WeightcastError, ValueError):
    """A Redis record (an event, the heartbeat, a quarantine record) that is not what its
    writer writes: the message names the record and the field. Anyone with access to Redis
    can write one."""


class VersionGone(WeightcastError, LookupError):
    """The version was evicted before a lease could be taken; ask for the latest again."""


class LayoutError(WeightcastError, ValueError):
    """A model/tp combination or a set of tensors the layout cannot serve."""


class BlockCutError(LayoutError):
    """A tp or expert placement whose shards cut a 128-block of FP8 scales (vLLM refuses it):
    the setting is wrong, not the snapshot."""


class RedisUnavailable(WeightcastError, ConnectionError):
    """Redis did not answer for longer than the process was told to wait for it."""


class RedisAccessDenied(ConfigError):
    """Redis refused this client: a wrong or missing password (``NOAUTH``, ``WRONGPASS``) or
    a user without the permission (``NOPERM``). A mistake, not an outage: never retried."""


class RedisFull(WeightcastError):
    """Redis refuses writes: its memory is at ``maxmemory`` with the ``noeviction`` policy."""


class RedisGroupExists(WeightcastError):
    """Redis' ``BUSYGROUP``: the consumer group exists already. Never raised: whoever creates
    the group second has nothing to do (:func:`~weightcast.contract.streams.ensure_group`)."""


class StoreUnavailable(WeightcastError, ConnectionError):
    """The object store did not answer (connection refused, timeouts, throttling, 5xx) for
    longer than the process was told to wait for it. An outage: the caller tries again later."""


class StoreAccessDenied(ConfigError):
    """The object store refused this client: no such bucket, a refused credential, a 403. A
    mistake, not an outage: never retried."""


class StoreFull(WeightcastError):
    """The object store refuses writes: a bucket quota or a full server. Retried like a full
    disk."""
