"""Local paths and URLs alike (`gs://bucket/run`, `memory://x`, `file:///tmp/x`), through fsspec.

A run's model directory, data files, workdir and export directory may each be a URL; gcsfs (a
dependency) serves gs://. Local paths keep using the operating system directly.
"""

from __future__ import annotations

import os
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
