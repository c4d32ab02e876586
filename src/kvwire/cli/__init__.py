"""The `kvwire` command: `check`, `connectors`, `profiles`, `run` and `replay`.

`kvwire check PROFILE` validates a profile, resolves its connector (with the
constructor check), validates its `kv_connector_extra_config` through the
class's `validate_extra_config` (a composite's covers its children; nothing
is built), applies the HMA gate and says what it decided and why; any failure
is printed as its error text and the exit status is 1. Checking imports the
connector's module (and each child's): that runs the plugin's code, so check
only profiles and plugins you trust. Nothing it prints shows a secret
(`kvwire.common.redaction`).
`kvwire connectors` lists every known connector without importing any;
`--resolve` imports each one to say whether it supports HMA. `kvwire profiles`
lists the profiles kvwire ships, which every command takes by name
(`kvwire check redis`); `--show NAME` prints one, to copy and edit. `kvwire run`
and `kvwire replay` live in their own packages (`kvwire.run`, `kvwire.replay`),
each imported only when asked for.
`--log-level` is accepted before or after the command; `--version` prints
the installed version.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import NoReturn, TextIO

from kvwire.cli.start_refusals import refuse_at_start
from kvwire.common.plugin_calls import PluginExit, contained_exits, plugin_message
from kvwire.common.redaction import (
    SHOWN_LENGTH,
    RedactingFilter,
    kind_of,
    scrub,
    secret_values,
    shown,
)
from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.config.profile import (
    profile_origin,
    profile_path,
    read_profile_file,
    shipped_profile_names,
    shipped_profile_path,
    structure_engine_config,
)
from kvwire.exceptions import KVWireError
from kvwire.hma import decide_hma, describe_class_support, describe_kv_cache_groups
from kvwire.interface.base import KVConnectorBase, validates_extra_config
from kvwire.registry import (
    ConnectorRegistry,
    accepts_connector_builder,
    default_registry,
)

RUN_MODULE = "kvwire.run"
REPLAY_MODULE = "kvwire.replay"
# The shell's status for a program ended by SIGINT (128 + 2).
INTERRUPTED = 130
# And by SIGPIPE (128 + 13): what a writer into a closed pipe ends with.
PIPE_CLOSED = 141

# What a user can get wrong in a profile or a plugin; anything else is a bug
# and keeps its traceback.
_USER_ERRORS = (KVWireError, ValueError, TypeError, AttributeError, ImportError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvwire` console script; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    first = _first_command(arguments)
    parser = build_parser(wants_run=first == "run", wants_replay=first == "replay")
    with_nul = _argument_with_nul(arguments)
    if with_nul is not None:
        # open() would only say "embedded null byte", naming nothing.
        parser.error(f"{with_nul} contains a NUL byte (\\x00), which no path or name can hold")
    args = parser.parse_args(arguments)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    command: Callable[[argparse.Namespace], int] = args.command
    try:
        status = command(args)
        # Now, not at exit: a reader gone (`kvwire profiles | head -1`) is seen here.
        sys.stdout.flush()
    except KeyboardInterrupt:
        # The user's Ctrl-C (a plug-in raising KeyboardInterrupt itself is
        # reported as the plug-in's error, kvwire.common.plugin_calls.contained_exits):
        # stop at once, as a shell expects, without a traceback.
        print("kvwire: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader closed the pipe: nothing is left to say to anyone. What is
        # still buffered goes nowhere, so the interpreter's last flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_CLOSED
    return status


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with what its usage errors quote cut short.

    argparse quotes a wrong value whole (an invalid choice, an unknown
    command, unrecognized arguments), however long it is.
    """

    def error(self, message: str) -> NoReturn:
        super().error(_LONG_RUN.sub(_cut_short, message))


# Longer than any option, choice or path a usage error needs to show whole.
_LONG_RUN = re.compile(rf"\S{{{SHOWN_LENGTH + 1},}}")


