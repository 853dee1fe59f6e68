"""Whether a gs:// or s3:// run path is reachable with the credentials found, said in one line within seconds
(credentials, one TCP connect, one HEAD on an s3 bucket) before a run starts."""

from __future__ import annotations

import functools
import os
import socket
import urllib.request
from urllib.parse import urlparse

from resformer_jax.storage.paths import StorageError, scheme


class StorageAccessError(StorageError):
    """Object storage this process cannot use: no credentials, no network, an unknown host, refused credentials."""


PROBE_TIMEOUT_S = 5.0  # one TCP connect to the endpoint; the metadata server gets 1 s


def probe_access(path) -> None:
    """Before any work on a gs:// or s3:// path: are there credentials, and is the endpoint reachable? One probe
    with short timeouts (seconds, not the clients' minute-long retry storms); StorageAccessError names the real
    cause and what supplies the fix. Emulators (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL) are probed the same way."""
    sch = scheme(path)
    if sch not in ("gs", "s3"):
        return
    bucket = os.fspath(path).split("://", 1)[1].split("/", 1)[0]
    problem = _probe(sch, bucket, *(os.environ.get(k, "") for k in _PROBE_ENV))
    if problem:
        raise StorageAccessError(f"{path}: {problem}")


# What a probe's outcome depends on (the outcome is cached per process for each combination).
_PROBE_ENV = (
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "CLOUDSDK_CONFIG",
    "HOME",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_EC2_METADATA_DISABLED",
)


@functools.cache
def _probe(sch: str, bucket: str, *env) -> str | None:
    if sch == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        endpoint = emulator or "https://storage.googleapis.com"
        if not emulator and not _gcp_credentials():
            return (
                "no Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, "
                "or run `gcloud auth application-default login` (on a GCE or TPU VM the metadata server "
                "supplies them)"
            )
    else:
        endpoint = (
            os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"
        )
        if not _aws_credentials():
            return (
                "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
                "`aws configure` / `aws sso login` (on EC2 an instance role supplies them)"
            )
        return _reachable(endpoint) or _s3_bucket_answers(bucket)
    return _reachable(endpoint)


def _s3_bucket_answers(bucket: str) -> str | None:
    """One HEAD request on the bucket with the credentials found (short timeouts, no retries): refused credentials
    and a missing bucket are named here, not after minutes of retries."""
    try:
        import botocore.config
        import botocore.exceptions
        import botocore.session
    except ImportError:
        return None
    client = botocore.session.get_session().create_client(
        "s3",
        config=botocore.config.Config(
            connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S, retries={"max_attempts": 1}
        ),
    )
    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidClientTokenId"):
            return (
                f"the AWS credentials found are refused for bucket {bucket!r} ({code}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the bucket's permissions"
            )
        if code in ("404", "NoSuchBucket"):
            return f"the bucket {bucket!r} does not exist; create it first (aws s3 mb s3://{bucket})"
        return f"the bucket {bucket!r} does not answer ({code}: {e})"
    except botocore.exceptions.BotoCoreError as e:
        return f"the bucket {bucket!r} does not answer ({type(e).__name__}: {e})"
    return None


def _gcp_credentials() -> bool:
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        return os.path.isfile(key)
    if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        return True
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
        return True
    return _gce_metadata_server()


def _gce_metadata_server() -> bool:
    """Whether the GCE metadata server (which supplies a VM's credentials) answers, within 1 s."""
    req = urllib.request.Request("http://169.254.169.254/computeMetadata/v1/", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=1.0) as r:
            return r.headers.get("Metadata-Flavor") == "Google"
    except Exception:
        return False


def _aws_credentials() -> bool:
    try:
        import botocore.session
    except ImportError:  # s3fs brings botocore; without it check_supported has already named the extra
        return bool(os.environ.get("AWS_ACCESS_KEY_ID"))
    session = botocore.session.get_session()
    # botocore's own chain (environment, profiles, SSO, web identity, containers, EC2 instance metadata): the
    # metadata lookup is bounded (1 s, one attempt) unless the user configured otherwise
    try:
        return session.get_credentials() is not None
    except Exception:
        return False


def _reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the URL's host opens within `timeout`; else why not, in words."""
    u = urlparse(url if "://" in url else f"http://{url}")
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return (
            f"cannot resolve the host {host!r} ({e.strerror if hasattr(e, 'strerror') else e}): no network, "
            "no DNS, or a wrong endpoint (check AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST if set)"
        )
    last = None
    for family, kind, proto, _, addr in addrs[:2]:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(addr)
                return None
        except OSError as e:
            last = e
    why = "timed out" if isinstance(last, TimeoutError) else (getattr(last, "strerror", None) or str(last))
    return (
        f"cannot reach {host}:{port} ({why}): no network, a firewall or proxy in the way, or a wrong endpoint "
        "(check AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST if set)"
    )
