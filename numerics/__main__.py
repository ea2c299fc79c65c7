"""``python -m numerics`` runs the `numerics` command line."""

from numerics.cli import main

if __name__ == "__main__":
    main()
