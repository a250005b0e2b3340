"""The update of server-held rows: the user's optimizer class applied per shard
(`shard_optimizer`), deferred SGD rows (`deferred_sgd`), and the global gradient norm and
finiteness over replicas and shards alike (`grad_norm`).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
