"""One way to reach data: a local path or an `s3://bucket/key` URI -> (pyarrow FileSystem, path).

Local paths and object storage go through the same pyarrow filesystem calls everywhere (annotation
reads in Ray Data, image reads in the preprocessors, converters), so there is one code path.

Credentials are never part of the config. `resolve` reads them once, in the process that calls it (the
driver), from `data.storage.profile`, else `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
`AWS_SESSION_TOKEN`, else a static-key `AWS_PROFILE`, and the resulting `Storage` carries them to the Ray
workers it is pickled to: a worker's environment is fixed when Ray starts it, so keys exported in the
driver after `ray.init` (or only in the driver) would otherwise never reach it. With none of those, each
process falls back to the AWS SDK's own chain (instance role, web identity), which refreshes itself.
The keys are hidden from every repr, so printing a `Storage` or a settings object cannot leak them.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from dhp.errors import ConfigError, one_line


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str | None
    source: str  # where they came from ("environment", "profile NAME"): the only part ever shown

    def __repr__(self) -> str:
        return f"Credentials(from {self.source}, keys hidden)"

    __str__ = __repr__


@dataclass(frozen=True)
class Storage:
    """`data.storage` resolved against the environment: how every process reaches s3://."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    anonymous: bool = False
    max_attempts: int = 6
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    credentials: Credentials | None = field(default=None, repr=False)


def resolve(config: Any = None) -> Storage:
    """A `StorageConfig` (or None: defaults) + environment + profile files -> `Storage`.

    Precedence follows the AWS tools: config value, then AWS_* variables, then the profile's config.
    """
    if isinstance(config, Storage):
        return config

    def get(name: str, default: Any = None) -> Any:
        value = getattr(config, name, None)
        return default if value is None else value

    env = os.environ
    profile = get("profile") or env.get("AWS_PROFILE")
    anonymous = bool(get("anonymous", False))
    credentials = None
    if not anonymous:
        if get("profile"):
            credentials = _profile_credentials(profile)
            if credentials is None:
                raise ConfigError(
                    f"data.storage.profile={profile!r}: no such profile with aws_access_key_id and "
                    f"aws_secret_access_key in {_credentials_file()} or {_config_file()} (for role or SSO "
                    "profiles export the AWS_* variables instead)"
                )
        elif env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            credentials = Credentials(
                env["AWS_ACCESS_KEY_ID"],
                env["AWS_SECRET_ACCESS_KEY"],
                env.get("AWS_SESSION_TOKEN") or None,
                "environment",
            )
        elif profile:
            credentials = _profile_credentials(profile)  # None: left to the SDK chain in each process
    endpoint = get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint and ("://" not in endpoint or "@" in endpoint.split("://", 1)[1].split("/", 1)[0]):
        raise ConfigError(
            f"data.storage.endpoint_url must be http(s)://host[:port] without credentials, "
            f"got {endpoint.split('://')[0]}://..."
        )
    region = (
        get("region")
        or env.get("AWS_REGION")
        or env.get("AWS_DEFAULT_REGION")
        or _profile_value(profile or "default", "region")
    )
    return Storage(
        endpoint_url=endpoint,
        region=region,
        addressing_style=get("addressing_style", "auto"),
        anonymous=anonymous,
        max_attempts=int(get("max_attempts", 6)),
        connect_timeout_s=float(get("connect_timeout_s", 10.0)),
        request_timeout_s=float(get("request_timeout_s", 60.0)),
        credentials=credentials,
    )


class S3FileSystem(pafs.S3FileSystem):
    """pyarrow's S3 filesystem built from a `Storage`, and pickled as that `Storage`.

    pyarrow pickles an S3FileSystem without its retry strategy (a Ray worker would get the default,
    which retries connection errors only, not 5xx or throttling), so it is rebuilt from the whole
    `Storage` on the other side instead.
    """

    def __init__(self, storage: Storage):
        super().__init__(**_s3_options(storage))
        self.storage = storage

    def __reduce__(self) -> tuple:
        return (S3FileSystem, (self.storage,))


