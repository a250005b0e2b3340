"""The machinery of one step, below every other layer, by concern: `tables` (sparse rows, the
exchanges that move them, the handles in the user's model), `dense_sync` (replicated dense
parameters: DDP's comm hooks or servers), `optimizers` (the update of server-held rows, the
global norm), `asynchronous` (server threads for asynchronous training) and `diagnostics`
(phase times, every rank's progress).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
