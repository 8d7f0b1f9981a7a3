"""`python -m moetrain` runs the `moetrain` command."""

from moetrain.cli import main

main()
