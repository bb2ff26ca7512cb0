"""Writing an output to a URL: each object streamed up in parts, verified, the one readers look for last.

An object store has no rename: an object appears, whole, when its upload completes (S3's
``CompleteMultipartUpload``; a killed upload leaves only invisible parts), and several objects never
appear together. So an output (a directory of files built locally) is published in this order:

1. the objects that make it visible to readers (``visible``: a safetensors index or single file, a
   checkpoint's ``latest``) of the previous output are deleted first, **only** when the new output
   rewrites an object of the same name: else a reader following the old one could mix old and new
   bytes. Readers then see no output until step 3 (the previous one, or none);
2. every other object is uploaded under its final name and verified;
3. the visible objects, last, in the order given, each verified;
4. the objects of the previous output that the new one does not have (``removals``) are deleted.

A run killed anywhere leaves readers the previous complete output or none, never a part; its
uploaded objects stay (harmless: nothing visible names them) until the next run rewrites or removes
them, and an upload killed mid-object leaves an incomplete multipart upload the store drops by its
lifecycle rule (docs/remote.md).

Each object is read from the local file and written in parts of ``part_size`` bytes (default 8 MiB,
``CKPTSPEC_REMOTE_PART``; S3's least is 5 MiB) through the backend's own file object, so memory stays
a few parts whatever the file's size. Verified after upload: its size, and its bytes: where the
store's ETag is the MD5 of the object or of its parts (S3's, moto's), it is compared with the MD5s
computed while streaming (no byte fetched again); else (an ETag that is not an MD5, e.g. SSE-KMS,
or another store) the object is read back whole and its SHA-256 compared with the one computed while
streaming. A difference is ``CK920``; a failed request is the code of its failure (CK910-CK915),
naming the object's URL.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._fs import io_point
from ..errors import RemoteError
from .problems import classify
from .settings import _setting
from .store import _Store, store_for

MIN_PART = 5 * 1024 * 1024  # S3 refuses smaller parts (but the last)
MAX_PARTS = 10_000  # S3's most parts of one upload


@dataclass(frozen=True)
class Uploaded:
    name: str  # relative to the output's URL, posix
    size: int
    sha256: str
    verified_by: str  # "etag" (the store's MD5s equal ours) or "re-read" (SHA-256 of the object read back)


def part_size(nbytes: int) -> int:
    """Bytes per part for a file of ``nbytes``: ``CKPTSPEC_REMOTE_PART`` (default 8 MiB), more when the
    file would need more parts than S3 allows."""
    wanted = _setting("CKPTSPEC_REMOTE_PART", 8 * 1024 * 1024, MIN_PART)
    return max(wanted, -(-nbytes // MAX_PARTS))


def local_files(directory: Path) -> list[str]:
    """The files below ``directory``, as sorted posix names relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def objects(url: str) -> list[str]:
    """The objects below ``url`` (a directory's prefix), as sorted names relative to it; [] when there are none."""
    store = store_for(url)
    base = store.key(url)
    store.fs.invalidate_cache(base)  # the backend's own listing cache: objects written since must be seen
    try:
        found = store.call(url, store.fs.find, base)
    except RemoteError as exc:
        if exc.code == "CK910":
            return []
        raise
    return sorted(name[len(base) + 1 :] for name in found if name.startswith(base + "/"))


def publish(local: Path, url: str, visible: Sequence[str], removals: Sequence[str] = ()) -> list[Uploaded]:
    """Upload the files of ``local`` below ``url`` in the order of the module docstring; ``visible`` (names
    relative to ``local``) last. Returns what was uploaded, in upload order."""
    store = store_for(url)
    base = store.key(url).rstrip("/")
    names = local_files(local)
    data = [n for n in names if n not in visible]
    before = set(objects(url))
    hidden = [name for name in visible if name in before] if before & set(data) else []
    done: list[Uploaded] = []
    removed: list[str] = []
    try:
        for name in hidden:
            delete(store, f"{base}/{name}")
            removed.append(name)
        for name in data + list(visible):
            done.append(_upload(store, local / name, f"{base}/{name}", name))
        for name in removals:
            if name not in names:
                delete(store, f"{base}/{name}")
    except BaseException as stopped:  # an error, Ctrl-C, SIGTERM: the CLI says what readers see now
        stopped.ckptspec_upload = _left(url, removed, done, len(names))  # type: ignore[attr-defined]  # any exception
        raise
    _forget_below(store, base)
    return done


def _left(url: str, hidden: list[str], done: list[Uploaded], objects: int) -> str:
    """What readers of ``url`` see after an upload stopped (of ``objects``, ``done`` were uploaded)."""
    if len(done) == objects:
        return f"{url} holds the complete new output (objects of the earlier one it does not use: until the next run)"
    if hidden:
        return f"{url} holds no output: the earlier one's {hidden[0]} was removed first, its files being rewritten"
    if done:
        return f"{url} shows the earlier output, if any: {len(done)} objects of the new one uploaded, not the last"
    return "nothing was written"


