"""A throwaway PostgreSQL server for tests and benchmarks (never a deployment's database): the distribution's server
binaries, a cluster of its own in a temporary directory, reached over a Unix socket there (no TCP port, so two
copies of the suite never meet), stopped and removed at the end. As root (a CI container) the server runs as
``nobody``: PostgreSQL refuses root."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path


def pg_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: on the PATH, else the distribution's versioned folder."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").exists():
            return Path(folder)
    return None


class Postgres:
    """One server: :meth:`start`, :meth:`restart`, :meth:`stop`; :attr:`dsn` reaches it."""

    def __init__(self) -> None:
        found = pg_bin()
        if found is None:
            raise FileNotFoundError("no PostgreSQL server binaries (initdb, pg_ctl): install the distribution's postgresql")
        self.bin = found
        self.dir = Path(tempfile.mkdtemp(prefix="tspg-"))  # short: a socket's path has ~100 bytes
        self.data, self.sock = self.dir / "data", self.dir
        self._as: list[str] = []
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            self._as = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
        os.chmod(self.dir, 0o700)
        self.dsn = f"host={self.sock} port=5432 user=ts dbname=postgres"

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=180, cwd=self.dir)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv[:2])}: rc {done.returncode}: {done.stdout[-1500:]} {done.stderr[-1500:]}")

    def start(self) -> "Postgres":
        if not self.data.exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "ts", "--no-sync",
                      "-E", "UTF8")
        opts = f"-c listen_addresses='' -k {self.sock} -p 5432 -c fsync=off -c max_connections=200"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", opts, "-w", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop("immediate")  # as a crash: in-flight transactions lost, WAL replayed
        self.start()

    def close(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def database(self, name: str) -> str:
        """A new database on this server (``name``: letters, digits, ``_``); its DSN."""
        import psycopg

        if not name.replace("_", "").isalnum():
            raise ValueError(f"{name!r} is not a database name this helper makes (letters, digits, _)")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn.replace("dbname=postgres", f"dbname={name}")

    def postmaster_pid(self) -> int:
        """The server's main process (its backends are its children)."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def log(self) -> str:
        path = self.dir / "log"
        return path.read_text(errors="replace") if path.exists() else ""


__all__ = ["Postgres", "pg_bin"]
