"""A release's wheel read member by member over HTTP, keeping only what is read.

The version matrix cites a handful of files in each of some twenty vLLM
releases. Downloading every wheel whole (about 340 MB each) to read those
files costs gigabytes; a wheel is a zip, whose central directory sits at its
end, so HTTP range requests fetch the directory and then only the members a
check reads (pip's own "lazy wheel" does the same to read metadata).

    wheel = open_member_wheel("vllm", "0.27.0", "manylinux_2_28_x86_64")
    wheel.lines("v1/core/block_pool.py")

What is read is kept in the same cache as the whole wheels
(``tools.citations.cache_dir()``), under ``members/<wheel file name>/``: the
list of the package's files, and each member read, byte for byte. A later run
reads them from there and needs no network for the same cells. Nothing is
unpacked beyond the members read, and nothing is installed.

The index is PyPI's simple index (PEP 503), ``$PAGEDKV_INDEX_URL`` if set.
Any failure (no network, an index or server without range requests) raises
:class:`MemberFetchError`; ``tools.versions`` then falls back to downloading
the whole wheel with pip.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from tools import citations

DEFAULT_INDEX = "https://pypi.org/simple"
MIN_READ = 64 << 10  # a read outside what was fetched fetches at least this much (zipfile reads in small pieces)
TIMEOUT_S = 30


class MemberFetchError(RuntimeError):
    """The wheel could not be read over HTTP (no network, no such file, no range requests)."""


def index_url() -> str:
    return os.environ.get("PAGEDKV_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def _get(url: str, byte_range: tuple[int, int] | None = None) -> tuple[bytes, dict]:
    headers = {"User-Agent": "pagedkv-tools"}
    if byte_range is not None:
        headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as r:
            return r.read(), {"status": r.status, **{k.lower(): v for k, v in r.headers.items()}}
    except OSError as e:  # URLError, HTTPError and socket errors are all OSErrors
        raise MemberFetchError(f"{url}: {e}") from e


def wheel_url(package: str, version: str, platform: str) -> tuple[str, str]:
    """(file name, URL) of the release's wheel for ``platform`` on the simple index."""
    page, _ = _get(f"{index_url()}/{package}/")
    prefix = f"{package}-{version}-"
    for href in re.findall(r'href="([^"]+)"', page.decode("utf-8", errors="replace")):
        url = urllib.request.urljoin(f"{index_url()}/{package}/", href.split("#", 1)[0])
        name = url.rsplit("/", 1)[-1]
        if name.startswith(prefix) and name.endswith(f"{platform}.whl"):
            return name, url
    raise MemberFetchError(f"no {prefix}*{platform}.whl on {index_url()}/{package}/")


class HTTPRangeFile(io.RawIOBase):
    """A remote file, seekable, read through range requests of about the bytes asked for.

    Every byte fetched is kept in ``segments`` (start -> bytes); a read inside
    one is answered from it, a read outside fetches at least ``MIN_READ``
    bytes from where it starts (from the end backwards near the end, where
    ``zipfile`` reads the end records in small pieces), and ``prefetch``
    fetches a member's whole extent in one request. So a member costs about
    its compressed size, not a fixed chunk around it."""

    def __init__(self, url: str):
        super().__init__()
        self.url = url
        body, headers = _get(url, (0, 0))
        total = re.fullmatch(r"bytes 0-0/(\d+)", headers.get("content-range", ""))
        if headers["status"] != 206 or total is None:
            raise MemberFetchError(f"{url}: the server does not answer range requests")
        self.size = int(total.group(1))
        self.pos = 0
        self.segments: dict[int, bytes] = {}
        self.bytes_fetched = len(body)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _held(self, first: int, end: int) -> bytes | None:
        for start, data in self.segments.items():
            if start <= first and end <= start + len(data):
                return data[first - start:end - start]
        return None

    def prefetch(self, first: int, end: int) -> None:
        """Fetch bytes ``first`` to ``end`` (exclusive, clipped to the file) in one request."""
        first, end = max(0, first), min(end, self.size)
        if end > first and self._held(first, end) is None:
            body, _ = _get(self.url, (first, end - 1))
            if len(body) != end - first:
                raise MemberFetchError(f"{self.url}: asked for {end - first} bytes at {first}, got {len(body)}")
            self.segments[first] = body
            self.bytes_fetched += len(body)

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        first, end = self.pos, self.pos + n
        if self._held(first, end) is None:
            if end + MIN_READ > self.size:  # the end records: take the file's last MIN_READ bytes
                self.prefetch(min(first, self.size - MIN_READ), self.size)
            else:
                self.prefetch(first, max(end, first + MIN_READ))
        buffer[:n] = self._held(first, end)
        self.pos = end
        return n