def _forget_below(store: _Store, base: str) -> None:
    """What this process saw of ``base`` and below (infos, listings, open handles) is stale now: a later read
    of the same process (``ckptspec.reconstruct`` to the URL again, a ``validate``) asks the store again."""
    store.fs.invalidate_cache(base)
    for seen in (store._infos, store._listings, store._handles):
        for key in [k for k in seen if k == base or k.startswith(base + "/")]:
            del seen[key]
    parent = base.rpartition("/")[0]
    store._listings.pop(parent, None)  # its listing may lack the new directory


def put(url: str, data: bytes) -> Uploaded:
    """One file's bytes (a manifest: ``generate -o``, ``convert``, ``migrate``,
    ``extract -o``) as the object ``url``: it appears whole
    when its upload completes, or not at all (an object replaced keeps its earlier bytes until then); verified."""
    import tempfile

    store = store_for(url)
    with tempfile.NamedTemporaryFile(prefix="ckptspec-put-") as staged:
        staged.write(data)
        staged.flush()
        return _upload(store, Path(staged.name), store.key(url), url.rstrip("/").rsplit("/", 1)[-1])


def _failed(exc: BaseException, url: str, what: str) -> RemoteError:
    error, _ = classify(exc, url)
    return RemoteError(error.code, f"{what} failed: {error.message}", error.hint, url)


def delete(store: _Store, path: str) -> None:
    """Remove one object (already gone: nothing); a failure raised with its code, naming the object."""
    url = store.url(path)
    io_point("remove")
    try:
        store.fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:
        raise _failed(exc, url, "removing the previous output's object") from None


def _pieces(path: Path, size: int) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while piece := fh.read(size):
            yield piece


def _upload(store: _Store, source: Path, path: str, name: str) -> Uploaded:
    """One object: streamed up in parts (nothing visible until the last completes), then verified."""
    url = store.url(path)
    size = source.stat().st_size
    part = part_size(size)
    sha = hashlib.sha256()
    md5s: list[bytes] = []
    try:
        # autocommit=False: parts are uploaded as they fill, and the object appears only at commit().
        out = store.fs.open(path, "wb", block_size=part, autocommit=False)
    except Exception as exc:
        raise _failed(exc, url, "upload") from None
    try:
        for piece in _pieces(source, part):  # one part per write: s3fs uploads a full buffer as one part
            io_point("write")
            sha.update(piece)
            md5s.append(hashlib.md5(piece, usedforsecurity=False).digest())
            out.write(piece)
        out.close()
        io_point("rename")  # the object appears here, as a rename makes a local file appear
        out.commit()
    except BaseException as exc:
        discard = getattr(out, "discard", None)
        if discard is not None:
            try:
                discard()  # the parts uploaded so far: dropped, not left to the lifecycle rule
            except Exception:
                pass
        if isinstance(exc, Exception) and not isinstance(exc, RemoteError):
            raise _failed(exc, url, "upload") from None
        raise
    return Uploaded(name, size, sha.hexdigest(), _verify(store, path, size, sha.hexdigest(), md5s))


_ETAG_MD5 = re.compile(r'^"?([0-9a-f]{32})(?:-(\d+))?"?$')


def _etag_of(md5s: list[bytes]) -> tuple[str, ...]:
    """The ETags S3 gives an object of these parts: a single PUT's MD5, or the MD5 of the parts' MD5s."""
    if not md5s:
        return (hashlib.md5(b"", usedforsecurity=False).hexdigest(),)
    composite = hashlib.md5(b"".join(md5s), usedforsecurity=False).hexdigest() + f"-{len(md5s)}"
    return (composite, md5s[0].hex()) if len(md5s) == 1 else (composite,)


def _verify(store: _Store, path: str, size: int, sha256: str, md5s: list[bytes]) -> str:
    """How the object at ``path`` was found to hold the bytes uploaded ("etag" or "re-read"); CK920 when not."""
    url = store.url(path)
    try:
        info = store.fs.info(path, refresh=True) if _refreshes(store) else store.fs.info(path)
    except Exception as exc:
        raise _failed(exc, url, "verifying the upload") from None
    stored = info.get("size")
    if stored != size:
        raise _mismatch(url, f"it holds {stored} bytes, {size} were uploaded")
    etag = str(info.get("ETag") or info.get("etag") or "")
    match = _ETAG_MD5.match(etag.lower())
    if match and (match[1] + (f"-{match[2]}" if match[2] else "")) in _etag_of(md5s):
        return "etag"
    if _read_back(store, path, size) != sha256:  # an ETag that is not our MD5s: the bytes themselves
        raise _mismatch(url, "its SHA-256 read back differs from the bytes uploaded")
    return "re-read"


def _refreshes(store: _Store) -> bool:
    return store.protocol in ("s3", "s3a")


def _read_back(store: _Store, path: str, size: int) -> str:
    url = store.url(path)
    sha = hashlib.sha256()
    try:
        with store.fs.open(path, "rb", block_size=part_size(size), cache_type="none") as fh:
            while piece := fh.read(part_size(size)):
                sha.update(piece)
    except Exception as exc:
        raise _failed(exc, url, "reading the upload back") from None
    return sha.hexdigest()


def _mismatch(url: str, what: str) -> RemoteError:
    return RemoteError(
        "CK920",
        f"the uploaded object differs from the output written: {what}",
        "the store or the network changed the bytes; run the command again (the output stays invisible to readers)",
        url,
    )


__all__ = ["Uploaded", "local_files", "objects", "part_size", "publish", "put"]
