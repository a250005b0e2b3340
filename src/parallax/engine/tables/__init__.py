"""Where a sparse parameter's rows live and how they travel: the `Table` contract
(`table`), its server-held (`server_table`) and replicated (`replicated`) kinds, the all_to_all
hop and its byte counting (`exchange`, `hierarchy` for the machine leaders), lookup options
(`lookup_options`), the partition thread pool (`pool`), the push during the backward
(`early_push`), and the handles that stand in for a server-held parameter in the user's model
(`handles`).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
