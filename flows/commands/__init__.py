"""One module per CLI command group; each defines `register(app: typer.Typer) -> None`."""
