"""What a run observes of itself: each step's phase times and timeline (`phases`), and every
rank's progress in the job's store, which names the rank a failed collective waited for
(`progress`).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
