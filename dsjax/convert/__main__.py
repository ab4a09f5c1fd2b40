"""`python -m dsjax.convert ...`: the converter's command line (`cli`), run on the CPU."""

import os
import sys

import jax

from dsjax.convert.cli import main

if __name__ == "__main__":
    # Conversion is host work: keep JAX off any accelerator (and its memory) unless told otherwise.
    # The package, imported before this file runs, has imported jax (which read JAX_PLATFORMS
    # then) but started no backend, so the platform is still ours to choose.
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
    sys.exit(main())
