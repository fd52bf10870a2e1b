"""Reloading the configuration without a restart.

:class:`Reloader` (``app.reloader``) loads a config -- the file again, or a
proposed text for it -- and validates it completely off the event loop (a
worker thread: reading, decoding, the checks between sections, building every
policy once). If it is not valid, or changes something a running worker cannot
change (:func:`needs_restart`), the running configuration stays and the refusal
is one line naming the file and the key, the format of
:func:`~.config.load_config`. If it is valid, the app builds the new
:class:`~.runtime.Runtime` (reusing the adapters whose settings did not change)
and swaps it in: new requests use it, requests in flight finish on the one
they started with. Reloads run one at a time.

Who asks: ``POST /admin/config/reload`` (``api:<key id>``, or ``api:loopback``
with auth off), the file watcher (``watch``, every ``[server] reload_watch_s``
seconds when the file, its keys file, a rule pack file or an adapter's TLS file it
names changed), and
other callers of :meth:`Reloader.reload` (``console:<...>``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from .adapters.settings import UpstreamTLS
from .config import (
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    default_config_text,
    load_config,
    parse_config,
)
from .core.decoding import config_roots, confined

log = logging.getLogger("aiserve_trio.reload")

#: What a running worker cannot change: its session bus and write-back (built
#: once, holding connections and the outbox), the rate limiter's backend and the
#: stream-token secret (state every request shares), and the tables read once at
#: start-up (tracing exporter, baselines, scheduler probe, the recorder's files).
#: ``(table, keys)``; no keys: the whole table.
RESTART_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "sessions",
        (
            "backend",
            "url",
            "pool_size",
            "follow_pool_size",
            "connect_timeout_ms",
            "max_sessions",
            "max_bytes",
            "max_session_bytes",
            "max_turns",
            "key_prefix",
            "outbox_max",
            "outbox_retry_ms",
            "outbox_retry_max_ms",
        ),
    ),
    ("auth", ("token_secret_env", "ratelimit_backend")),
    ("observability", ()),
    ("record", ()),
    ("audit", ()),
)


@dataclass(frozen=True)
class ReloadResult:
    """What one :meth:`Reloader.reload` did."""

    #: True when the new config is now active.
    applied: bool
    #: The version of the active config after the call.
    version: str
    #: The one-line refusal (file and key); None when applied or unchanged.
    error: str | None
    #: The candidate equals the active config (nothing was swapped).
    unchanged: bool = False


class Staged(Protocol):
    """A runtime built and opened for a new config, not yet serving."""

    def commit(self) -> None:
        """Swap it in: new requests use it from now on."""
        ...

    async def abandon(self) -> None:
        """Close what it opened that the running config does not use."""
        ...


class Target(Protocol):
    """What the reloader reloads (the app)."""

    @property
    def config(self) -> Config: ...

    async def stage(self, config: Config) -> Staged:
        """Build and open the runtime of ``config``.

        Raises:
            ConfigError: something of it cannot be opened (naming the file and key).
        """
        ...

    def draining(self) -> int:
        """Runtimes replaced by a reload that still finish requests."""
        ...


def config_version(config: Config) -> str:
    """A hash of the configuration as loaded: every setting (the keys of a keys
    file included) and the bytes of the rule pack files it names. Comments and
    formatting do not count: the same settings are the same version."""
    h = hashlib.blake2b(digest_size=8)
    h.update(msgspec.json.encode(msgspec.to_builtins(config, order="sorted")))
    for path in _pack_files(config):
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"\0unreadable")
    return h.hexdigest()


def _pack_files(config: Config) -> list[Path]:
    """The rule pack files (not the shipped packs) the config's policies name:
    those it may read (``decoding.confined``), for a version must not tell about others."""
    out = []
    roots = config_roots(config.source, config.base_dir, config.server.config_paths)
    for spec in config.policy_specs.values():
        ref = getattr(spec.settings, "pack", None)
        if isinstance(ref, str) and ("/" in ref or ref.endswith(".toml")):
            path = Path(ref)
            path = path if path.is_absolute() else Path(config.base_dir) / path
            if confined(str(path), roots):
                out.append(path)
    return out


def watched_files(config: Config) -> list[Path]:
    """The files a config was loaded from: the file, its keys file, its rule pack files,
    its adapters' TLS files."""
    if not _from_file(config):
        return []
    files = [Path(config.source)]
    if config.auth is not None and config.auth.keys_file is not None:
        files.append(Path(config.base_dir) / config.auth.keys_file)
    return files + _pack_files(config) + _tls_files(config)