def _cut_short(run: re.Match[str]) -> str:
    text = run.group(0)
    if text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # argparse's own quotes; shown() quotes it again
    return shown(text)


def build_parser(*, wants_run: bool = False, wants_replay: bool = False) -> argparse.ArgumentParser:
    """The argument parser; `kvwire.run` adds `run`'s options only when `wants_run`,
    `kvwire.replay` `replay`'s only when `wants_replay`."""
    parser = _Parser(
        prog="kvwire", description="Build and check KV-cache connectors for LLM inference engines."
    )
    parser.add_argument("--version", action="version", version=f"kvwire {_version()}")
    _add_log_level(parser, default=DEFAULT_LOG_LEVEL)
    parser.epilog = PROFILE_NAMES_HELP
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    check = commands.add_parser(
        "check",
        help="validate a profile, resolve its connector and apply the HMA gate "
        "(imports the connector's module: runs its code)",
        description=CHECK_DESCRIPTION,
        epilog=PROFILE_NAMES_HELP,
    )
    check.add_argument(
        "profiles",
        nargs="+",
        metavar="PROFILE",
        help="a shipped profile's name (kvwire profiles lists them) or a YAML file's path",
    )
    check.set_defaults(command=_check_command)

    connectors = commands.add_parser(
        "connectors", help="list every known connector, and the media offload connectors use"
    )
    connectors.add_argument(
        "--resolve",
        action="store_true",
        help="import each connector to say whether it supports HMA",
    )
    connectors.set_defaults(command=_connectors_command)

    profiles = commands.add_parser(
        "profiles",
        help="list the profiles kvwire ships, which every command takes by name",
        epilog=PROFILE_NAMES_HELP,
    )
    profiles.add_argument(
        "--show", metavar="NAME", help="print that profile's YAML (to copy it and edit the copy)"
    )
    profiles.set_defaults(command=_profiles_command)

    run = commands.add_parser("run", help="run a workload through the engine with a connector")
    if wants_run:
        try:
            run_package = _run_module()
        except ModuleNotFoundError as error:
            if error.name != RUN_MODULE:
                raise
            run.add_argument("run_arguments", nargs=argparse.REMAINDER)
            run.set_defaults(command=_run_missing)
        else:
            run_package.configure_parser(run)
            run.set_defaults(command=_run_command)
    replay = commands.add_parser(
        "replay", help="size a CPU pool and pick its policy from a request trace"
    )
    if wants_replay:
        importlib.import_module(REPLAY_MODULE).configure_parser(replay)
        replay.set_defaults(command=_replay_command)
    for command in (check, connectors, profiles, run, replay):
        # After the command too: its value, when given there, wins over one given before.
        _add_log_level(command, default=argparse.SUPPRESS)
    return parser


DEFAULT_LOG_LEVEL = "WARNING"
PROFILE_NAMES_HELP = (
    "A PROFILE with no / that does not end in .yaml or .yml is the name of a profile kvwire "
    "ships (kvwire profiles lists them); anything else is a path (./NAME reads a file of "
    "that name)."
)


def _add_log_level(parser: argparse.ArgumentParser, *, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help=f"logging threshold (default: {DEFAULT_LOG_LEVEL}); before or after the command",
    )


def _version() -> str:
    import kvwire

    return str(kvwire.__version__)


CHECK_DESCRIPTION = (
    "Validate each PROFILE, resolve its connector (and a composite's children), check "
    "their kv_connector_extra_config and apply the HMA gate; nothing is allocated or "
    "connected. Resolving a connector imports its module (a kv_connector_module_path, an "
    "installed plugin's entry point), which runs that module's code with your rights: "
    "check only profiles and plugins you trust. Secrets (passwords, tokens, URL "
    "credentials) are never printed."
)


