"""``tfdist launch --config FILE`` (a TOML file of its options) and ``--write-config FILE``."""

from __future__ import annotations

import argparse
import json
import sys

from tfdist.core.config import ConfigError  # a TensorFlow-free leaf

__all__ = ["with_config", "write_config"]


# Not options: what argparse adds, and what a config file must not set.
_NOT_CONFIG = ("script", "args", "config", "write_config", "func", "launch_parser", "command")
_CONFIG_NAMES = {"nproc_per_node": "nproc"}  # long option name -> its dest, where they differ


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """The options of a ``--config`` TOML file, as ``parser`` defaults (checked)."""
    import tomllib

    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(
            f"launch: config must be a readable TOML file ({err}). Received: config={path!r}"
        ) from None
    defaults = vars(parser.parse_args([]))
    values = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        dest = _CONFIG_NAMES.get(dest, dest)
        if dest not in defaults or dest in _NOT_CONFIG:
            raise ConfigError(
                f"launch: config keys must be long option names of tfdist launch. Received: "
                f"{key}={value!r} in {path}. See tfdist launch --help (e.g. nproc-per-node = 2)."
            )
        flag = isinstance(defaults[dest], bool)
        if flag != isinstance(value, bool):
            what = "true or false" if flag else "a value, not true or false"
            raise ConfigError(f"launch: {key} must be {what}. Received: {key}={value!r} in {path}")
        values[dest] = value
    return values


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string uses JSON's escapes


def write_config(args: argparse.Namespace) -> int:
    """``--write-config FILE``: the options in effect, as a file for ``--config``."""
    names = {dest: name for name, dest in _CONFIG_NAMES.items()}
    lines = [
        f"{names.get(dest, dest).replace('_', '-')} = {_toml_value(value)}"
        for dest, value in sorted(vars(args).items())
        if dest not in _NOT_CONFIG and value is not None
    ]
    with open(args.write_config, "w", encoding="utf-8") as file:
        file.write("# tfdist launch --config FILE; command-line flags override it\n")
        file.write("\n".join(lines) + "\n")
    print(f"tfdist launch: wrote {args.write_config}", file=sys.stderr)
    return 0


def with_config(parser, args: argparse.Namespace, argv) -> argparse.Namespace:
    """With ``launch --config FILE``: ``argv`` parsed again, FILE's options as defaults."""
    path = getattr(args, "config", None)
    if not path:
        return args
    args.launch_parser.set_defaults(**_config_defaults(args.launch_parser, path))
    return parser.parse_args(argv)
