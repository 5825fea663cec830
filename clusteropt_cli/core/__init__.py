"""copt's work, importable without a terminal: no typer, no rich."""
