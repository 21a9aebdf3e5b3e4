"""A URI's scheme: the prefix before ``://`` names it; a plain path and every fsspec protocol are files."""

from __future__ import annotations

from marin_assets.curation.schemes.base import SourceUriError, UriScheme
from marin_assets.curation.schemes.files import FILES
from marin_assets.curation.schemes.hf import HF
from marin_assets.curation.schemes.installed_dists import INSTALLED_DISTS
from marin_assets.curation.schemes.pypi_sdist import PYPI_SDIST
from marin_assets.curation.schemes.urls import url_protocol

# The schemes a URI prefix names; any other prefix fsspec knows is read as files.
SCHEMES: dict[str, UriScheme] = {scheme.name: scheme for scheme in (PYPI_SDIST, INSTALLED_DISTS, HF)}
ALL_SCHEMES: tuple[UriScheme, ...] = (FILES, *SCHEMES.values())


def _fsspec_protocols() -> set[str]:
    import fsspec

    return set(fsspec.available_protocols()) | set(fsspec.registry)


def scheme_of(uri: str) -> UriScheme:
    """The scheme that lists, opens and checks ``uri``; `SourceUriError` (one line, naming the known
    schemes) for a prefix neither this registry nor fsspec knows."""
    prefix = url_protocol(uri)
    if prefix is None:
        return FILES  # a path (a "://" later in it is part of a file name)
    if prefix in SCHEMES:
        return SCHEMES[prefix]
    protocols = _fsspec_protocols()
    if prefix in protocols:
        return FILES
    raise SourceUriError(f"{uri}: unknown URI scheme {prefix!r}; known: {', '.join(sorted(SCHEMES))}, or a path "
                         f"or fsspec URL ({', '.join(sorted(protocols - set(SCHEMES)))})")
