"""Asynchronous training (`Config.sync` ``"async"``/``"async-sparse"``): server threads that
apply each worker's push as it arrives (`async_server`), the workers' side and the staleness
bound (`async_training`), and the table kind that pulls and pushes through them
(`async_table`).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
