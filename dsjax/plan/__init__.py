"""The parallelism planner: layouts (candidates), profiles (devices), estimate (the analytic
model), compiled (proof by compiling), planner (ranking), auto (launch.py's plan=auto), cli
(`python -m dsjax.plan`). docs/planner.md."""