def _argument_with_nul(arguments: Sequence[str]) -> str | None:
    """How to name the first argument holding a NUL byte (its option, or its position)."""
    for index, argument in enumerate(arguments):
        if "\x00" not in argument:
            continue
        option, equals, _ = argument.partition("=")
        if argument.startswith("--") and equals:
            return f"the value of {option}"
        if index and arguments[index - 1].startswith("-") and not argument.startswith("-"):
            return f"the value of {arguments[index - 1]}"
        return f"argument {index + 1}"
    return None


def _first_command(arguments: Sequence[str]) -> str | None:
    skip_next = False
    for argument in arguments:
        if skip_next:
            skip_next = False
        elif argument == "--log-level":
            skip_next = True
        elif not argument.startswith("-"):
            return argument
    return None


def _run_module() -> ModuleType:
    return importlib.import_module(RUN_MODULE)


def _run_missing(args: argparse.Namespace) -> int:
    print(
        f"kvwire run: error: the run command is not installed ({RUN_MODULE} is missing)",
        file=sys.stderr,
    )
    return 1


def _run_command(args: argparse.Namespace) -> int:
    status: int = _run_module().run(args)
    return status


def _replay_command(args: argparse.Namespace) -> int:
    status: int = importlib.import_module(REPLAY_MODULE).run(args)
    return status


# --------------------------------------------------------------------- check


def _check_command(args: argparse.Namespace) -> int:
    # Every profile is checked, so one run reports every broken one.
    statuses = [check_profile(profile, out=sys.stdout, err=sys.stderr) for profile in args.profiles]
    return max(statuses)


