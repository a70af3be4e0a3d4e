"""The Horovod-shaped API both adapters export: process sets, objects,
elastic state, the timeline, capabilities.
"""
