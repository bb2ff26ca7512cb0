"""A backend's exception -> a ``RemoteError`` with a code, and whether trying again may help."""

from __future__ import annotations

import errno

from ..errors import RemoteError


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


# Exception classes by name (aiohttp, botocore, urllib3 are imported only by the backends).
_TIMEOUTS = {"TimeoutError", "ServerTimeoutError", "FSTimeoutError", "ReadTimeoutError", "ConnectTimeoutError"}
_CONNECTION = {
    "ConnectionError",
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientOSError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "IncompleteRead",
    "ProtocolError",
    "HTTPClientError",
}
_HINT_RETRY = "the storage or the network failed; try again (CKPTSPEC_REMOTE_TIMEOUT sets the timeout in seconds)"


def classify(exc: BaseException, url: str) -> tuple[RemoteError, bool]:
    """The ``RemoteError`` for a backend's exception, and whether trying again may help."""
    chain = _chain(exc)
    for e in chain:
        status = getattr(e, "status", None)
        if not isinstance(status, int):
            status = _boto_status(e)
        if status is not None and status >= 400:
            return _for_status(status, url, str(e)), status >= 500 or status in (408, 429)
    for e in chain:
        names = _names(e)
        if "FileExpired" in names or (isinstance(e, OSError) and "pre-condition" in str(e)):
            return changed(url, "its ETag changed while it was read"), False
        if isinstance(e, ValueError) and "range requests" in str(e):
            return no_ranges(url), False
        if names & _TIMEOUTS:
            return RemoteError("CK914", "timed out", _HINT_RETRY, url), True
    for e in chain:
        if _names(e) & _CONNECTION or isinstance(e, ConnectionError):
            detail = str(e).strip() or type(e).__name__
            return RemoteError("CK915", f"connection failed: {detail[:200]}", _HINT_RETRY, url), True
    for e in chain:
        if isinstance(e, PermissionError):
            return denied(url, str(e)), False
        if isinstance(e, FileNotFoundError):
            return not_found(url), False
        if isinstance(e, OSError) and e.errno in (errno.ETIMEDOUT,):
            return RemoteError("CK914", "timed out", _HINT_RETRY, url), True
    detail = f"{type(exc).__name__}: {exc}"[:300]
    return RemoteError("CK901", f"cannot read: {detail}", "check the URL and the storage's credentials", url), False


def _boto_status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def _for_status(status: int, url: str, detail: str) -> RemoteError:
    if status == 404:
        return not_found(url)
    if status in (401, 403):
        return denied(url, f"HTTP {status}")
    if status == 412:
        return changed(url, "its ETag changed while it was read")
    if status == 416:
        return changed(url, "the server has fewer bytes than it said")
    if status in (408, 504):
        return RemoteError("CK914", f"timed out (HTTP {status})", _HINT_RETRY, url)
    return RemoteError("CK915", f"the server answered HTTP {status}", _HINT_RETRY, url)


def not_found(url: str, what: str = "not found") -> RemoteError:
    return RemoteError("CK910", what, "check the URL: bucket, path and tag", url)


def denied(url: str, detail: str = "") -> RemoteError:
    return RemoteError(
        "CK911",
        "access denied" + (f" ({detail})" if detail else ""),
        "check the credentials in the backend's environment (AWS_* for s3://, GOOGLE_APPLICATION_CREDENTIALS for "
        "gs://, HF_TOKEN for hf://); over HTTP the server must allow reading and listing this directory",
        url,
    )


def changed(url: str, what: str) -> RemoteError:
    return RemoteError(
        "CK913",
        f"the file changed while it was read: {what}",
        "something is writing this checkpoint; read it again once the save is complete",
        url,
    )


def no_ranges(url: str) -> RemoteError:
    return RemoteError(
        "CK912",
        "the server does not answer range requests",
        "ckptspec reads only the parts of each file it needs; serve the files from a server that supports "
        "HTTP range requests (nginx, S3, GCS do), or download the checkpoint first",
        url,
    )
