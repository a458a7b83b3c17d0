"""Is the profile store reachable? One cheap request (S3 HeadBucket) before any expensive stage and before
every read, so that a missing bucket, a wrong endpoint or refused credentials stop a run in a second with a
message saying what to fix, instead of a raw pyarrow traceback after minutes of tracing and profiling, or
an empty result that reads as "no data"."""

from __future__ import annotations

import os

from memplan.tasks.config import MemplanError

CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0


class StoreUnreachable(MemplanError):
    """The profile store's bucket is missing, or its endpoint or credentials do not work."""


def _endpoint(options: dict) -> str | None:
    """The URL of a non-AWS endpoint, or None for AWS itself."""
    endpoint = options.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        return endpoint if "://" in endpoint else f"{options.get('scheme') or 'https'}://{endpoint}"
    return None


def check_location(where) -> None:
    """Raise `StoreUnreachable` naming the bucket, the endpoint and the fix when the `StoreLocation` is an
    object store whose bucket cannot be read; a folder passes (a new store folder is created by its first
    write). Fails within a few seconds: one attempt, short timeouts."""
    from pyarrow import fs as pafs

    if where.local:
        return
    bucket = where.base.split("/", 1)[0]
    if not isinstance(where.fs, pafs.S3FileSystem):
        probe = where.fs
        options: dict = {}
    else:                                    # the same options, failing fast: no retries, short timeouts
        options = dict(where.fs.__reduce__()[1][0])
        probe = pafs.S3FileSystem(**{**options, "connect_timeout": CONNECT_TIMEOUT_S,
                                     "request_timeout": REQUEST_TIMEOUT_S,
                                     "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1)})
    custom = _endpoint(options)
    endpoint = custom or "AWS S3"
    try:
        info = probe.get_file_info(bucket)
    except OSError as exc:
        text = str(exc)
        if "ACCESS_DENIED" in text or "403" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
            raise StoreUnreachable(
                f"The profile store {where.root} refuses these credentials: bucket {bucket!r} at {endpoint} "
                f"answered {text.split(': ', 1)[-1]}. Give the host a key allowed to list and write the bucket "
                f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment; docs/fleet.md, 'Rotating the "
                f"store's credentials').") from None
        raise StoreUnreachable(
            f"The profile store {where.root} cannot be reached: bucket {bucket!r} at {endpoint} gave "
            f"{text}. Check the endpoint (AWS_ENDPOINT_URL, or ?endpoint_override=host:port&scheme=http in the "
            f"store URL) and that the host can reach it.") from None
    if info.type == pafs.FileType.NotFound:
        raise StoreUnreachable(
            f"The profile store {where.root} does not exist: there is no bucket {bucket!r} at {endpoint}. "
            f"Create it once (`aws s3 mb s3://{bucket}{f' --endpoint-url {custom}' if custom else ''}`, or in "
            f"your object store's console), or fix the bucket name in the store URL.")
