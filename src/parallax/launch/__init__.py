"""Starting workers: torch's elastic agent, the executors that start a machine's agent
(local, network namespace, ssh), and the emulated cluster.
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
