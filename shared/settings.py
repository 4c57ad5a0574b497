"""One settings mechanism for every command: flags > DRIVETRAIN_* environment > profile > defaults.

Settings are pydantic-settings models with nested sections: a field `port` of the section
`gossip` is the flag `--gossip.port` and the variable `DRIVETRAIN_GOSSIP_PORT`. A field is
documented once, by the docstring under it, which `--help` and docs/configuration.md both show.
A profile is a named set of defaults (`local`, `compose`); each settings class may add its own
values to a profile, beside its fields, and a profile only fills what flags and environment left.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, is_dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "DRIVETRAIN_"
ProfileName = Literal["local", "compose"]
S = TypeVar("S", bound="Settings")


class Section(BaseModel):
    """A group of settings inside a command's settings (`kafka`, `gossip`, ...)."""

    # Extra keys are ignored: one environment is shared by every service of a machine, and a
    # variable one of them reads is no error for the others.
    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="ignore")


class Settings(BaseSettings):
    """The loader every command's settings derive from."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="_",
        env_nested_max_split=1,  # DRIVETRAIN_ENGINE_MAX_NUM_SEQS is engine.max_num_seqs
        frozen=True,
        extra="ignore",
        use_attribute_docstrings=True,
    )
    # Values a profile gives this class's fields, by profile name; merged down the class hierarchy.
    profiles: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The CLI source, when there is one, goes first; defaults come last.
        return init_settings, env_settings, ProfileSource(settings_cls)

    @classmethod
    def profile_values(cls, name: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            if isinstance(klass, type) and issubclass(klass, Settings):
                merged = _deep_merge(merged, klass.__dict__.get("profiles", {}).get(name, {}))
        return {key: value for key, value in merged.items() if key in cls.model_fields}


class ProfiledSettings(Settings):
    """Settings with a `profile`: services, whose defaults differ between one machine and a stack."""

    profile: ProfileName = "local"
    """named set of defaults: local (everything on loopback) | compose (the docker-compose stack)"""


class ProfileSource(PydanticBaseSettingsSource):
    """The chosen profile's values, under flags and environment (which may choose the profile)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if "profile" not in self.settings_cls.model_fields:
            return {}
        name = self.current_state.get("profile", "local")
        # An unknown name gets nothing here; validating `profile` then names the choices.
        return self.settings_cls.profile_values(name) if isinstance(name, str) else {}


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Flags ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, cls: type[Settings]) -> CliSettingsSource:
    """Adds one flag per setting (`--section.field-name`, with its variable and default in --help)."""
    return CliSettingsSource(
        cls,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,  # --enable-prefix-caching / --no-enable-prefix-caching
        cli_avoid_json=True,
        cli_show_env_vars=True,
        cli_use_class_docs_for_groups=True,
    )


def from_arguments(cls: type[S], source: CliSettingsSource, namespace: argparse.Namespace) -> S:
    """The settings from parsed flags, then environment, profile and defaults; SettingsError if invalid."""
    try:
        return cls(_cli_settings_source=source(parsed_args=namespace))
    except ValidationError as exc:
        raise SettingsError(cls, exc) from exc


def from_environment(cls: type[S]) -> S:
    """The settings from environment, profile and defaults alone (a command with no flags of its own)."""
    try:
        return cls()
    except ValidationError as exc:
        raise SettingsError(cls, exc) from exc


def load(cls: type[S], argv: list[str] | None = None) -> S:
    """Parse `argv` (the process's, when None) as this class's flags."""
    parser = argparse.ArgumentParser(description=cls.__doc__)
    source = add_arguments(parser, cls)
    return from_arguments(cls, source, parser.parse_args(argv))


class SettingsError(ValueError):
    """Settings that do not validate, one line per bad value, each named as its flag."""

    def __init__(self, cls: type[Settings], error: ValidationError) -> None:
        lines = []
        for item in error.errors():
            name = ".".join(str(part) for part in item["loc"])
            if not name:  # a check across settings
                lines.append(item["msg"])
                continue
            lines.append(f"--{name.replace('_', '-')} ({env_name(name)}): {item['msg']} (got {item.get('input')!r})")
        super().__init__(f"invalid settings for {cls.__name__}:\n  " + "\n  ".join(lines))


# Reference -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SettingDoc:
    name: str  # dotted: gossip.probe_interval
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.name)


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def setting_docs(cls: type[BaseModel] | type, prefix: str = "") -> Iterator[SettingDoc]:
    """Every setting of a class, sections expanded, in declaration order."""
    for name, info in _fields(cls).items():
        dotted = prefix + name
        kind = info.annotation
        if isinstance(kind, type) and (issubclass(kind, BaseModel) or is_dataclass(kind)):
            yield from setting_docs(kind, dotted + ".")
        else:
            yield SettingDoc(dotted, info.get_default(call_default_factory=True), info.description or "")


def _fields(cls: type) -> dict[str, FieldInfo]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return dict(cls.model_fields)
    return dict(cls.__pydantic_fields__)  # a pydantic dataclass


__all__ = [
    "ProfiledSettings",
    "Section",
    "Settings",
    "SettingsError",
    "add_arguments",
    "env_name",
    "from_arguments",
    "from_environment",
    "load",
    "setting_docs",
]
