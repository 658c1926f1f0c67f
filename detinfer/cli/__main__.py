"""``python -m detinfer.cli``: the ``detinfer`` command."""

from . import main

main()