def _tls_files(config: Config) -> list[Path]:
    """The adapters' TLS files (``ca_file``, ``client_cert``, ``client_key``), absolute."""
    out = []
    for adapter in config.adapters.values():
        if isinstance(adapter, UpstreamTLS):
            for path in (adapter.ca_file, adapter.client_cert, adapter.client_key):
                if path is not None:
                    out.append(Path(path))
    return out


def signature(files: list[Path]) -> tuple[tuple[int, int, int, int] | None, ...]:
    """What changes when one of ``files`` is written or replaced (None: missing)."""
    out: list[tuple[int, int, int, int] | None] = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns))
    return tuple(out)


def needs_restart(old: Config, new: Config) -> str | None:
    """The first key that changed and only takes effect with a restart, as a refusal line."""
    for table, keys in RESTART_KEYS:
        before, after = getattr(old, table), getattr(new, table)
        if not keys:
            if before != after:
                return _restart(new, table)
            continue
        for key in keys:
            if getattr(before, key, None) != getattr(after, key, None):
                return _restart(new, f"{table}.{key}")
    return None


def _restart(config: Config, key: str) -> str:
    return (
        f"{config.source}: key `{key}`: changed, and a running worker cannot change it; "
        "restart the server to apply it (the running configuration stays)"
    )


class _ServerPaths(msgspec.Struct):
    config_paths: list[str] = msgspec.field(default_factory=list)


class _Paths(msgspec.Struct):
    server: _ServerPaths = msgspec.field(default_factory=_ServerPaths)


def check_config_paths(current: Config, candidate: str) -> None:
    """Refuse a proposed config that changes ``[server] config_paths``, before it is loaded.

    The folders a config may read files from are widened on disk only: otherwise
    a proposal could first allow ``/`` and then name any file as its keys file.

    Raises:
        ConfigError: it changes them (text that is not TOML is left to the loader).
    """
    try:
        proposed = msgspec.toml.decode(candidate.encode(), type=_Paths).server.config_paths
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if proposed != current.server.config_paths:
        raise ConfigError(
            f"{current.source}: key `server.config_paths`: changed only by editing the "
            "file on disk, not by a reload over HTTP"
        )


def _from_file(config: Config) -> bool:
    return not config.source.startswith("<")


def _embedded(config: Config) -> bool:
    return config.source == f"<embedded {DEFAULT_CONFIG_NAME}>"


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text``: a temporary file in the same
    folder, synced, then renamed over it (a reader sees the old file or the new
    one, never half of one). The file keeps its permission bits."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load(config: Config) -> Config:
    """The config ``config`` was loaded from, loaded again (in a worker thread)."""
    if _embedded(config):
        return parse_config(default_config_text(), source=config.source)
    return load_config(config.source)


@dataclass(frozen=True)
class _Attempt:
    at: float
    by: str
    error: str


