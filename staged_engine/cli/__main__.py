"""``python -m staged_engine.cli``: the ``staged-engine`` command."""
import sys

from staged_engine.cli.main import main

sys.exit(main())
