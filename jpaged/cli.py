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


def main() -> None:
    """Entry point for `python -m jpaged.cli`."""
    app()


if __name__ == "__main__":
    main()
