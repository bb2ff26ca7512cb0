"""Real servers on 127.0.0.1 for the remote tests and benchmarks: nginx (HTTP) and moto's S3 server.

Both are the real programs, started here as child processes and stopped when done; nothing
imitates them. A missing nginx or moto is a broken environment (``scripts/env.sh`` installs
both), never a skip.

nginx serves one directory (``Nginx.root``) under several locations, each a way a server can
behave:

* ``/``: plain static files with byte ranges and directory listings (``autoindex``);
* ``/norange/``: the same files without byte-range support (``max_ranges 0``);
* ``/stall/``: answers stop after 3 KiB, headers included (``limit_rate 1`` past ``limit_rate_after``):
  a client timeout;
* ``/drop/``: a proxy of ``/stall/`` that gives up after one second and closes the client's
  connection in the middle of the body (``proxy_read_timeout``): a connection dropped mid-file;
* ``/denied/``: ``deny all`` (HTTP 403).

Its access log has one line per request: ``METHOD URI STATUS BYTES_SENT RANGE``, the body bytes
nginx itself counted, so a test reads from nginx what a client fetched.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOCATIONS = ("", "norange/", "stall/", "drop/", "denied/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen, what: str, log: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(
        f"{what} did not answer {url} within {seconds:.0f} s:\n{log.read_text(errors='replace')[-3000:]}"
    )


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- nginx

_NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {work}/nginx.pid;
error_log {work}/error.log info;
events {{ worker_connections 256; }}
http {{
    log_format bytes '$request_method $request_uri $status $body_bytes_sent "$http_range"';
    access_log {work}/access.log bytes;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    default_type application/octet-stream;
    types {{ application/json json; text/plain txt; }}
    sendfile on;
    keepalive_timeout 30s;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        autoindex on;
        location /norange/ {{ alias {root}/; autoindex on; max_ranges 0; }}
        location /stall/ {{ alias {root}/; autoindex on; limit_rate_after 3k; limit_rate 1; }}
        location /drop/ {{
            proxy_pass http://127.0.0.1:{port}/stall/;
            proxy_read_timeout 1s;
            proxy_buffering off;
        }}
        location /denied/ {{ deny all; }}
    }}
}}
"""


@dataclass
class Nginx:
    """A running nginx: ``url(location, relative)``, the files under ``root``, the access log."""

    port: int
    root: Path
    work: Path
    proc: subprocess.Popen

    def url(self, relative: str = "", location: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{location}{relative}"

    def log_lines(self) -> list[tuple[str, str, int, int, str]]:
        """(method, uri, status, body bytes sent, Range header) per request, in order."""
        out = []
        path = self.work / "access.log"
        for line in path.read_text().splitlines() if path.exists() else []:
            method, uri, status, sent, rng = line.split(" ", 4)
            rng = rng.strip('"')
            out.append((method, uri, int(status), int(sent), "" if rng == "-" else rng))
        return out

    def mark(self) -> int:
        """The number of requests logged so far: ``since(mark)`` gives the ones after it."""
        return len(self.log_lines())

    def since(self, mark: int) -> list[tuple[str, str, int, int, str]]:
        # nginx logs a request when it finalizes it, which can come after the client has its last byte
        # and the command has ended (seen under load): read until the log stops growing.
        lines = self.log_lines()
        for _ in range(40):
            time.sleep(0.05)
            again = self.log_lines()
            if len(again) == len(lines):
                break
            lines = again
        return lines[mark:]

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()] if children.exists() else []

    def has_open(self, path: Path) -> bool:
        """Whether an nginx worker holds ``path`` open right now (it is sending that file)."""
        target = os.path.realpath(path)
        for pid in self.worker_pids():
            fd_dir = Path(f"/proc/{pid}/fd")
            try:
                links = [os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)]
            except OSError:
                continue
            if target in links:
                return True
        return False

    def serve(self, save_dir: Path, name: str | None = None) -> tuple[Path, str]:
        """A copy of ``save_dir`` under the root: (the copy, its path in URLs)."""
        return serve(self, save_dir, name)

    def stop(self) -> None:
        _stop(self.proc, signal.SIGQUIT)  # graceful: workers finish, the master removes its pid file


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if found is None:
        raise RuntimeError("nginx is not installed: run scripts/env.sh (it installs the Debian package nginx)")
    return found


