"""What the user's model is made of: which parameters are sparse (module rule and fx
trace), the stand-in layers that read them from the tables, the ids of a step's lookups
computed ahead of the forward, and the programs that cannot train exactly.
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