def _write_atomically(path: Path, data: bytes) -> None:
    """Written whole or not at all: a run stopped midway never leaves a truncated member."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        tmp.write(data)
    Path(tmp.name).replace(path)


class MemberWheel(citations.Wheel):
    """``citations.Wheel``'s interface over the member cache, filled over HTTP on demand.

    ``directory`` is ``members/<wheel file name>``; ``url`` finds the wheel
    when a member is missing (None: offline, and a missing member raises
    :class:`MemberFetchError`). The URL is looked up only then, so a run
    whose members are all cached makes no request at all.
    """

    def __init__(self, directory: Path, package: str, url=None):
        self.directory, self.package = directory, package
        self._url = url  # a str, a callable giving one, or None
        self._remote: HTTPRangeFile | None = None
        self._zipfile: zipfile.ZipFile | None = None
        self._lines: dict[str, list[str]] = {}
        names = directory / "files.txt"
        if not names.exists():
            prefix = package + "/"
            listed = sorted(n[len(prefix):] for n in self._zip().namelist() if n.startswith(prefix))
            _write_atomically(names, ("\n".join(listed) + "\n").encode())
        self.files = set(names.read_text(encoding="utf-8").split())

    def _zip(self) -> zipfile.ZipFile:
        if self._zipfile is None:
            url = self._url() if callable(self._url) else self._url
            if url is None:
                raise MemberFetchError(f"{self.directory.name}: not in the member cache, and offline")
            self._remote = HTTPRangeFile(url)
            self._zipfile = zipfile.ZipFile(self._remote)
        return self._zipfile

    def member(self, path: str) -> bytes:
        cached = self.directory / "members" / path
        if not cached.exists():
            archive, name = self._zip(), f"{self.package}/{path}"
            info = archive.getinfo(name)
            # One request for the member: its local header (30 bytes, the name,
            # an extra field like the directory's, with room to spare) and data.
            self._remote.prefetch(info.header_offset, info.header_offset + 30 + len(info.orig_filename.encode())
                                  + len(info.extra) + info.compress_size + 1024)
            _write_atomically(cached, archive.read(name))
        return cached.read_bytes()

    def lines(self, path: str) -> list[str]:
        if path not in self._lines:
            self._lines[path] = self.member(path).decode("utf-8", errors="replace").splitlines()
        return self._lines[path]

    @property
    def bytes_fetched(self) -> int:
        """Bytes this object fetched over HTTP (0 when the cache answered everything)."""
        return 0 if self._remote is None else self._remote.bytes_fetched


def open_member_wheel(package: str, version: str, platform: str, download: bool = True,
                      cache: Path | None = None) -> MemberWheel:
    """The release's wheel as a member cache: from disk if its file list is there, else
    (``download``) from the index; raises :class:`MemberFetchError` when neither works."""
    cache = cache or citations.cache_dir()

    def url() -> str:
        return wheel_url(package, version, platform)[1]

    for directory in sorted((cache / "members").glob(f"{package}-{version}-*{platform}.whl")):
        if (directory / "files.txt").exists():
            return MemberWheel(directory, package, url if download else None)
    if not download:
        raise MemberFetchError(f"{package} {version}: no member cache, and offline")
    name, found = wheel_url(package, version, platform)
    return MemberWheel(cache / "members" / name, package, found)
