"""``python -m kimi_k3.hf import ...`` / ``export ...``: the command line of kimi_k3.hf.cli."""

import sys

from kimi_k3.hf.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
