"""Agreement: the request record, the check that every rank describes the
same collective, and join's protocol.
"""
