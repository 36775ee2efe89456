"""Ray checked before any worker starts: a joined cluster answers at ray.address and speaks Ray; an embedded
cluster's temp_dir can hold its sockets (a part of trainer/preflight.py)."""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig


_RAY_CONNECT_TIMEOUT_S = 5


def check_ray(cfg: ExperimentConfig) -> None:
    """A joined cluster answers at ray.address; an embedded cluster's temp_dir can hold Ray's sockets."""
    if cfg.ray.address is not None:
        check_ray_address(cfg.ray.address)
    elif cfg.ray.temp_dir is not None:
        check_ray_temp_dir(cfg.ray.temp_dir)


def check_ray_address(address: str) -> None:
    """A TCP connection to the cluster's GCS (or Ray client server) within a few seconds; ray.init would
    otherwise retry for a minute and end in a traceback."""
    import socket

    if address == "local":  # ray.init starts a cluster of its own
        return
    if address == "auto":
        # ray.init's own lookup: RAY_ADDRESS, the cluster `ray start` recorded, a local GCS process
        # (ray/_private/services.py canonicalize_bootstrap_address_or_die)
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            address = canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError:
            raise ConfigError("ray.address: 'auto' finds no running Ray cluster on this node (no RAY_ADDRESS, no "
                              "`ray start`); start one or give its host:port") from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address: expected host:port, ray://host:port or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise ConfigError(f"ray.address: no Ray cluster answers at {host}:{port} within "
                          f"{_RAY_CONNECT_TIMEOUT_S} s ({reason})") from None
    check_speaks_ray(address, f"{host}:{port}")


def check_speaks_ray(address: str, host_port: str) -> None:
    """What answers TCP at ``host_port`` is Ray: one gRPC call a Ray GCS serves (``ray://``: any gRPC
    answer, the client server's methods differ) within a few seconds. A proxy, a web server or another
    program would make ray.init retry for ~25 s and end in a ConnectionError traceback. Any gRPC status but
    "unavailable", "timed out" and (for a GCS) "unimplemented" is Ray's: e.g. UNAUTHENTICATED, whose cause
    ray.init names itself."""
    import grpc

    client = address.startswith("ray://")
    method = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # what ray.init asks a GCS first (empty request)
    with grpc.insecure_channel(host_port) as channel:
        call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(b"", timeout=_RAY_CONNECT_TIMEOUT_S)
            return
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
    bad = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
           *(() if client else (grpc.StatusCode.UNIMPLEMENTED,)))
    if code in bad:
        what = "a Ray client server" if client else "a Ray cluster (its GCS)"
        details = " ".join(details.split())
        details = details if len(details) <= 160 else details[:157] + "..."
        raise ConfigError(f"ray.address: {host_port} answers, but not as {what}: {code.name} ({details}); check "
                          "the address and port")


def check_ray_temp_dir(temp_dir: str) -> None:
    path = Path(os.path.abspath(temp_dir))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"ray.temp_dir: {temp_dir} is a file; Ray needs a folder there")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"ray.temp_dir: cannot create or write {temp_dir} ({existing} is not a writable folder)")
    from hybridflow.controller.cluster import AF_UNIX_PATH_MAX, MAX_TEMP_DIR_BYTES, RAY_SOCKET_TAIL  # lazy: Ray

    longest = len(str(path).encode()) + len(RAY_SOCKET_TAIL)
    if longest > AF_UNIX_PATH_MAX:
        raise ConfigError(f"ray.temp_dir: {temp_dir} is too long: Ray's socket paths in it reach {longest} bytes "
                          f"(<temp_dir>{RAY_SOCKET_TAIL}), over the {AF_UNIX_PATH_MAX}-byte limit of Unix sockets; "
                          f"keep the absolute path within {MAX_TEMP_DIR_BYTES} bytes")
