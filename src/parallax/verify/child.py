"""``python child.py SCRIPT ARGS``: run SCRIPT as ``python SCRIPT ARGS`` would, for
``parallax verify`` (both runs, every worker), with torch's default dtype float64 when asked.

Started by path (``parallax run`` takes a script), so the first thing it does is put SCRIPT's
folder where Python put this one's: the program imports what it imports on its own.
"""

import os
import runpy
import sys


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    from parallax.verify.record import active

    verification = active()
    if verification is not None and verification.float64:
        import torch

        torch.set_default_dtype(torch.float64)
    if verification is not None and verification.role == "original":
        from parallax.verify.original import install

        install(verification, script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
