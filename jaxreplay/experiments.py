"""`python -m jaxreplay.experiments`: the paper's sweeps (the code is `jaxreplay.science.runner`).

  python -m jaxreplay.experiments --sweep=fig1 --seeds=4 --out=experiments
  python -m jaxreplay.experiments --sweep=all --out=experiments --parallel=2
"""
import sys

from jaxreplay.science.runner import main

if __name__ == "__main__":
  sys.exit(main())