def check_profile(
    profile: str,
    *,
    registry: ConnectorRegistry | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """What `kvwire check` does: 0 when the profile is usable, else 1 with the error.

    Every line printed has the profile's secrets blanked, even where a
    plugin's error quotes one by value.
    """
    registry = registry or default_registry()
    origin = profile_origin(profile)
    secrets: set[str] = set()
    try:
        document = read_profile_file(profile_path(profile))
        secrets = secret_values(document)
        engine_config = structure_engine_config(document, origin=origin)
        lines = _check_lines(origin, engine_config, registry)
    except _USER_ERRORS as error:
        print(scrub(f"kvwire check: {origin}: error: {error}", secrets), file=err)
        return 1
    for line in lines:
        print(scrub(line, secrets), file=out)
    return 0


def _check_lines(
    profile: str, engine_config: EngineConfig, registry: ConnectorRegistry
) -> list[str]:
    lines = [f"profile {profile}: valid"]
    transfer = engine_config.kv_transfer_config
    if transfer is None or transfer.kv_connector is None:
        lines.append("connector: none (kv_transfer_config names no connector); nothing to resolve")
        return lines
    registry.check_module_path(transfer)
    connector_cls = registry.resolve(transfer)
    lines.append(
        f"connector: {transfer.kv_connector} -> {_origin(transfer, connector_cls, registry)}"
    )
    constructor = "constructor: accepts (config, role, kv_cache_config)"
    extra_config = f"extra config: {_extra_config_summary(connector_cls, transfer)}"
    if accepts_connector_builder(connector_cls):
        constructor += "; a composite, it receives a connector_builder for its children"
        lines.append(constructor)
        # Only a composite that validates its own extra config validates its
        # children's (through their classes), so only then do their lines say so.
        checks_children = validates_extra_config(connector_cls)
        lines.extend(_child_lines(transfer, registry, checks_children))
        if checks_children:
            extra_config += "; each child's by its own class (child lines above)"
    else:
        lines.append(constructor)
    # After the children were resolved, so that a child that cannot be
    # resolved is reported as _child_lines words it.
    try:
        with contained_exits():
            connector_cls.validate_extra_config(transfer, registry)
    except _USER_ERRORS as error:
        if not isinstance(error, PluginExit):
            raise
        raise ExtraConfigError(
            f"kv_connector_extra_config: {connector_cls.__name__}.validate_extra_config raised "
            f"{plugin_message(error)}"
        ) from None
    except Exception as error:
        # A plug-in's hook that raises anything else: its error, not a traceback of check's.
        raise ExtraConfigError(
            f"kv_connector_extra_config: {connector_cls.__name__}.validate_extra_config raised "
            f"{plugin_message(error)}"
        ) from None
    lines.append(extra_config)
    lines.append(
        f"kv_role: {transfer.kv_role} (producer: {_yes(transfer.is_kv_producer)}, "
        f"consumer: {_yes(transfer.is_kv_consumer)}); "
        f"load failure policy: {transfer.kv_load_failure_policy}"
    )

    def is_supported() -> bool:
        return registry.class_supports_hma(connector_cls, transfer)

    decision = decide_hma(engine_config.scheduler_config, connector_cls.__name__, is_supported)
    lines.append(f"HMA: {'enabled' if decision.enabled else 'disabled'} ({decision.reason})")
    refuse_at_start(engine_config, decision, connector_cls, registry)
    lines.append(describe_kv_cache_groups(engine_config, decision))
    lines.append("ok")
    return lines


def _child_lines(
    transfer: KVTransferConfig, registry: ConnectorRegistry, checks_children: bool
) -> list[str]:
    """One line per child a composite lists vLLM's way (`connectors` in extra config).

    Each child is resolved as its composite will resolve it, so a child that
    cannot be built fails the check here, with its index. `checks_children`:
    the composite validates each child's extra config, so each line says how.
    """
    children = transfer.kv_connector_extra_config.get("connectors")
    if not isinstance(children, list):
        return []
    lines = []
    for index, child in enumerate(children):
        where = f"kv_transfer_config.kv_connector_extra_config.connectors[{index}]"
        try:
            if not isinstance(child, Mapping):
                # Its type, never its value: a secret typed in the wrong place would be printed.
                raise ValueError(
                    f"expected a mapping of KVTransferConfig fields, got {kind_of(child)}"
                )
            # engine_id and kv_role default to the parent's, as vLLM's composite does.
            inherited = {"engine_id": transfer.engine_id, "kv_role": transfer.kv_role}
            child_config = KVTransferConfig(**{**inherited, **child})
            # Its module path was checked with its parent's (check_module_path).
            child_cls = registry.resolve(child_config)
            supported = registry.class_supports_hma(child_cls, child_config)
        except _USER_ERRORS as error:
            raise ValueError(f"{where}: {error}") from error
        line = (
            f"  child {index}: {child_config.kv_connector} -> "
            f"{_origin(child_config, child_cls, registry)}; supports HMA: {_yes(supported)}"
        )
        if checks_children:
            line += f"; extra config: {_extra_config_summary(child_cls, child_config)}"
        lines.append(line)
    return lines


def _extra_config_summary(connector_cls: type[KVConnectorBase], transfer: KVTransferConfig) -> str:
    """What checking `transfer`'s extra config through `connector_cls` established.

    Key names only: values may be secrets (a Redis password).
    """
    if not validates_extra_config(connector_cls):
        return f"not checked ({connector_cls.__name__} has no validate_extra_config)"
    keys = [str(key) for key in transfer.kv_connector_extra_config]
    if not keys:
        return f"valid (no keys given; {connector_cls.__name__}'s defaults apply)"
    return f"{len(keys)} key{'' if len(keys) == 1 else 's'} valid ({', '.join(keys)})"


def _origin(
    transfer: KVTransferConfig, connector_cls: type[KVConnectorBase], registry: ConnectorRegistry
) -> str:
    qualified = f"{connector_cls.__module__}:{connector_cls.__qualname__}"
    if transfer.kv_connector_module_path:
        return (
            f"{qualified} (module path {transfer.kv_connector_module_path}, "
            "which wins over the registry)"
        )
    entry = registry.entry(str(transfer.kv_connector))
    if entry.distribution:
        return f"{qualified} ({entry.source.value} of distribution {entry.distribution})"
    return f"{qualified} ({entry.source.value})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# ------------------------------------------------------------------ profiles


def _profiles_command(args: argparse.Namespace) -> int:
    return list_profiles(show=args.show, out=sys.stdout, err=sys.stderr)


def list_profiles(
    *, show: str | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """What `kvwire profiles` does: a table of the shipped profiles, or one's YAML (`show`)."""
    if show is not None:
        try:
            text = shipped_profile_path(show).read_text(encoding="utf-8")
        except KVWireError as error:
            print(f"kvwire profiles: --show: error: {error}", file=err)
            return 1
        print(text, end="", file=out)
        return 0
    names = shipped_profile_names()
    if not names:
        print(
            "kvwire profiles: error: this installation of kvwire has no shipped profiles "
            "(kvwire/profiles/ is missing: reinstall kvwire)",
            file=err,
        )
        return 1
    rows = [["NAME", "CONNECTOR", "WHAT IT IS"]]
    for name in names:
        text = shipped_profile_path(name).read_text(encoding="utf-8")
        rows.append([name, _connector_of(text), _summary_of(text)])
    _print_table(rows, out)
    print(file=out)
    folder = shipped_profile_path(names[0]).parent
    print(f"files: {folder}; copy one (kvwire profiles --show NAME) to edit it", file=out)
    return 0


def _connector_of(text: str) -> str:
    # The shipped profiles are kvwire's own, valid YAML (tests/package/test_shipped_configs.py).
    import yaml

    document = yaml.safe_load(text) or {}
    transfer = document.get("kv_transfer_config") or {}
    connector = transfer.get("kv_connector", "-")
    medium = (transfer.get("kv_connector_extra_config") or {}).get("medium")
    return f"{connector} ({medium})" if medium else str(connector)


def _summary_of(text: str) -> str:
    """The first sentence of the profile's opening comment."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#   "):
            break
        comment.append(line.lstrip("# ").strip())
    first = " ".join(comment).split(". ")[0].split("; ")[0].rstrip(".")
    return first.split(": ", 1)[-1] if first else "-"


# ---------------------------------------------------------------- connectors


def _connectors_command(args: argparse.Namespace) -> int:
    return list_connectors(resolve=args.resolve, out=sys.stdout)


def list_connectors(
    *, resolve: bool, registry: ConnectorRegistry | None = None, out: TextIO = sys.stdout
) -> int:
    """What `kvwire connectors` does; imports connector modules only when `resolve`."""
    registry = registry or default_registry()
    header = ["NAME", "SOURCE", "MODULE"] + (["HMA"] if resolve else [])
    rows = [header]
    failed = False
    for entry in registry.entries():
        source = entry.source.value
        if entry.distribution:
            source = f"{source} ({entry.distribution})"
        row = [entry.name, source, entry.target]
        if resolve:
            try:
                row.append(describe_class_support(registry.get_class(entry.name)))
            except _USER_ERRORS as error:
                failed = True
                row.append(f"error: {error}")
        rows.append(row)
    _print_table(rows, out)
    # The media the offload connectors can keep blocks in (kv_connector_extra_config.medium).
    print(file=out)
    media = [["MEDIUM", "SOURCE", "MODULE"]]
    media += [[m.name, m.origin, m.target] for m in registry.media.entries()]
    _print_table(media, out)
    # The eviction policies a CPU pool can use (kv_connector_extra_config.eviction).
    print(file=out)
    policies = [["EVICTION", "SOURCE", "MODULE"]]
    policies += [[p.name, p.origin, p.target] for p in registry.eviction_policies.entries()]
    _print_table(policies, out)
    return 1 if failed else 0


def _print_table(rows: list[list[str]], out: TextIO) -> None:
    # Pad every column but the last, which may hold a long error text.
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip(), file=out)
