"""``schedule_port.py``'s program trained twice in one process, one run after the other (a
notebook cell run again): for tests/integration/test_verify.py, whose ``parallax verify``
compares each run's model with its one-process reference."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import schedule_port  # noqa: E402

if __name__ == "__main__":
    schedule_port.main()
    schedule_port.main()
