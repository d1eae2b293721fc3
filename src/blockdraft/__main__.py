"""`python -m blockdraft` == the `blockdraft` command."""

from blockdraft.cli import main

if __name__ == "__main__":
    main()
