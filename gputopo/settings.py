"""Settings of a binary: one pydantic model, filled from flags > environment > YAML file > defaults.

The precedence is resolved here rather than inside click so that every value remembers where it came from, and an
invalid one is reported with its setting and its source ("metrics_port from GPUPLUGIN_METRICS_PORT: ..."): a
DaemonSet has three places a bad value can hide in. The model is the one description of a setting: its type,
default and `Field(description=...)` also make the click option (`SettingsLoader.command`), so `--help` cannot
drift from what is loaded, and pydantic is the one validator whichever place a value came from.

Names, the same scheme for every binary: a setting's flag is `--<name>` (the field name with '-' for '_', unless
`Cli(flag=...)` says otherwise); its environment variable `<PREFIX>_<NAME>` (upper case, '_'), then any extra names
in `Cli(env=...)`; its YAML key in the `--config` file (`<PREFIX>_CONFIG`) the flag name, with '-' or '_';
`--print-config` prints the same keys with '_'.

A bad setting, including a file that is missing or unreadable, is a usage error: exit 2 with the message.
"""

from __future__ import annotations

import functools
import json
import os
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import click
import yaml
from click.types import OptionHelpExtra
from pydantic import AfterValidator, BaseModel, BeforeValidator, ValidationError
from pydantic.fields import FieldInfo

from gputopo.contract import dns_subdomain_problem, extended_resource_problem, prefix_problem
from gputopo.logs import LogLevel as _Levels

M = TypeVar("M", bound=BaseModel)
# A YAML config file is a handful of settings: anything bigger is not one.
MAX_CONFIG_BYTES = 1024 * 1024


def lease_timing_problem(lease_duration_s: int, renew_deadline_s: int, retry_period_s: int) -> str | None:
    """What client-go (and the official Python client, which exits the process instead) requires of a leader
    election's three durations; here so that a settings model can check them without importing a client."""
    if min(lease_duration_s, renew_deadline_s, retry_period_s) < 1:
        return "leader election durations must be at least 1 s"
    if lease_duration_s <= renew_deadline_s:
        return (f"the lease duration ({lease_duration_s} s) must be longer than the renew deadline "
                f"({renew_deadline_s} s)")
    if renew_deadline_s <= 1.2 * retry_period_s:
        return (f"the renew deadline ({renew_deadline_s} s) must be longer than 1.2 x the retry period "
                f"({retry_period_s} s)")
    return None


@dataclass(frozen=True)
class Cli:
    """`Annotated` metadata of a setting whose flag differs from its field name, which also reads other environment
    variables (after `<PREFIX>_<NAME>`), or whose type does not say its metavar."""

    flag: str | None = None
    env: tuple[str, ...] = ()
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other flags for it, as another program spells them (a migration keeps its args)


class SettingsError(ValueError):
    """An invalid setting. `field` is the setting's key, `source` where its value came from (flag, environment
    variable or config file)."""

    def __init__(self, message: str, field: str | None = None, source: str | None = None) -> None:
        self.field = field
        self.source = source
        super().__init__(message)


