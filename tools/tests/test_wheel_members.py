"""tools.wheel_members: a wheel read member by member over HTTP range requests.

A local server stands in for PyPI: a simple-index page and a wheel, with and
without range requests. Nothing here touches the network.
"""

from __future__ import annotations

import http.server
import os
import re
import threading
import zipfile
from pathlib import Path

import pytest

from tools import citations, versions, wheel_members

WHEEL = "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
BIG = 8 << 20  # an incompressible member, so a whole download would show in the byte count


def _make_wheel(path: Path) -> bytes:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("vllm/v1/core/block_pool.py", "class BlockPool:\n    def free_blocks(self):\n        pass\n")
        z.writestr("vllm/big.bin", os.urandom(BIG))
        z.writestr("vllm-9.9.9.dist-info/METADATA", "Name: vllm\n")
    return path.read_bytes()


class _Server:
    """A simple index at /simple/vllm/ and the wheel at /files/, ranges on or off."""

    def __init__(self, data: bytes, ranges: bool):
        self.data, self.ranges, self.requests = data, ranges, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests += 1
                if self.path == "/simple/vllm/":
                    body = (f'<a href="../../files/{WHEEL}#sha256=0">{WHEEL}</a>\n'
                            '<a href="../../files/vllm-9.9.8-cp38-abi3-manylinux_2_28_x86_64.whl">x</a>').encode()
                    self.send_response(200)
                elif self.path == f"/files/{WHEEL}":
                    wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                    if wanted and outer.ranges:
                        first, last = int(wanted[1]), min(int(wanted[2]), len(outer.data) - 1)
                        body = outer.data[first:last + 1]
                        self.send_response(206)
                        self.send_header("Content-Range", f"bytes {first}-{last}/{len(outer.data)}")
                    else:
                        body = outer.data
                        self.send_response(200)
                else:
                    body = b"not found"
                    self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.index = f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served(tmp_path, monkeypatch):
    servers = []

    def start(ranges: bool = True) -> _Server:
        server = _Server(_make_wheel(tmp_path / WHEEL), ranges)
        servers.append(server)
        monkeypatch.setenv("PAGEDKV_INDEX_URL", server.index)
        return server

    yield start
    for s in servers:
        s.close()


def test_a_member_is_read_without_downloading_the_wheel(served, tmp_path):
    server = served()
    cache = tmp_path / "cache"
    wheel = wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux_2_28_x86_64", cache=cache)
    assert {"v1/core/block_pool.py", "big.bin"} <= wheel.files
    assert "    def free_blocks(self):" in wheel.lines("v1/core/block_pool.py")
    size = len(server.data)
    assert wheel.bytes_fetched < size / 2, (wheel.bytes_fetched, size)
    kept = cache / "members" / WHEEL
    assert (kept / "members" / "v1/core/block_pool.py").exists()
    assert not (kept / "members" / "big.bin").exists()


def test_a_member_costs_about_its_compressed_size_not_a_fixed_chunk(served, tmp_path):
    # The file list and one small member of an 8 MB wheel: the last MIN_READ
    # bytes (the end records and, in this small wheel, the whole directory),
    # then one request for the member's header and data.
    served()
    wheel = wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux_2_28_x86_64", cache=tmp_path / "c")
    wheel.lines("v1/core/block_pool.py")
    assert wheel.bytes_fetched < 2 * wheel_members.MIN_READ, wheel.bytes_fetched
    assert len(wheel._remote.segments) <= 3


def test_what_was_read_is_read_again_offline_and_nothing_else(served, tmp_path):
    server = served()
    cache = tmp_path / "cache"
    first = wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux_2_28_x86_64", cache=cache)
    first.lines("v1/core/block_pool.py")
    before = server.requests
    again = wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux_2_28_x86_64", cache=cache,
                                            download=False)
    assert again.lines("v1/core/block_pool.py") == first.lines("v1/core/block_pool.py")
    assert again.bytes_fetched == 0 and server.requests == before
    with pytest.raises(wheel_members.MemberFetchError, match="offline"):
        again.lines("big.bin")


def test_a_server_without_range_requests_is_refused_by_name(served, tmp_path):
    served(ranges=False)
    with pytest.raises(wheel_members.MemberFetchError, match="range requests"):
        wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux_2_28_x86_64", cache=tmp_path)
    assert not (tmp_path / "members" / WHEEL / "files.txt").exists()


def test_a_release_the_index_does_not_have_is_refused_by_name(served, tmp_path):
    served()
    with pytest.raises(wheel_members.MemberFetchError, match=r"vllm-9\.9\.7-"):
        wheel_members.open_member_wheel("vllm", "9.9.7", "manylinux_2_28_x86_64", cache=tmp_path)
    with pytest.raises(wheel_members.MemberFetchError, match="manylinux1_x86_64"):
        wheel_members.open_member_wheel("vllm", "9.9.9", "manylinux1_x86_64", cache=tmp_path)


def test_versions_reads_members_and_falls_back_to_pip_without_ranges(served, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    served()
    found = versions.open_wheel("9.9.9", "manylinux_2_28_x86_64")
    assert isinstance(found, wheel_members.MemberWheel)
    served(ranges=False)  # a second server, now the index: no member cache for 9.9.8 there
    asked = []
    monkeypatch.setattr(citations, "download_wheel", lambda directory, r: asked.append(r.version))
    assert isinstance(versions.open_wheel("9.9.8", "manylinux_2_28_x86_64"), str)
    assert asked == ["9.9.8"]
