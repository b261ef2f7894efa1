from areal.cli.main import cli

cli()