def comma_list(value: Any, what: str) -> tuple[str, ...]:
    """A list setting as a flag or environment variable gives it ("a,b"; "" as the chart's empty list: none) or a
    config file does (a YAML list): its items stripped, empty ones dropped, each once, in order."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"must be a comma-separated list of {what}, got {value!r:.80}")
    return tuple(dict.fromkeys(item.strip() for item in value if item.strip()))


def _readable_file(path: Path) -> Path:
    if not path.exists():
        raise ValueError(f"file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"file {str(path)!r} is not readable")
    return path


# A path that must name a readable file when the settings are loaded, so a typo fails at once, naming the path.
ReadableFile = Annotated[Path, AfterValidator(_readable_file), Cli(metavar="FILE")]


def _no_problem(problem: Callable[[str], str | None]) -> AfterValidator:
    """A validator raising what `problem` finds wrong with a value (the contract's rules, one wording)."""

    def check(value: str) -> str:
        found = problem(value)
        if found:
            raise ValueError(found)
        return value

    return AfterValidator(check)


def _empty_is_none(value: Any) -> Any:
    return None if value == "" else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port (0-65535)")
    return value


# Settings that mean the same in every binary, checked the same way.
AnnotationPrefix = Annotated[str, _no_problem(prefix_problem), Cli(metavar="PREFIX")]
ExtendedResourceName = Annotated[str, _no_problem(extended_resource_problem), Cli(metavar="DOMAIN/NAME")]
DnsSubdomain = Annotated[str, _no_problem(dns_subdomain_problem), Cli(metavar="NAME")]
# A node name that may be left unset (an empty environment variable counts as unset).
NodeName = Annotated[DnsSubdomain | None, BeforeValidator(_empty_is_none), Cli(env=("NODE_NAME",))]
LogLevel = Annotated[_Levels, BeforeValidator(_lower)]
Port = Annotated[int, AfterValidator(_port)]  # 0 where a listener is optional: off


def _cli(metadata: list[Any] | tuple[Any, ...]) -> Cli:
    return next((m for m in metadata if isinstance(m, Cli)), Cli())


def metavar(annotation: Any) -> str:
    """What `--help` shows for a value of this type: INTEGER, FLOAT, TEXT, PATH, [a|b] for choices."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return _cli(args[1:]).metavar or metavar(args[0])
    if origin in (Union, types.UnionType):
        parts = [metavar(a) for a in args if a is not type(None)]
        return parts[0] if len(parts) == 1 else "|".join(p.strip("[]") for p in parts)
    if origin is Literal:
        return "[" + "|".join(str(a) for a in args) + "]"
    if origin is tuple:
        return f"{metavar(args[0])},..."
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "[" + "|".join(str(m.value) for m in annotation) + "]"
    names = {bool: "BOOLEAN", int: "INTEGER", float: "FLOAT", str: "TEXT", Path: "PATH"}
    return names.get(annotation, "TEXT")


def _text(value: Any) -> str:
    """A default as a user would type it."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, (tuple, list, frozenset, set)):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass(frozen=True)
class Setting:
    """One field of a settings model with its public names."""

    field: str
    info: FieldInfo
    flag: str  # without the leading dashes
    env: tuple[str, ...]
    metavar: str
    aliases: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def is_bool(self) -> bool:
        """A flag pair --x/--no-x (a setting that may also be "auto" gets that from the environment or file)."""
        annotation = self.info.annotation
        return annotation is bool or bool in get_args(annotation)

    def option(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The click option: no default of its own (None = not given), its metavar, default and environment
        variables shown from the model."""
        default = self.info.get_default(call_default_factory=True)
        if default is None:
            shown = None
        elif isinstance(default, bool):
            shown = self.flag if default else f"no-{self.flag}"
        else:
            shown = _text(default)
        decls = [f"--{self.flag}/--no-{self.flag}" if self.is_bool else f"--{self.flag}",
                 *(f"--{a}" for a in self.aliases), self.field]
        return click.option(
            *decls,
            cls=SettingOption,
            default=None,
            type=None if self.is_bool else str,
            metavar=None if self.is_bool else self.metavar,
            help=self.info.description,
            envvars=self.env,
            default_text=shown,
        )


class SettingOption(click.Option):
    """A click option whose help shows the model's default and the environment variables the loader reads (click
    itself reads neither: the loader does, to know each value's source)."""

    def __init__(self, *args: Any, envvars: tuple[str, ...] = (), default_text: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting_envvars = envvars
        self.default_text = default_text

    def get_help_extra(self, ctx: click.Context) -> OptionHelpExtra:
        extra: OptionHelpExtra = {"envvars": self.setting_envvars}
        if self.default_text is not None:
            extra["default"] = self.default_text
        return extra


class SettingsLoader(Generic[M]):
    """Loads one binary's settings model (`model`) with environment prefix `prefix` (e.g. "GPUPLUGIN")."""

    def __init__(self, model: type[M], prefix: str) -> None:
        self.model = model
        self.prefix = prefix.rstrip("_")
        self.config_env = f"{self.prefix}_CONFIG"
        settings = []
        # the model's own settings first, then those it inherits (listener limits shared by two binaries)
        inherited = {name for base in model.__mro__[1:] for name in getattr(base, "__annotations__", {})}
        fields = sorted(model.model_fields.items(), key=lambda item: item[0] in inherited)
        for name, info in fields:
            cli = _cli(info.metadata)
            flag = cli.flag or name.replace("_", "-")
            env = (f"{self.prefix}_{flag.replace('-', '_').upper()}", *cli.env)
            settings.append(Setting(name, info, flag, env, cli.metavar or metavar(info.annotation), cli.aliases))
        self.settings: tuple[Setting, ...] = tuple(settings)
        self._by_key = {s.key: s for s in self.settings}
        clash = {"config", "print_config", "config_file"} & (set(self._by_key) | set(model.model_fields))
        if clash:
            raise TypeError(f"{model.__name__}: {sorted(clash)} are the loader's own options")

    # --- loading ------------------------------------------------------------------------------------------------

    def read_file(self, path: Path, source: str | None = None) -> dict[str, Any]:
        """The YAML file's settings by field name. Unknown keys are errors (a typo would otherwise silently fall
        back to a default)."""
        via = f" (from {source})" if source and source != "--config" else ""
        where = f"config file {path}{via}"
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise SettingsError(f"cannot read {where}: {e.strerror or e}", "config", str(path)) from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise SettingsError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes", "config", str(path))
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise SettingsError(f"{where} is not valid YAML: {e}", "config", str(path)) from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingsError(f"{where} must hold a mapping of settings, not {type(data).__name__}", "config",
                                str(path))
        out: dict[str, Any] = {}
        for key, value in data.items():
            setting = self._by_key.get(str(key).replace("-", "_"))
            if setting is None:
                known = ", ".join(s.flag for s in self.settings)
                raise SettingsError(f"{where}: unknown setting {key!r} (known: {known})", str(key), str(path))
            out[setting.field] = value
        return out

    def load(self, flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
             config_file: Path | str | None = None) -> M:
        """Settings from `flags` (by field name; None = not given), then `env`, then the YAML file (`config_file`,
        else `<PREFIX>_CONFIG`), then defaults. Raises SettingsError naming the first invalid setting and where its
        value came from."""
        env = os.environ if env is None else env
        unknown = set(flags) - set(self.model.model_fields)
        if unknown:
            raise SettingsError(f"unknown settings: {', '.join(sorted(unknown))}")
        file_source = "--config" if config_file is not None else self.config_env
        if config_file is None and env.get(self.config_env):
            config_file = env[self.config_env]
        file_values = self.read_file(Path(config_file), file_source) if config_file is not None else {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for s in self.settings:
            if flags.get(s.field) is not None:
                values[s.field], sources[s.field] = flags[s.field], f"--{s.flag}"
                continue
            name = next((n for n in s.env if env.get(n) not in (None, "")), None)
            if name is not None:
                values[s.field], sources[s.field] = env[name], name
            elif s.field in file_values:
                values[s.field], sources[s.field] = file_values[s.field], f"config file {config_file}"
        try:
            return self.model(**values)
        except ValidationError as e:
            raise self._error(e, values, sources) from None

    def _error(self, e: ValidationError, values: dict[str, Any], sources: dict[str, str]) -> SettingsError:
        err = e.errors()[0]
        message = str(err["msg"]).removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else None
        if field is None:  # a rule across settings: say where the settings it names came from
            named = [s for s in self.settings if s.field in sources and sources[s.field] != f"--{s.flag}"
                     and re.search(rf"(?<![\w-])(?:--)?{re.escape(s.flag)}(?![\w-])", message)]
            given = ", ".join(f"{s.key} from {sources[s.field]}" for s in named)
            return SettingsError(f"invalid configuration: {message}" + (f" ({given})" if given else ""))
        key = next((s.key for s in self.settings if s.field == field), field)
        source = sources.get(field, "")
        where = f" from {source}" if source else ""
        got = f" (got {values[field]!r})" if field in values and str(values[field]) not in message else ""
        return SettingsError(f"invalid {key}{where}: {message}{got}", key, source)

    # --- output and command line --------------------------------------------------------------------------------

    def dump(self, settings: M) -> dict[str, Any]:
        """Every resolved value by its key, as JSON types (what `--print-config` prints)."""
        values = settings.model_dump(mode="json")
        return {s.key: values[s.field] for s in self.settings}

    def dump_json(self, settings: M) -> str:
        return json.dumps(self.dump(settings), indent=2)

    @property
    def epilog(self) -> str:
        return (f"Every setting: flag > environment ({self.prefix}_<FLAG>) > config file (--config or "
                f"{self.config_env}: YAML, keys are the flag names) > default. A bad setting exits 2.")

    def command(self, fn: Callable[[M], None]) -> Callable[..., None]:
        """Decorate a click command's function taking the loaded settings: adds --config, an option per setting
        and --print-config; an invalid setting is a usage error (exit 2) naming it and its source."""

        @functools.wraps(fn)
        def run(config_file: Path | None, print_config: bool, **flags: Any) -> None:
            try:
                settings = self.load(flags, config_file=config_file)
            except SettingsError as e:
                raise click.UsageError(str(e)) from None
            if print_config:
                click.echo(self.dump_json(settings))
                return
            fn(settings)

        options = [
            click.option("--config", "config_file", type=click.Path(path_type=Path), default=None, metavar="FILE",
                         cls=SettingOption, envvars=(self.config_env,),
                         help="YAML file of settings (keys: the flag names)."),
            *(s.option() for s in self.settings),
            click.option("--print-config", is_flag=True, help="Print every resolved setting as JSON and exit."),
        ]
        decorated: Callable[..., None] = run
        for option in reversed(options):
            decorated = option(decorated)
        return decorated