def start_nginx(work: Path) -> Nginx:
    """nginx serving ``work/www`` on a free port of 127.0.0.1, logging to ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    root = work / "www"
    root.mkdir(exist_ok=True)
    port = free_port()
    user = "user root;" if os.geteuid() == 0 else ""  # workers read files only the test's user may read
    conf = work / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(user=user, work=work, port=port, root=root))
    log = work / "error.log"
    proc = subprocess.Popen(
        [nginx_binary(), "-c", str(conf), "-p", str(work), "-e", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "stderr.log", "wb"),
    )
    _wait_for(f"http://127.0.0.1:{port}/", proc, "nginx", log)
    return Nginx(port, root, work, proc)


# --------------------------------------------------------------------------- moto's S3 server


@dataclass
class S3Server:
    """moto's standalone S3 server; ``env`` is what a user sets to reach it (fake credentials)."""

    port: int
    proc: subprocess.Popen
    log: Path
    _filesystem: object = field(default=None, repr=False, compare=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint,  # botocore's own setting for another S3 endpoint
        }

    def filesystem(self):
        """An s3fs filesystem on this server, for the tests' own uploads and listings (as a user would upload).
        One for the server's life: a new one made a botocore client again, 0.15 CPU-s and 0.3 s each, and the crash
        tests list the bucket a few times per kill. It caches no listing (``use_listings_cache=False``): every call
        asks the server."""
        if self._filesystem is None:
            import s3fs

            self._filesystem = s3fs.S3FileSystem(
                key="testing",
                secret="testing",
                endpoint_url=self.endpoint,
                client_kwargs={"region_name": "us-east-1"},
                skip_instance_cache=True,
                use_listings_cache=False,
            )
        return self._filesystem

    def upload(self, save_dir: Path, bucket: str = "ckpts") -> str:
        """``save_dir`` put into ``bucket`` with s3fs, as a user would upload it: its ``s3://`` URL."""
        return upload(self, save_dir, bucket)

    def stop(self) -> None:
        _stop(self.proc)


def start_s3(work: Path, env: dict[str, str] | None = None) -> S3Server:
    """moto's S3 server (``moto_server``, from the ``moto[server]`` test dependency, run by moto_s3.py) on a free
    port; ``env``: more environment for it (moto's own settings)."""
    work.mkdir(parents=True, exist_ok=True)
    binary = Path(sys.executable).with_name("moto_server")
    if not binary.exists():
        raise RuntimeError("moto_server is not installed: pip install 'moto[server]' (scripts/env.sh does)")
    port = free_port()
    log = work / "moto.log"
    proc = subprocess.Popen(
        # -P: the harness's folder is not put first on the path (its cache.py, compat.py... shadow no module of moto's)
        [sys.executable, "-P", str(Path(__file__).with_name("moto_s3.py")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    _wait_for(f"http://127.0.0.1:{port}/", proc, "moto_server", log)
    return S3Server(port, proc, log)


# --------------------------------------------------------------------------- putting checkpoints there

_names = itertools.count()


def serve(nginx: Nginx, save_dir: Path, name: str | None = None) -> tuple[Path, str]:
    """A copy of ``save_dir`` under nginx's root: (the copy, its path in URLs)."""
    name = name or f"ckpt{os.getpid()}-{next(_names)}"
    dest = nginx.root / name
    shutil.copytree(save_dir, dest)
    return dest, name


def upload(s3: S3Server, save_dir: Path, bucket: str = "ckpts") -> str:
    """``save_dir`` put into a bucket with s3fs, as a user would upload it: its ``s3://`` URL."""
    fs = s3.filesystem()
    if not fs.exists(bucket):
        # create_bucket without a location constraint (us-east-1's way): s3fs's mkdir sends one moto refuses
        import boto3

        boto3.client("s3", endpoint_url=s3.endpoint, **s3.credentials).create_bucket(Bucket=bucket)
        fs.invalidate_cache()
    key = f"{bucket}/ckpt{os.getpid()}-{next(_names)}"
    fs.put(str(save_dir), key, recursive=True)
    return f"s3://{key}"
