"""Where each parameter lives and how it is synchronised: the architectures, the Table 3
bytes model, the printable plan, and the measured sparsity (α) that can move a table to
AllReduce.
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
