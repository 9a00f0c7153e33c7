"""The ``staged-engine`` command: ``main.py`` parses, one module per group of subcommands."""
