"""Images named by chat content parts: ``data:`` URLs, local files under an allowed directory,
and http(s) URLs from allowed hosts (vLLM's ``allowed_local_media_path`` and
``allowed_media_domains``), each decoded and checked here so a bad one is a ``ValueError``
naming it, never an error inside the engine."""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any
from urllib.parse import unquote, urlparse

from pagedlm.core import envs


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


def decode_image(data: bytes, source: str) -> Any:
    """Bytes -> a fully decoded RGB PIL image; ``ValueError`` naming ``source`` when they are not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url {source}: cannot decode the image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def load_image_url(url: str, *, allowed_local_media_path: str = "",
                   allowed_media_domains: list[str] | None = None) -> Any:
    """The image an ``image_url`` names, as an RGB PIL image."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "data":
        return decode_image(_data_url_bytes(url), _short(url))
    if scheme == "file":
        return decode_image(_local_file_bytes(unquote(parsed.path), allowed_local_media_path, url), _short(url))
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, parsed.hostname or "", allowed_media_domains), _short(url))
    raise ValueError(f"image_url {_short(url)!r}: scheme {scheme or '(none)'!r} is not supported; use a "
                     "data:image/...;base64 URL, file:// (under --allowed-local-media-path) or http(s):// "
                     "(from a host in --allowed-media-domains)")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"image_url {_short(url)!r}: a data URL must be data:image/<type>;base64,<data>")
    if not header.startswith("image/"):
        raise ValueError(f"image_url {_short(url)!r}: media type {header.removesuffix(';base64')!r} is not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image_url {_short(url)!r}: invalid base64 data ({e})") from None


def _local_file_bytes(path: str, allowed: str, url: str) -> bytes:
    if not allowed:
        raise ValueError(f"image_url {_short(url)!r}: local files are not allowed; start the engine with "
                         "--allowed-local-media-path DIR (LLM(allowed_local_media_path=DIR)) to allow files under DIR")
    root = os.path.realpath(allowed)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"image_url {_short(url)!r}: {path} is outside allowed_local_media_path={allowed!r}")
    try:
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"image_url {_short(url)!r}: cannot read {path}: {e.strerror}") from None


def _fetch(url: str, host: str, allowed_domains: list[str] | None) -> bytes:
    import urllib.request

    if not allowed_domains or host.lower() not in {d.lower() for d in allowed_domains}:
        raise ValueError(f"image_url {_short(url)!r}: fetching from {host!r} is not allowed; the engine fetches "
                         "http(s) images only from the hosts in --allowed-media-domains")
    limit = envs.max_image_fetch_bytes()
    try:
        with urllib.request.urlopen(url, timeout=envs.image_fetch_timeout_s()) as response:
            data = response.read(limit + 1)
    except OSError as e:  # URLError, timeouts and HTTP errors are OSErrors
        raise ValueError(f"image_url {_short(url)!r}: fetching failed ({type(e).__name__}: {e})") from None
    if len(data) > limit:
        raise ValueError(f"image_url {_short(url)!r}: the image is larger than {limit} bytes "
                         "(PAGEDLM_MAX_IMAGE_FETCH_BYTES)")
    return data
