"""`python -m moetrain` runs the `moetrain` command."""

from moetrain.cli import main

# Guarded: worker processes (parallel.nproc_per_node > 1) re-import the main module when they start.
if __name__ == "__main__":
    main()