class Reloader:
    """Reloads the app's configuration (see the module docstring); one reload at a time."""

    def __init__(self, target: Target, count: Callable[[str], None] | None = None) -> None:
        """Args:
        target: the app.
        count: told ``applied``, ``refused`` or ``unchanged`` after each reload
            (the Prometheus counter).
        """
        self._target = target
        self._count = count or (lambda _result: None)
        self._lock = trio.Lock()
        config = target.config
        self.version = config_version(config)
        self.loaded_at = time.time()
        self.loaded_by = "startup"
        self.last_refused: _Attempt | None = None
        #: Set (and replaced) whenever a new config is applied: the watcher re-reads its interval.
        self._applied = trio.Event()
        self._seen = signature(watched_files(config))

    async def reload(self, *, by: str, candidate: str | None = None) -> ReloadResult:
        """Load, validate and apply a config; on any problem the running one stays.

        Args:
            by: who asks (``api:<key id>``, ``api:loopback``, ``watch``, ``console:<...>``).
            candidate: None: re-read the config file (``Config.source``). Else the
                TOML text proposed as the file's new content: validated completely
                and, if valid, written to the file atomically (a temporary file and
                a rename in the same folder) and applied; if not, nothing is written.
        """
        # Shielded: a reload is short, and one cancelled half-way (its caller gone)
        # would leave adapters it opened behind.
        result: ReloadResult | None = None
        with trio.CancelScope(shield=True):
            async with self._lock:
                result = await self._locked(by, candidate)
        assert result is not None  # a shielded scope is never cancelled
        return result

    async def _locked(self, by: str, candidate: str | None) -> ReloadResult:
        try:
            return await self._reload(by, candidate)
        except ConfigError as exc:
            error = str(exc)
            self.last_refused = _Attempt(time.time(), by, error)
            self._count("refused")
            log.warning("config reload by %s refused: %s", by, error)
            return ReloadResult(applied=False, version=self.version, error=error)

    async def _reload(self, by: str, candidate: str | None) -> ReloadResult:
        current = self._target.config
        path: Path | None = None
        if candidate is None:
            if not _from_file(current) and not _embedded(current):
                why = "was not loaded from a file: there is nothing to read again"
                raise ConfigError(f"{current.source}: the configuration {why}")
            new = await trio.to_thread.run_sync(_load, current)
        else:
            if not _from_file(current):
                raise ConfigError(
                    f"{current.source}: started on the embedded default; "
                    "start with a config file to save"
                )
            path = Path(current.source)
            check_config_paths(current, candidate)
            parse = partial(parse_config, candidate, source=str(path), base_dir=path.parent)
            new = await trio.to_thread.run_sync(parse)
        version = await trio.to_thread.run_sync(config_version, new)
        if version == self.version:
            if path is not None and candidate is not None:
                # Only comments or formatting differ: keep the text as proposed.
                await self._write(path, candidate)
            self._seen = signature(watched_files(new))
            self._count("unchanged")
            log.info("config reload by %s: unchanged (version %s)", by, version)
            return ReloadResult(applied=False, version=version, error=None, unchanged=True)
        problem = needs_restart(current, new)
        if problem is not None:
            raise ConfigError(problem)
        staged = await self._target.stage(new)
        if path is not None and candidate is not None:
            try:
                await self._write(path, candidate)
            except ConfigError:
                await staged.abandon()
                raise
        staged.commit()
        previous, self.version = self.version, version
        self.loaded_at = time.time()
        self.loaded_by = by
        self._seen = signature(watched_files(new))
        self._applied.set()
        self._applied = trio.Event()
        self._count("applied")
        log.info(
            "config reloaded by %s from %s: version %s -> %s", by, new.source, previous, version
        )
        return ReloadResult(applied=True, version=version, error=None)

    @staticmethod
    async def _write(path: Path, text: str) -> None:
        try:
            await trio.to_thread.run_sync(write_atomically, path, text)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot write the config file: {exc.strerror}") from exc

    def status(self) -> dict[str, object]:
        """What ``GET /admin/config`` returns: the active version and the last refusal."""
        config = self._target.config
        refused = self.last_refused
        return {
            "version": self.version,
            "source": config.source,
            "loaded_at": _iso(self.loaded_at),
            "loaded_by": self.loaded_by,
            "watch_s": config.server.reload_watch_s if _from_file(config) else 0.0,
            "draining": self._target.draining(),
            "last_refused": None
            if refused is None
            else {"at": _iso(refused.at), "by": refused.by, "error": refused.error},
        }

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reload when the config's files change, every ``[server] reload_watch_s`` seconds.

        A change is a new modification time, size or inode of the file, its keys
        file or a rule pack file it names (an editor's rename counts). A refused
        file is not tried again until it changes again.
        """
        task_status.started()
        while True:
            config = self._target.config
            interval = config.server.reload_watch_s if _from_file(config) else 0.0
            if interval <= 0:
                await self._applied.wait()  # off: until a reload turns it on
                continue
            await trio.sleep(interval)
            seen = signature(watched_files(self._target.config))
            if seen != self._seen:
                self._seen = seen
                await self.reload(by="watch")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
