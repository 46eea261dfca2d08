"""The command line: the Typer app (``app``), one module per command, shared option types,
rendering. Builds a request and calls the library; imports torch only when a command runs."""
