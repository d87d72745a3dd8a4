"""The `jpaged` command line (typer): the app and its commands, thin over the package.

The commands live by what they do: generate and chat in jpaged/cli_generate.py, serve and
run-batch in jpaged/cli_serve.py, bench, tune, estimate and convert in jpaged/cli_tools.py.
Their engine flags are derived from EngineArgs (jpaged/cli_engine_flags.py).
"""

from __future__ import annotations

import typer

from jpaged.cli_engine_flags import ENGINE_FLAGS
from jpaged.cli_generate import chat, generate
from jpaged.cli_serve import run_batch, serve
from jpaged.cli_tools import bench, convert, estimate, tune

__all__ = ["ENGINE_FLAGS", "app", "main"]

app = typer.Typer(help="jpaged: a JAX inference engine with a vLLM-style paged KV cache.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.callback()
def _root() -> None:
    """jpaged: a JAX inference engine with a vLLM-style paged KV cache."""


for _command in (generate, estimate, convert, serve, chat, bench, tune):
    app.command()(_command)
app.command("run-batch")(run_batch)


def config_args(path: str) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of flag names (dashes or underscores) to values,
    as command-line arguments (true: `--x`, false: `--no-x`, an object: its JSON, a list:
    its items). A missing file or a file that is not such a mapping is a ValueError."""
    import json

    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must map flag names to values, got "
                         f"{type(data).__name__}")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


# Flags that take several values in vLLM (argparse nargs="+"): `--served-model-name a b` is
# read as the flag once per value.
LIST_FLAGS = frozenset({"--served-model-name", "--lora-modules"})


def normalize_argv(argv: list[str]) -> list[str]:
    """The arguments as vLLM's parser reads them: `--max_model_len` is `--max-model-len`,
    `--served-model-name a b` gives both names, and `--config FILE`'s flags come right after
    the command, so the command line's own win."""
    args: list[str] = []
    config: list[str] = []
    it = iter(argv)
    pending: str | None = None  # a list flag whose values are being read
    got = 0  # values it has had
    for arg in it:
        if pending is not None and not arg.startswith("-") and arg != "--":
            args += [pending, arg]
            got += 1
            continue
        if pending is not None and not got:
            args.append(pending)  # no value: the parser names the flag that lacks one
        pending = None
        if arg == "--":  # what follows is not options
            args += [arg, *it]
            break
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            name = name.replace("_", "-")
            arg = name + eq + value
            if name == "--config":
                config += config_args(value if eq else next(it, ""))
                continue
            if name in LIST_FLAGS and not eq:
                pending, got = name, 0
                continue
        args.append(arg)
    if pending is not None and not got:
        args.append(pending)
    if config:
        at = next((i + 1 for i, a in enumerate(args) if not a.startswith("-")), len(args))
        args[at:at] = config
    return args


def main() -> None:
    """Entry point of the `jpaged` script and `python -m jpaged.cli`: vLLM's spellings of the
    arguments (underscores, `--config FILE`) read, then the typer app."""
    import sys

    try:
        argv = normalize_argv(sys.argv[1:])
    except ValueError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from None
    app(args=argv)


if __name__ == "__main__":
    main()
