"""``python -m europa.cli``: the same as the ``europa`` command (handy under torchrun)."""

from europa.cli.app import main

main()
