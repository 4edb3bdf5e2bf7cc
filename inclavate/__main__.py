"""``python -m inclavate``: the same command as the ``inclavate`` console script."""

from inclavate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