def s3_filesystem(storage: Any = None) -> S3FileSystem:
    return S3FileSystem(resolve(storage))


def _s3_options(s: Storage) -> dict[str, Any]:
    options: dict[str, Any] = {
        "anonymous": s.anonymous,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=s.max_attempts),
        "connect_timeout": s.connect_timeout_s,
        # The SDK's curl client counts a stalled request in whole seconds; below 1 it would never time out.
        "request_timeout": max(1.0, s.request_timeout_s),
        "force_virtual_addressing": s.addressing_style == "virtual",
    }
    if s.region:
        options["region"] = s.region
    if s.endpoint_url:
        scheme, _, host = s.endpoint_url.partition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme)
    elif s.addressing_style == "path":  # pyarrow addresses AWS virtual-host style unless given an endpoint
        options.update(endpoint_override=f"s3.{s.region or 'us-east-1'}.amazonaws.com", scheme="https")
    if s.credentials is not None:
        c = s.credentials
        options.update(access_key=c.access_key, secret_key=c.secret_key, session_token=c.session_token)
    return options


def is_uri(path: str) -> bool:
    return "://" in path


def scheme_of(uri: str) -> str:
    """'s3' for s3://..., '' for a local path."""
    return uri.split("://", 1)[0] if is_uri(uri) else ""


def filesystem(uri: str, storage: Any = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI (s3://bucket/key -> 'bucket/key').

    `storage` is a `Storage`, a `StorageConfig` (resolved here, in this process) or None (environment).
    """
    if uri.startswith("s3://"):
        path = uri[len("s3://") :]
        if not path.split("/", 1)[0]:
            raise ValueError(f"{uri!r} names no bucket (expected s3://bucket/key)")
        return S3FileSystem(resolve(storage)), path
    if is_uri(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def filesystem_of_all(uris: list[str], storage: Any = None) -> tuple[pafs.FileSystem, list[str]]:
    """One filesystem for several files (a Ray Data read takes one); they must share the URI scheme."""
    schemes = {scheme_of(u) or "local" for u in uris}
    if len(schemes) != 1:
        raise ConfigError(
            f"data.train/data.eval: one list mixes storage kinds ({', '.join(sorted(schemes))}); "
            "a split is read from one kind of storage"
        )
    fs = filesystem(uris[0], storage)[0]
    return fs, [filesystem(u, storage)[1] for u in uris]


def require_file(uri: str, storage: Any = None, what: str = "annotation file") -> int | None:
    """Raise a one-line FileNotFoundError naming `uri` unless it is a readable file or folder; its bytes (None:
    a folder)."""
    fs, path = filesystem(uri, storage)
    try:
        info = fs.get_file_info(path)
    except OSError as e:  # unreachable endpoint, access denied, retries used up
        raise FileNotFoundError(f"{what} {uri} cannot be read: {one_line(e)}") from None
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{what} not found: {uri}")
    return info.size if info.type == pafs.FileType.File else None


def _credentials_file() -> Path:
    return Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")).expanduser()


def _config_file() -> Path:
    return Path(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")).expanduser()


def _profile_sections(profile: str) -> list[configparser.SectionProxy]:
    """The profile's section in the credentials file, then in the config file ([profile NAME] there)."""
    sections = []
    for path, name in (
        (_credentials_file(), profile),
        (_config_file(), profile if profile == "default" else f"profile {profile}"),
    ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_section(name):
            sections.append(parser[name])
    return sections


def _profile_value(profile: str, key: str) -> str | None:
    return next((s[key] for s in _profile_sections(profile) if s.get(key)), None)


def _profile_credentials(profile: str) -> Credentials | None:
    for section in _profile_sections(profile):
        if section.get("aws_access_key_id") and section.get("aws_secret_access_key"):
            return Credentials(
                section["aws_access_key_id"],
                section["aws_secret_access_key"],
                section.get("aws_session_token") or None,
                f"profile {profile}",
            )
    return None
