"""Reduction: bucket planning, fusion buffers, the Reducer, comm hooks,
compression, sharded optimizer state, the array backends.
"""
