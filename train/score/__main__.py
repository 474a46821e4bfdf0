"""`python -m train.score`: the CLI lives in train/score/cli.py (imported by the package too, which
it could not be from here without runpy warning that __main__ was imported twice)."""
import sys

from train.score.cli import main

sys.exit(main())
