"""`python -m train.plan`: the CLI lives in train/plan/cli.py."""
import sys

from train.plan.cli import main

sys.exit(main())
