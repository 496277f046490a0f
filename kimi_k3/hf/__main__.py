"""``python -m kimi_k3.hf import ...`` / ``export ...``: the command line of kimi_k3.hf.cli."""

import sys

from kimi_k3.hf.cli import main

if __name__ == "__main__":
    sys.argv[0] = "python -m kimi_k3.hf"  # the program its one-line errors name
    main(sys.argv[1:], process=True)
