"""`python -m blockdraft` == the `blockdraft` command."""

from blockdraft.cli import main

main()
