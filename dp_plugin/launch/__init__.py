"""Launch: which launcher started this process, where it sits in the job,
and the process-wide runtime (``init``).
"""
