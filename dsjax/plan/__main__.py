"""`python -m dsjax.plan ...` (dsjax/plan/cli.py)."""

from dsjax.plan.cli import main

main()
