"""`python run.py PROMPT ...` is `python -m tinykv generate PROMPT ...`."""

import sys

from tinykv.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]], generate_prog="run.py"))
