"""How ``--help`` reads: a plain usage line, arguments by name, examples printed as written.

Typer's plain formatting shows ``{SRC} {DST}`` on the usage line and ``SRC <str>`` in
the arguments, and click re-wraps an epilog's lines to the terminal, splitting an
example command (``--world-`` / ``size 4``) so it no longer runs when pasted.
"""

from __future__ import annotations

import copy

from typer.core import TyperCommand

EXAMPLES_INTRO = "Examples (they run as written after `bash scripts/demo.sh`, on its checkpoint):"


def examples(*lines: str, intro: str = EXAMPLES_INTRO) -> str:
    """Return an epilog of example command ``lines`` that click prints as they are, one per line."""
    # click leaves a paragraph whose first line is \b as it is: no re-wrapping.
    return intro + "\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


class HelpCommand(TyperCommand):
    """A command whose help names its arguments as their metavars (``SRC``), with no type."""

    def listed_names(self, param) -> list[str]:
        """Return the names ``--help`` lists for option ``param`` (all of them, here)."""
        return list(param.opts)

    def _listed(self, param):
        """Return ``param`` as ``--help`` shows it: only the names ``listed_names`` keeps."""
        names = self.listed_names(param)
        if names == list(param.opts):
            return param
        shown = copy.copy(param)
        shown.opts = names
        return shown

    def _arguments(self, ctx):
        return [p for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def collect_usage_pieces(self, ctx) -> list[str]:
        """Return the usage line after the command's name: ``[OPTIONS] SRC DST``."""
        head = [self.options_metavar] if self.options_metavar else []
        return head + [p.metavar or p.name.upper() for p in self._arguments(ctx)]

    def format_options(self, ctx, formatter) -> None:
        """Write the arguments (name and help) and the options."""
        rows = [(p.metavar or p.name.upper(), p.help or "") for p in self._arguments(ctx)]
        if rows:
            with formatter.section("Arguments"):
                formatter.write_dl(rows)
        options = [
            record
            for p in self.get_params(ctx)
            if p.param_type_name == "option"
            and (record := self._listed(p).get_help_record(ctx)) is not None
        ]
        if options:
            with formatter.section("Options"):
                formatter.write_dl(options)
