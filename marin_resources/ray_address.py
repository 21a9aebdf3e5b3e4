"""The Ray cluster's address (RAY_ADDRESS) and the error of a cluster that does not answer: read both
when settings load and where a step connects (`ray_parallel`, imported only when Ray is chosen), so
they live apart from either."""

from marin_resources.typed_config import ConfigError


class RayUnavailableError(RuntimeError):
    """The Ray cluster named by RAY_ADDRESS does not answer."""


def ray_host_port(address: str) -> tuple[str, int]:
    """RAY_ADDRESS (``host:port`` or ``ray://host:port``) as (host, port); ValueError otherwise."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"RAY_ADDRESS must be host:port or ray://host:port, got {address!r}")
    return host.strip("[]"), int(port)
