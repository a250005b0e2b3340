"""The machinery of one step, below every other layer: the all_to_all hop and its byte
counting, server-held and replicated tables, dense AllReduce (DDP, hierarchical), the
optimizer applied per shard, and each rank's progress record.
"""
