"""``python -m inshrink_store._cli``: the ``inshrink`` command (the CLI layer, the package's
top layer)."""

from inshrink_store._cli import main

if __name__ == "__main__":
    main()
