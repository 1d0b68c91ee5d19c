"""Local paths and URLs alike (`gs://bucket/run`, `memory://x`, `file:///tmp/x`), through fsspec.

A run's model directory, data files, workdir and export directory may each be a URL; gcsfs (a
dependency) serves gs://. Local paths keep using the operating system directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import IO, Any

import fsspec


def is_url(path: str | os.PathLike) -> bool:
    """A path with a scheme (gs://, s3://, memory://, file://): read through fsspec."""
    return "://" in os.fspath(path)


def local_abspath(path: str | os.PathLike) -> str:
    """`os.path.abspath` for local paths; URLs are returned as they are."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    """`os.path.join` that also joins URL paths with '/'."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def basename(path: str) -> str:
    """The last component of a path or URL."""
    return os.path.basename(os.fspath(path).rstrip("/"))


def filesystem(path: str | os.PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) of a local path or URL."""
    return fsspec.core.url_to_fs(os.fspath(path))


def exists(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def isfile(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    return fs.isfile(p)


def open_file(path: str | os.PathLike, mode: str = "rb") -> IO[Any]:
    """An open file object (a context manager) for a local path or URL."""
    if not is_url(path):
        return open(path, mode)  # noqa: SIM115 - the caller closes it
    fs, p = filesystem(path)
    return fs.open(p, mode)


def makedirs(path: str | os.PathLike) -> None:
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)


def cache_root() -> str:
    """Where remote directories are copied to: $QURL_JAX_CACHE, else ~/.cache/qurl_jax."""
    return os.environ.get("QURL_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "qurl_jax")


def local_copy(url: str | os.PathLike) -> str:
    """A local directory with the files of the directory `url` (a local path is returned as it
    is). The copy is made once per content, under `cache_root()/remote/<name>-<fingerprint>`
    (the fingerprint covers the URL and every file's path and size), complete or not at all:
    loaders that need local files (safetensors, tokenizers) then read a gs:// model directory."""
    url = os.fspath(url)
    if not is_url(url):
        return url
    fs, root = filesystem(url)
    root = root.rstrip("/")
    listing = {f[len(root):].lstrip("/"): int(info.get("size") or 0)
               for f, info in fs.find(root, detail=True).items()}
    if not listing:
        raise FileNotFoundError(f"{url} holds no files")
    fingerprint = hashlib.sha256(json.dumps([url, sorted(listing.items())]).encode()).hexdigest()
    local = os.path.join(cache_root(), "remote", f"{basename(url)}-{fingerprint[:16]}")
    if os.path.exists(os.path.join(local, _COMPLETE)):
        return local
    partial = f"{local}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    for rel in listing:
        target = os.path.join(partial, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(f"{root}/{rel}", target)
    open(os.path.join(partial, _COMPLETE), "w").close()
    shutil.rmtree(local, ignore_errors=True)  # an incomplete copy of an earlier attempt
    try:
        os.rename(partial, local)
    except OSError:  # another process finished the same copy first
        shutil.rmtree(partial, ignore_errors=True)
    return local


def upload_dir(local: str, url: str) -> None:
    """Copies every file under the local directory `local` to the directory `url`."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    for directory, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), local).replace(os.sep, "/")
            fs.put_file(os.path.join(directory, name), f"{root}/{rel}")


_COMPLETE = ".qurl_jax_complete"  # marks a finished `local_copy`


# The repository's root, against which a relative data path that is not found from the working
# directory is tried (the configs name the bundled sets relative to it).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def data_path(path: str) -> str:
    """A data file's path as the run reads it: a URL or an absolute path as it is; a relative path
    from the working directory when it exists there, else from the repository when it exists
    there, else as it is (the error then names it as written)."""
    if is_url(path) or os.path.isabs(path) or os.path.exists(path):
        return path
    in_repo = os.path.join(REPO_ROOT, path)
    return in_repo if os.path.exists(in_repo) else path
