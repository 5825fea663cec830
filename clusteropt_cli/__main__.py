"""`python -m clusteropt_cli` runs the copt CLI."""

from clusteropt_cli.app import main

if __name__ == "__main__":
    main()
