"""`python -m train.score`: the CLI lives in train/score/cli.py."""
import sys

from train.score.cli import main

sys.exit(main())
