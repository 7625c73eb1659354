"""vLLM's `serve --config FILE`: flags read from a YAML file, as deployments keep them.

Each key is a flag's name, with dashes or underscores (`max-model-len`, `max_model_len`); its value
is what follows the flag: `true` sets a switch and `false` leaves it unset (or writes `--no-KEY` for a
switch that has that form), a list gives one value per item (`served-model-name: [a, b]`), a mapping
is written as JSON (`override-generation-config`), null is left out. `model` names the model unless
the command line does. As in vLLM the command line wins: the file's flags go before its own, and
argparse takes the last value given.

Torch-free, like the rest of the parser.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

CONFIG_FLAG = "--config"


def expand_config(argv: list[str], serve: argparse.ArgumentParser) -> list[str]:
    """`argv` (after `serve`) with `--config FILE` replaced by the file's flags, placed before the
    command line's own; argparse errors (exit 2) for a missing, unreadable or malformed file."""
    at = next((i for i, arg in enumerate(argv) if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "=")), None)
    if at is None:
        return argv
    if argv[at] == CONFIG_FLAG:
        if at + 1 == len(argv):
            serve.error(f"{CONFIG_FLAG} needs a YAML file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    if any(arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "=") for arg in rest):
        serve.error(f"{CONFIG_FLAG} is given more than once")
    settings = _read(path, serve)
    switches = {option for action in serve._actions for option in action.option_strings  # noqa: SLF001
                if action.nargs == 0}
    flags: list[str] = []
    for key, value in settings.items():
        name = "--" + str(key).replace("_", "-")
        if name == "--model":
            if not _names_a_model(rest, serve):
                flags += ["--model", str(value)]
        elif value is None:
            continue
        elif isinstance(value, bool):
            negative = "--no-" + name[2:]
            flags += [name] if value else [negative] if negative in switches else []
        elif name in switches:
            serve.error(f"{CONFIG_FLAG} {path}: {key!r} is a switch; give it true or false, not {value!r}")
        elif isinstance(value, list):
            flags += [name, *map(_text, value)]
        else:
            flags += [name, _text(value)]
    return flags + rest


def _read(path: str, serve: argparse.ArgumentParser) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            settings = yaml.safe_load(f)
    except OSError as exc:
        serve.error(f"{CONFIG_FLAG} {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        serve.error(f"{CONFIG_FLAG} {path} is not YAML: {exc}")
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        serve.error(f"{CONFIG_FLAG} {path} must hold a mapping of flag names to values, not a {type(settings).__name__}")
    return settings


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _names_a_model(argv: list[str], serve: argparse.ArgumentParser) -> bool:
    """Whether the command line gives the model, by argument or by --model."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in argv):
        return True
    known, _ = serve.parse_known_args(argv)
    return known.model is not None
